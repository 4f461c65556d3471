// Tests of decode.js against the shared vectors (clients/testdata/decode-vectors.json),
// which the server's own generator made, and the cases only JavaScript has.
//
//   node clients/node/decode.test.js        (Node.js 18 or later; no npm packages)
"use strict";

const assert = require("node:assert/strict");
const fs = require("node:fs");
const path = require("node:path");
const { pathToFileURL } = require("node:url");
const test = require("node:test");

const { DEFAULT_LAYOUT, compose, decode, layoutFromJSON } = require("./decode");

const VECTORS = JSON.parse(
  fs.readFileSync(path.join(__dirname, "..", "testdata", "decode-vectors.json"), "utf8"),
);
const LAYOUTS = Object.fromEntries(
  Object.entries(VECTORS.layouts).map(([name, json]) => [name, layoutFromJSON(json)]),
);
const ERRORS = { format: TypeError, range: RangeError };

test("every valid vector decodes to its parts, from a string and from a BigInt", () => {
  assert.ok(VECTORS.valid.length > 0);
  for (const v of VECTORS.valid) {
    const where = `${v.layout}: ${v.id} (${v.note})`;
    for (const id of [v.id, BigInt(v.id)]) {
      const got = decode(id, LAYOUTS[v.layout]);
      assert.deepEqual(
        {
          id: got.id.toString(),
          time: got.time.toISOString(),
          timestamp_ms: got.timestampMs,
          datacenter_id: got.datacenterId,
          worker_id: got.workerId,
          sequence: got.sequence,
          clock_sequence: got.clockSequence,
        },
        {
          id: v.id,
          time: v.time,
          timestamp_ms: v.timestamp_ms,
          datacenter_id: v.datacenter_id,
          worker_id: v.worker_id,
          sequence: v.sequence,
          clock_sequence: v.clock_sequence,
        },
        where,
      );
      assert.equal(got.time.getTime(), v.timestamp_ms, where);
      // got carries clockSequence, so the round trip covers that field too.
      assert.equal(compose(got, LAYOUTS[v.layout]), BigInt(v.id), where);
      const { clockSequence, ...withoutClock } = got;
      if (clockSequence === 0) assert.equal(compose(withoutClock, LAYOUTS[v.layout]), BigInt(v.id), where);
    }
  }
  // Else the clock-sequence field would be checked only at 0.
  assert.ok(VECTORS.valid.some((v) => v.clock_sequence > 0), "no vector has a clock sequence");
  // Read by tests/client/test_decode_vectors.py: every vector was checked.
  console.log(`# decode vectors: ${VECTORS.valid.length} valid checked`);
});

test("every invalid vector throws its kind of error", () => {
  assert.ok(VECTORS.invalid.length > 0);
  for (const v of VECTORS.invalid) {
    const kind = ERRORS[v.error];
    assert.ok(kind, `unknown error kind ${v.error}`);
    assert.throws(() => decode(v.input, LAYOUTS[v.layout]), kind, `${v.layout}: ${JSON.stringify(v.input)} (${v.note})`);
  }
  console.log(`# decode vectors: ${VECTORS.invalid.length} invalid checked`);
});

test("the default layout is Twitter's, and the one the vectors call default", () => {
  assert.deepEqual({ ...DEFAULT_LAYOUT }, { ...LAYOUTS.default });
  assert.equal(decode("910499571847892992").time.toISOString(), "2017-09-20T13:43:08.849Z");
  assert.throws(() => { DEFAULT_LAYOUT.epochMs = 0; }, TypeError);
});

test("a Number is refused, even a small one: ids are strings or BigInts", () => {
  assert.throws(() => decode(910499571847892992), { name: "TypeError", message: /2\^53/ });
  assert.throws(() => decode(5), TypeError);
  for (const bad of [undefined, null, {}, [], true, Symbol("id")]) {
    assert.throws(() => decode(bad), TypeError);
  }
});

