// A pool of Thrift connections to one or more snowflake servers, with failover: the
// Node.js counterpart of the Python client's SnowflakePool, over the stubs that
// `make stubs` generates from idl/snowflake.thrift (shipped in the npm package).
"use strict";

const net = require("node:net");
const { performance } = require("node:perf_hooks");
const thrift = require("thrift");

const Snowflake = require("./gen-nodejs/Snowflake");
const idl = require("./gen-nodejs/snowflake_types");
const errors = require("./errors");

const {
  CallFailedError,
  CallTimedOutError,
  ClockMovedBackwardsError,
  ConfigurationError,
  ConnectionFailedError,
  InvalidCountError,
  InvalidUserAgentError,
  NoServerAvailableError,
  RequestError,
  UnavailableError,
} = errors;

const DEFAULT_PORT = 7609;
const DEFAULT_AGENT = "snowflake-node";
const TRANSPORTS = { framed: thrift.TFramedTransport, buffered: thrift.TBufferedTransport };

// The IDL's exceptions, as this package's errors (the names of the Python client's).
const DECLARED = [
  [idl.InvalidSystemClock, (m, cause) => new ClockMovedBackwardsError(behindMs(m), m, { cause })],
  [idl.InvalidUserAgentError, (m, cause) => new InvalidUserAgentError(m, { cause })],
  [idl.InvalidCountError, (m, cause) => new InvalidCountError(m, { cause })],
  [idl.UnavailableError, (m, cause) => new UnavailableError(m, { cause })],
];

function behindMs(message) {
  const found = /(\d+) milli/.exec(message);
  return found ? Number(found[1]) : 0;
}

function positiveMs(name, value) {
  if (typeof value !== "number" || !Number.isFinite(value) || value <= 0) {
    throw new ConfigurationError(`${name} must be a positive number of milliseconds, got ${String(value)}`);
  }
  return value;
}

/** `{host, port, address}` from "host:port", "[v6]:port", "host", or {host, port}. */
function parseServer(server) {
  let host;
  let port = DEFAULT_PORT;
  if (typeof server === "string") {
    const bracketed = /^\[([^\]]+)\](?::(\d+))?$/.exec(server);
    const plain = /^([^:[\]]+)(?::(\d+))?$/.exec(server);
    const found = bracketed || plain;
    if (!found) throw new ConfigurationError(`a server is "host:port", got ${JSON.stringify(server)}`);
    host = found[1];
    if (found[2] !== undefined) port = Number(found[2]);
  } else if (server !== null && typeof server === "object") {
    host = server.host;
    if (server.port !== undefined) port = server.port;
  }
  if (typeof host !== "string" || host === "") {
    throw new ConfigurationError(`a server needs a host, got ${JSON.stringify(server)}`);
  }
  if (!Number.isInteger(port) || port < 1 || port > 65535) {
    throw new ConfigurationError(`a server's port is 1..65535, got ${String(port)} in ${JSON.stringify(server)}`);
  }
  const address = host.includes(":") ? `[${host}]:${port}` : `${host}:${port}`;
  return Object.freeze({ host, port, address });
}

/** An i64 of the generated code (a node-int64) as an exact BigInt. */
function toBigInt(int64) {
  return int64.buffer.readBigInt64BE(int64.offset);
}

/**
 * One connection to one server; one call at a time (the pool lends it to one caller).
 * A declared error leaves it open; any other failure closes it.
 */
class Connection {
  constructor(server, { transport, timeoutMs, connectTimeoutMs }) {
    this.server = server;
    this.address = server.address;
    this._transport = transport;
    this._timeoutMs = timeoutMs;
    this._connectTimeoutMs = connectTimeoutMs;
    this._stream = null;
    this._client = null;
    this._broken = null; // rejects the call in flight when the connection breaks
  }

  get isOpen() {
    return this._client !== null;
  }

  async open() {
    if (this._client !== null) return;
    const stream = net.createConnection({ host: this.server.host, port: this.server.port });
    // No reconnecting (max_attempts unset): a broken connection is dropped, and the pool
    // opens another one.
    const connection = new thrift.Connection(stream, { transport: this._transport, protocol: thrift.TBinaryProtocol });
    try {
      await new Promise((resolve, reject) => {
        const timer = setTimeout(() => reject(new CallTimedOutError(this.address, "connect timed out", { connected: false })), this._connectTimeoutMs);
        const failed = (err) => reject(new ConnectionFailedError(this.address, `cannot connect: ${err.message}`, { connected: false, cause: err }));
        stream.once("error", failed);
        connection.once("connect", () => {
          clearTimeout(timer);
          stream.removeListener("error", failed);
          resolve();
        });
      });
    } catch (e) {
      stream.destroy();
      throw e;
    }
    stream.setKeepAlive(true);
    this._broken = null;
    this._failure = null;
    const broke = (why, cause) => {
      this._failure = this._failure || new ConnectionFailedError(this.address, why, { connected: true, cause });
      if (this._broken) this._broken(this._failure);
    };
    connection.on("error", (err) => broke(`${err.message} (the connection was closed)`, err));
    connection.on("close", () => broke("the server closed the connection"));
    this._stream = stream;
    this._client = thrift.createClient(Snowflake, connection);
  }

