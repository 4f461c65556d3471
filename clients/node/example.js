// Call the snowflake service from Node.js with Apache Thrift (npm `thrift`).
//
//   make stubs                 # generates clients/node/gen-nodejs from idl/
//   npm ci                     # in clients/node
//   node example.js [HOST [PORT]]
//
// i64 values arrive as node-int64 objects. Ids are larger than 2^53, so a JS
// Number cannot hold them: convert with BigInt, never with Number() or +x.
"use strict";

const thrift = require("thrift");
const Snowflake = require("./gen-nodejs/Snowflake");
const { InvalidUserAgentError, InvalidSystemClock } = require("./gen-nodejs/snowflake_types");

/** An i64 from the generated code (node-int64) as an exact BigInt. */
function toBigInt(int64) {
  return int64.buffer.readBigInt64BE(int64.offset);
}

async function main() {
  const host = process.argv[2] || "127.0.0.1";
  const port = Number(process.argv[3] || 7609);
  const connection = thrift.createConnection(host, port, {
    transport: thrift.TFramedTransport, // the server's default; TBufferedTransport for --transport buffered
    protocol: thrift.TBinaryProtocol,
    connect_timeout: 5000,
    max_attempts: 1,
  });
  connection.on("error", (err) => {
    console.error("connection error:", err.message);
    process.exitCode = 1;
  });
  const client = thrift.createClient(Snowflake, connection);
  try {
    const id = toBigInt(await client.get_id("example-node"));
    console.log(id.toString());
    for (const each of await client.get_ids("example-node", 3)) {
      console.log(toBigInt(each).toString());
    }
    try {
      await client.get_id("not a valid agent");
    } catch (e) {
      if (e instanceof InvalidUserAgentError) console.error("refused:", e.message);
      else if (e instanceof InvalidSystemClock) console.error("clock:", e.message); // try another server
      else throw e;
    }
  } finally {
    connection.end();
  }
}

main().catch((err) => {
  console.error(err);
  process.exit(1);
});