test("strings that BigInt or Number would take are refused", () => {
  for (const bad of [" 1", "1 ", "+1", "1_000", "0b1", "0o7", "1n", "\u0663", "Infinity"]) {
    assert.throws(() => decode(bad), TypeError, JSON.stringify(bad));
  }
  assert.equal(decode("007").id, 7n);
  assert.equal(decode("-0").id, 0n);
});

test("a partial layout takes the rest from the default", () => {
  const got = decode("1025", { epochMs: 0, sequenceBits: 10 });
  assert.deepEqual([got.timestampMs, got.workerId, got.sequence], [0, 1, 1]);
  assert.equal(compose({ timestampMs: 0, datacenterId: 0, workerId: 1, sequence: 1 }, { epochMs: 0, sequenceBits: 10 }), 1025n);
});

test("layouts that cannot be are refused", () => {
  assert.throws(() => decode("1", { epoch_ms: 0 }), { name: "TypeError", message: /layoutFromJSON/ });
  assert.throws(() => decode("1", { sequenceBits: 14 }), { name: "RangeError", message: /65 bits/ });
  assert.throws(() => decode("1", { timestampBits: 0 }), RangeError);
  assert.throws(() => decode("1", { timestampBits: 1, sequenceBits: 54, datacenterIdBits: 0, workerIdBits: 0 }), RangeError);
  assert.throws(() => decode("1", { sequenceBits: 1.5 }), TypeError);
  assert.throws(() => decode("1", { epochMs: -1 }), RangeError);
  assert.throws(() => decode("1", { epochMs: 2 ** 60 }), { name: "RangeError", message: /BigInt/ });
  assert.throws(() => decode("1", null), TypeError);
  assert.throws(() => layoutFromJSON({ epoch_ms: 0 }), { name: "TypeError", message: /timestamp_bits/ });
});

test("a clock sequence sits between the timestamp and the datacenter id", () => {
  const layout = { datacenterIdBits: 3, clockSequenceBits: 2 };
  const ok = { timestampMs: 1505914988849, datacenterId: 5, workerId: 25, sequence: 1 };
  // The vector of clock sequence 2: the same ms as the worked example, 3 bits of datacenter.
  assert.equal(compose({ ...ok, clockSequence: 2 }, layout), 910499571848417281n);
  assert.equal(compose({ ...ok, clockSequence: 2n }, layout), 910499571848417281n);
  assert.deepEqual(
    decode("910499571848417281", layout),
    { ...ok, id: 910499571848417281n, time: new Date(ok.timestampMs), clockSequence: 2 },
  );
  // Each field alone, at its own shift: clock sequence at 12 + 5 + 3 = 20, timestamp at 22.
  assert.equal(decode(String(3n << 20n), layout).clockSequence, 3);
  assert.equal(decode(String(3n << 20n), layout).datacenterId, 0);
  assert.equal(decode(String(1n << 22n), layout).timestampMs, DEFAULT_LAYOUT.epochMs + 1);
  assert.equal(decode(String(1n << 22n), layout).clockSequence, 0);
  assert.equal(compose({ ...ok, clockSequence: 0 }, layout), compose(ok, layout));
  // A layout without one: every id's clock sequence is 0, and only 0 composes.
  assert.equal(decode("9223372036854775807").clockSequence, 0);
  assert.equal(compose({ ...ok, clockSequence: 0 }), compose(ok));
});

test("compose refuses a clock sequence that does not fit", () => {
  const ok = { timestampMs: 1505914988849, datacenterId: 5, workerId: 25, sequence: 0 };
  const layout = { datacenterIdBits: 3, clockSequenceBits: 2 };
  assert.throws(() => compose({ ...ok, clockSequence: 4 }, layout), { name: "RangeError", message: /clockSequence must be in 0\.\.3, got 4/ });
  assert.throws(() => compose({ ...ok, clockSequence: -1 }, layout), RangeError);
  assert.throws(() => compose({ ...ok, clockSequence: 1 }), { name: "RangeError", message: /clockSequence must be in 0\.\.0/ });
  assert.throws(() => compose({ ...ok, clockSequence: "2" }, layout), TypeError);
  assert.throws(() => compose({ ...ok, clockSequence: null }, layout), TypeError);
  assert.throws(() => compose({ ...ok, clockSequence: 1.5 }, layout), TypeError);
});