  /** Call `method` with `args`; resolves to its result, or rejects with this package's error. */
  async call(method, ...args) {
    await this.open();
    if (this._failure) {
      const failure = this._failure;
      this.close();
      throw failure;
    }
    let timer;
    try {
      return await new Promise((resolve, reject) => {
        this._broken = reject;
        timer = setTimeout(() => reject(new CallTimedOutError(this.address, "timed out", { connected: true })), this._timeoutMs);
        this._client[method](...args, (err, result) => (err ? reject(err) : resolve(result)));
      });
    } catch (e) {
      for (const [cls, make] of DECLARED) {
        if (e instanceof cls) throw make(String(e.message || ""), e); // the connection stays good
      }
      this.close(); // a reply may still come: this connection is done
      if (e instanceof CallFailedError) throw e;
      const reason = e instanceof thrift.TApplicationException ? `application error (${e.type}): ${e.message}` : String(e && e.message ? e.message : e);
      throw new CallFailedError(this.address, reason, { connected: true, cause: e });
    } finally {
      clearTimeout(timer);
      this._broken = null;
    }
  }

  close() {
    const stream = this._stream;
    this._stream = null;
    this._client = null;
    if (stream !== null) stream.destroy();
  }
}

/**
 * A client for one or more snowflake servers: each call borrows a connection (an idle one,
 * or a new one, new ones spread over the servers in turn) and returns it after.
 *
 * Failover, as the Python SnowflakePool does: a call that fails with a CallFailedError (no
 * connection, a timeout, a dropped connection) or that a server refuses for itself
 * (ClockMovedBackwardsError, UnavailableError) is tried again on another server, up to
 * `attempts` tries (default: one per server, plus one); a server that failed goes to the
 * back of the order for `retryFailedAfterMs`. A failure on a connection that sat idle (the
 * server may have closed it) is retried on a fresh one without counting. When no try is
 * left: NoServerAvailableError (NoServerAnsweredError if every try timed out). The caller's
 * own errors, InvalidUserAgentError and InvalidCountError, are thrown at once: every server
 * would refuse them.
 */
class SnowflakePool {
  constructor(servers = [`127.0.0.1:${DEFAULT_PORT}`], options = {}) {
    const known = ["agent", "transport", "timeoutMs", "connectTimeoutMs", "attempts", "poolSize", "retryFailedAfterMs", "clock"];
    for (const key of Object.keys(options)) {
      if (!known.includes(key)) throw new ConfigurationError(`unknown option ${JSON.stringify(key)}: expected ${known.join(", ")}`);
    }
    const list = typeof servers === "string" || !Array.isArray(servers) ? [servers] : servers;
    const unique = new Map();
    for (const each of list) {
      const server = parseServer(each);
      unique.set(server.address, server);
    }
    if (unique.size === 0) throw new ConfigurationError("no servers given");
    this._servers = [...unique.values()];
    this.agent = options.agent === undefined ? DEFAULT_AGENT : options.agent;
    const transport = options.transport === undefined ? "framed" : options.transport;
    if (!(transport in TRANSPORTS)) {
      throw new ConfigurationError(`transport must be one of ${Object.keys(TRANSPORTS).join(", ")}, got ${JSON.stringify(transport)}`);
    }
    const timeoutMs = positiveMs("timeoutMs", options.timeoutMs === undefined ? 5000 : options.timeoutMs);
    this._options = {
      transport: TRANSPORTS[transport],
      timeoutMs,
      connectTimeoutMs: positiveMs("connectTimeoutMs", options.connectTimeoutMs === undefined ? timeoutMs : options.connectTimeoutMs),
    };
    const { attempts, poolSize = 8, retryFailedAfterMs = 1000, clock = () => performance.now() } = options;
    if (attempts !== undefined && !(Number.isInteger(attempts) && attempts >= 1)) {
      throw new ConfigurationError(`attempts must be at least 1, got ${String(attempts)}`);
    }
    if (!(Number.isInteger(poolSize) && poolSize >= 0)) throw new ConfigurationError(`poolSize must be 0 or more, got ${String(poolSize)}`);
    if (!(typeof retryFailedAfterMs === "number" && retryFailedAfterMs >= 0)) {
      throw new ConfigurationError(`retryFailedAfterMs must be 0 or more, got ${String(retryFailedAfterMs)}`);
    }
    if (typeof clock !== "function") throw new ConfigurationError("clock must be a function that returns milliseconds");
    this._attempts = attempts;
    this._poolSize = poolSize;
    this._retryFailedAfterMs = retryFailedAfterMs;
    this._clock = clock;
    this._idle = []; // a stack: the most recently used last
    this._downUntil = new Map();
    this._turn = 0;
    this._closed = false;
  }

