// Interop check: the Apache Thrift Node.js client against a running server.
//
//   node clients/node/interop.js HOST PORT framed|buffered
//
// Prints one JSON object a line (ids as decimal strings, converted with BigInt)
// for tests/test_interop.py. Everything happens on ONE connection. Each
// {"step": "waiting"} line is followed by reading a line from stdin: meanwhile
// the test steps the server's clock back, then restores it.
"use strict";

const readline = require("readline");
const thrift = require("thrift");
const Int64 = require("node-int64");
const Snowflake = require("./gen-nodejs/Snowflake");
const ttypes = require("./gen-nodejs/snowflake_types");

const AGENT = "interop-node";
const DECLARED = ["InvalidSystemClock", "InvalidUserAgentError", "InvalidCountError"];

function emit(fields) {
  process.stdout.write(JSON.stringify(fields) + "\n");
}

function toBigInt(int64) {
  return int64.buffer.readBigInt64BE(int64.offset);
}

const str = (int64) => toBigInt(int64).toString();

/** Any result as text; i64s (node-int64) through BigInt: String(int64) says "Infinity". */
function show(value) {
  if (Array.isArray(value)) return `[${value.map(show).join(", ")}]`;
  if (value instanceof Int64) return str(value);
  return String(value);
}

async function expectError(step, call) {
  let result;
  try {
    result = await call();
  } catch (e) {
    const name = DECLARED.find((n) => e instanceof ttypes[n]);
    if (name === undefined) throw e; // not a declared exception: fail loudly
    emit({ step, error: name, message: e.message });
    return;
  }
  emit({ step, error: null, result: show(result) });
}

async function main() {
  const [host, portText, transportName] = process.argv.slice(2);
  const lines = readline.createInterface({ input: process.stdin })[Symbol.asyncIterator]();
  const connection = thrift.createConnection(host, Number(portText), {
    transport: transportName === "framed" ? thrift.TFramedTransport : thrift.TBufferedTransport,
    protocol: thrift.TBinaryProtocol,
    connect_timeout: 5000,
    max_attempts: 1,
  });
  let connects = 0;
  connection.on("connect", () => (connects += 1));
  const broken = new Promise((_, reject) => {
    connection.on("error", (err) => reject(new Error(`connection error: ${err.message}`)));
    connection.on("close", () => reject(new Error("connection closed by the server")));
  });
  broken.catch(() => {});
  const client = thrift.createClient(Snowflake, connection);
  // Every call races the connection breaking: a lost connection fails the run.
  const call = (method, ...args) => Promise.race([client[method](...args), broken]);

  emit({ step: "get_id", id: str(await call("get_id", AGENT)) });
  emit({ step: "get_ids", ids: (await call("get_ids", AGENT, 5)).map(str) });
  await expectError("bad_agent", () => call("get_id", "1bad"));
  await expectError("bad_count", () => call("get_ids", AGENT, 0));
  await expectError("bad_agent_batch", () => call("get_ids", "no spaces", 3));
  emit({ step: "after_errors", id: str(await call("get_id", AGENT)) });
  const layout = await call("get_layout");
  emit({
    step: "layout",
    epoch_ms: str(layout.epoch_ms),
    timestamp_bits: layout.timestamp_bits,
    datacenter_id_bits: layout.datacenter_id_bits,
    worker_id_bits: layout.worker_id_bits,
    sequence_bits: layout.sequence_bits,
    datacenter_id: str(layout.datacenter_id),
    worker_id: str(layout.worker_id),
  });
  emit({
    step: "ids",
    worker_id: str(await call("get_worker_id")),
    datacenter_id: str(await call("get_datacenter_id")),
    timestamp: str(await call("get_timestamp")),
  });
  emit({ step: "waiting", until: "clock_back" });
  await lines.next();
  await expectError("clock", () => call("get_id", AGENT));
  await expectError("clock_batch", () => call("get_ids", AGENT, 2));
  emit({ step: "after_clock", worker_id: str(await call("get_worker_id")) });
  emit({ step: "waiting", until: "clock_restored" });
  await lines.next();
  emit({ step: "recovered", id: str(await call("get_id", AGENT)) });
  emit({ step: "done", connects });
  connection.removeAllListeners("close");
  connection.end();
  process.stdin.destroy();
}

const watchdog = setTimeout(() => {
  emit({ step: "failed", error: "timed out after 60 s" });
  process.exit(2);
}, 60000);
watchdog.unref();

main().catch((err) => {
  emit({ step: "failed", error: String(err && err.stack ? err.stack : err) });
  process.exit(1);
});