test("a clock sequence's bits count toward the 63", () => {
  // Twitter's 63 bits are all used: a clock sequence must take its bits from the node id.
  assert.throws(() => decode("1", { clockSequenceBits: 2 }), {
    name: "RangeError",
    message: /65 bits \(timestampBits 41 \+ clockSequenceBits 2 \+ .*fewer datacenterIdBits or workerIdBits/,
  });
  assert.throws(() => compose({ timestampMs: 1505914988849, datacenterId: 0, workerId: 0, sequence: 0 }, { clockSequenceBits: 1 }), RangeError);
  assert.equal(decode("1", { datacenterIdBits: 3, clockSequenceBits: 2 }).sequence, 1);
  assert.throws(() => decode("1", { clockSequenceBits: -1 }), { name: "RangeError", message: /clockSequenceBits must be in 0\.\.53/ });
  assert.throws(() => decode("1", { clockSequenceBits: 54 }), RangeError);
  assert.throws(() => decode("1", { clockSequenceBits: "2" }), TypeError);
  assert.throws(() => decode("1", { clock_sequence_bits: 0 }), { name: "TypeError", message: /layoutFromJSON/ });
  // Without the hint when the clock sequence is not to blame.
  assert.throws(() => decode("1", { sequenceBits: 14 }), (e) => e instanceof RangeError && !/clock/.test(e.message));
});

test("layoutFromJSON reads clock_sequence_bits, and its absence as 0", () => {
  const json = { ...VECTORS.layouts["cs-41-2-3-5-12"] };
  assert.equal(layoutFromJSON(json).clockSequenceBits, 2);
  // A server from before clock sequences: no field over HTTP, null in newer Thrift stubs.
  delete json.clock_sequence_bits;
  const old = { ...json, datacenter_id_bits: 5 };
  assert.deepEqual({ ...layoutFromJSON(old) }, { ...DEFAULT_LAYOUT });
  assert.deepEqual({ ...layoutFromJSON({ ...old, clock_sequence_bits: null }) }, { ...DEFAULT_LAYOUT });
  // The 2 bits it reports must come from somewhere: not from Twitter's full 63.
  assert.throws(() => layoutFromJSON({ ...old, clock_sequence_bits: 2 }), RangeError);
  assert.throws(() => layoutFromJSON({ ...old, clock_sequence_bits: "2" }), TypeError);
});

test("a timestamp past what a Date holds is a RangeError, not an Invalid Date", () => {
  const layout = { epochMs: 2n ** 62n };
  assert.throws(() => decode("0", layout), { name: "RangeError", message: /Date/ });
  assert.equal(decode("0", { epochMs: 8640000000000000 }).time.toISOString(), "+275760-09-13T00:00:00.000Z");
});

test("compose refuses parts that do not fit", () => {
  const ok = { timestampMs: 1505914988849, datacenterId: 17, workerId: 25, sequence: 0 };
  assert.equal(compose(ok), 910499571847892992n);
  assert.equal(compose({ ...ok, timestampMs: 1505914988849n, sequence: 0n }), 910499571847892992n);
  assert.throws(() => compose({ ...ok, datacenterId: 32 }), RangeError);
  assert.throws(() => compose({ ...ok, sequence: 4096 }), RangeError);
  assert.throws(() => compose({ ...ok, timestampMs: 0 }), RangeError);
  assert.throws(() => compose({ ...ok, workerId: "25" }), TypeError);
  assert.throws(() => compose(null), TypeError);
});

test("ES modules get the same named exports", async () => {
  const esm = await import(pathToFileURL(path.join(__dirname, "decode.js")).href);
  assert.equal(esm.decode, decode);
  assert.equal(esm.compose, compose);
  assert.equal(esm.layoutFromJSON, layoutFromJSON);
  assert.equal(esm.DEFAULT_LAYOUT, DEFAULT_LAYOUT);
});
