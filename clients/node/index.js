// snowflake-thrift-client: a pool of Thrift connections with failover across snowflake
// servers, the errors it throws, and decode/compose of ids on BigInt.
//
//   const { SnowflakePool, decode } = require("snowflake-thrift-client");
//   const pool = new SnowflakePool(["10.0.0.1:7609", "10.0.0.2:7609"], { agent: "my-service" });
//   const id = await pool.getId();          // a BigInt
//   decode(id).time;                        // when it was made
//   await pool.close();
"use strict";

const client = require("./client");
const decode = require("./decode");
const errors = require("./errors");

// Assigned one by one so that Node's ES-module loader sees named exports too.
exports.SnowflakePool = client.SnowflakePool;
exports.DEFAULT_AGENT = client.DEFAULT_AGENT;
exports.DEFAULT_PORT = client.DEFAULT_PORT;
exports.parseServer = client.parseServer;
exports.DEFAULT_LAYOUT = decode.DEFAULT_LAYOUT;
exports.decode = decode.decode;
exports.compose = decode.compose;
exports.layoutFromJSON = decode.layoutFromJSON;
exports.SnowflakeError = errors.SnowflakeError;
exports.ConfigurationError = errors.ConfigurationError;
exports.RequestError = errors.RequestError;
exports.ClockMovedBackwardsError = errors.ClockMovedBackwardsError;
exports.InvalidUserAgentError = errors.InvalidUserAgentError;
exports.InvalidCountError = errors.InvalidCountError;
exports.UnavailableError = errors.UnavailableError;
exports.CallFailedError = errors.CallFailedError;
exports.ConnectionFailedError = errors.ConnectionFailedError;
exports.CallTimedOutError = errors.CallTimedOutError;
exports.NoServerAvailableError = errors.NoServerAvailableError;
exports.NoServerAnsweredError = errors.NoServerAnsweredError;
exports.version = require("./package.json").version;