  /** The servers, as "host:port". */
  get servers() {
    return this._servers.map((s) => s.address);
  }

  /** One new id. */
  async getId(agent) {
    return toBigInt(await this._call("get_id", agent === undefined ? this.agent : agent));
  }

  /** `count` new ids (1..4096 by default), increasing, in one round trip. */
  async getIds(count, agent) {
    // The IDL's i32: Thrift's encoder would wrap a larger one (2**32+3 asked 3 ids).
    if (!Number.isInteger(count) || count < -(2 ** 31) || count > 2 ** 31 - 1) {
      throw new ConfigurationError(`count must be an integer (an i32 in the IDL), got ${String(count)}`);
    }
    const ids = await this._call("get_ids", agent === undefined ? this.agent : agent, count);
    return ids.map(toBigInt);
  }

  /**
   * The layout of the server that answers, for decode(): `{layout, datacenterId, workerId}`
   * (servers of one cluster share a layout).
   */
  async getLayout() {
    const raw = await this._call("get_layout");
    const epoch = toBigInt(raw.epoch_ms);
    return {
      layout: Object.freeze({
        epochMs: epoch <= BigInt(Number.MAX_SAFE_INTEGER) ? Number(epoch) : epoch,
        timestampBits: raw.timestamp_bits,
        datacenterIdBits: raw.datacenter_id_bits,
        workerIdBits: raw.worker_id_bits,
        sequenceBits: raw.sequence_bits,
        clockSequenceBits: raw.clock_sequence_bits == null ? 0 : raw.clock_sequence_bits,
      }),
      datacenterId: Number(toBigInt(raw.datacenter_id)),
      workerId: Number(toBigInt(raw.worker_id)),
    };
  }

  /** Close every idle connection; later calls reject. Calls in flight finish, then close theirs. */
  async close() {
    this._closed = true;
    const idle = this._idle;
    this._idle = [];
    for (const connection of idle) connection.close();
  }

  async _call(method, ...args) {
    const tried = new Set();
    const failures = [];
    let left = this._attempts === undefined ? this._servers.length + 1 : this._attempts;
    let freeRetries = this._servers.length;
    while (left > 0) {
      const [connection, reused] = this._acquire(tried);
      try {
        const result = await connection.call(method, ...args);
        this._release(connection, true);
        return result;
      } catch (error) {
        if (error instanceof InvalidUserAgentError || error instanceof InvalidCountError) {
          this._release(connection, true);
          throw error;
        }
        if (!(error instanceof RequestError || error instanceof CallFailedError)) {
          connection.close();
          throw error;
        }
        this._release(connection, false);
        failures.push({ address: connection.address, error });
        if (reused && error instanceof CallFailedError && !error.timedOut && freeRetries > 0) {
          // The server may have closed this idle connection (idle timeout, restart).
          freeRetries -= 1;
          this._dropIdle(connection.address);
          continue;
        }
        tried.add(connection.address);
        this._downUntil.set(connection.address, this._clock() + this._retryFailedAfterMs);
        if (!(error instanceof RequestError)) this._dropIdle(connection.address);
        left -= 1;
      }
    }
    throw NoServerAvailableError.from(`no snowflake server could serve ${method} (${failures.length} attempts)`, failures);
  }

  /** A connection to the best server to try next, and whether it was idle in the pool. */
  _acquire(tried) {
    if (this._closed) throw new Error("this SnowflakePool is closed");
    const now = this._clock();
    const servers = this._servers;
    const turn = this._turn++ % servers.length;
    const inTurn = [...servers.slice(turn), ...servers.slice(0, turn)];
    const rank = (s) => {
      const down = this._downUntil.get(s.address) || 0;
      return [tried.has(s.address) ? 1 : 0, down > now ? down : 0];
    };
    const before = (a, b) => a[0] - b[0] || a[1] - b[1];
    const ranked = inTurn.map((s) => [s, rank(s)]).sort((a, b) => before(a[1], b[1])); // stable
    const best = ranked[0][1];
    const good = new Set(ranked.filter(([, r]) => before(r, best) === 0).map(([s]) => s.address));
    for (let i = this._idle.length - 1; i >= 0; i -= 1) {
      if (good.has(this._idle[i].address)) return [this._idle.splice(i, 1)[0], true];
    }
    return [new Connection(ranked[0][0], this._options), false];
  }

  _release(connection, healthy) {
    if (healthy) this._downUntil.delete(connection.address);
    if (!this._closed && connection.isOpen && this._idle.length < this._poolSize) this._idle.push(connection);
    else connection.close();
  }

  _dropIdle(address) {
    const stale = this._idle.filter((c) => c.address === address);
    this._idle = this._idle.filter((c) => c.address !== address);
    for (const connection of stale) connection.close();
  }
}

module.exports = { DEFAULT_AGENT, DEFAULT_PORT, SnowflakePool, parseServer };
