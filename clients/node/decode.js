// Decode snowflake ids in JavaScript, with BigInt and no dependencies.
//
//   const { decode } = require("./decode");        // or: import { decode } from "./decode.js";
//   decode("910499571847892992");
//   // { id: 910499571847892992n, timestampMs: 1505914988849,
//   //   time: 2017-09-20T13:43:08.849Z, datacenterId: 17, workerId: 25, sequence: 0,
//   //   clockSequence: 0 }
//
// Ids exceed 2^53, past which a Number loses digits: pass them as decimal strings or as
// BigInt, never as Numbers. An id is
// 0 | timestamp | clock sequence | datacenter | worker | sequence, with Twitter's widths
// (41/5/5/12 bits, epoch 1288834974657, no clock sequence) unless a layout says
// otherwise. A clock sequence has bits only when the server runs with
// --clock-sequence-bits: it is a value the server moves to when its clock steps back, so
// that its ids at times it already used stay unique. The timestamp stays in the top
// bits, so ids still sort by time first.
// Checked against clients/testdata/decode-vectors.json by decode.test.js.
"use strict";

/** Twitter's layout, the server's default. */
const DEFAULT_LAYOUT = Object.freeze({
  epochMs: 1288834974657,
  timestampBits: 41,
  datacenterIdBits: 5,
  workerIdBits: 5,
  sequenceBits: 12,
  clockSequenceBits: 0,
});

// The sign bit stays 0, so that every language's signed 64-bit integer holds an id.
const ID_BITS = 63;
// The parts other than the timestamp are returned as Numbers: wider fields would lose
// digits (the server allows them, but no sensible layout has one).
const MAX_FIELD_BITS = 53;
// The furthest ms from 1970 that a Date holds.
const MAX_DATE_MS = 8640000000000000n;
const DECIMAL = /^-?[0-9]+$/;
const LAYOUT_KEYS = Object.keys(DEFAULT_LAYOUT);
const JSON_KEYS = {
  epochMs: "epoch_ms",
  timestampBits: "timestamp_bits",
  datacenterIdBits: "datacenter_id_bits",
  workerIdBits: "worker_id_bits",
  sequenceBits: "sequence_bits",
  clockSequenceBits: "clock_sequence_bits",
};
// A server from before clock sequences leaves clock_sequence_bits out of its layout (and
// Thrift stubs made from the new IDL then hold null): it has none, so layoutFromJSON
// reads a missing one as 0. Every other field is required.
const JSON_DEFAULTS = { clock_sequence_bits: 0 };

function describe(value) {
  if (typeof value === "string") return JSON.stringify(value.length > 40 ? `${value.slice(0, 40)}...` : value);
  if (typeof value === "bigint") return `${value}n`;
  if (value === null || typeof value !== "object") return String(value);
  return Object.prototype.toString.call(value);
}

/** An integer `value` (Number or BigInt) in low..high, as a BigInt; else TypeError/RangeError. */
function checkedInteger(name, value, low, high) {
  let big;
  if (typeof value === "bigint") big = value;
  else if (typeof value === "number" && Number.isSafeInteger(value)) big = BigInt(value);
  else if (typeof value === "number" && Number.isInteger(value)) {
    throw new RangeError(`${name} ${value} is past 2^53: a Number cannot hold it exactly; pass a BigInt`);
  } else throw new TypeError(`${name} must be an integer (a Number or a BigInt), got ${describe(value)}`);
  if (big < low || big > high) throw new RangeError(`${name} must be in ${low}..${high}, got ${big}`);
  return big;
}

/**
 * The layout with every default filled in, its shifts and masks, as BigInts.
 * Unknown keys are refused: a misspelt one (or a snake_case one, see layoutFromJSON)
 * would otherwise fall back to a default and decode every id wrongly without a word.
 */
function resolve(layout) {
  if (layout === undefined) layout = DEFAULT_LAYOUT;
  if (layout === null || typeof layout !== "object") {
    throw new TypeError(`a layout is an object like DEFAULT_LAYOUT, got ${describe(layout)}`);
  }
  for (const key of Object.keys(layout)) {
    if (!LAYOUT_KEYS.includes(key)) {
      const hint = Object.values(JSON_KEYS).includes(key) ? " (convert the server's JSON with layoutFromJSON)" : "";
      throw new TypeError(`unknown layout key ${JSON.stringify(key)}: expected ${LAYOUT_KEYS.join(", ")}${hint}`);
    }
  }
  const merged = { ...DEFAULT_LAYOUT, ...layout };
  const epoch = checkedInteger("epochMs", merged.epochMs, 0n, (1n << 63n) - 1n);
  const timestampBits = checkedInteger("timestampBits", merged.timestampBits, 1n, BigInt(ID_BITS));
  const datacenterIdBits = checkedInteger("datacenterIdBits", merged.datacenterIdBits, 0n, BigInt(MAX_FIELD_BITS));
  const workerIdBits = checkedInteger("workerIdBits", merged.workerIdBits, 0n, BigInt(MAX_FIELD_BITS));
  const sequenceBits = checkedInteger("sequenceBits", merged.sequenceBits, 1n, BigInt(MAX_FIELD_BITS));
  const clockSequenceBits = checkedInteger("clockSequenceBits", merged.clockSequenceBits, 0n, BigInt(MAX_FIELD_BITS));
  const total = timestampBits + clockSequenceBits + datacenterIdBits + workerIdBits + sequenceBits;
  if (total > BigInt(ID_BITS)) {
    // As the server says it: every width, and where a clock sequence's bits can come from.
    const clock = clockSequenceBits ? ` + clockSequenceBits ${clockSequenceBits}` : "";
    const hint = clockSequenceBits
      ? "; take the clock sequence's bits from the node id (fewer datacenterIdBits or workerIdBits)"
      : "";
    throw new RangeError(
      `the layout needs ${total} bits (timestampBits ${timestampBits}${clock} + datacenterIdBits ` +
        `${datacenterIdBits} + workerIdBits ${workerIdBits} + sequenceBits ${sequenceBits}) but an id ` +
        `has ${ID_BITS}${hint}`,
    );
  }
  const workerShift = sequenceBits;
  const datacenterShift = workerShift + workerIdBits;
  const clockSequenceShift = datacenterShift + datacenterIdBits;
  const timestampShift = clockSequenceShift + clockSequenceBits;
  return {
    epoch,
    maxId: (1n << (timestampShift + timestampBits)) - 1n,
    maxTimestamp: epoch + (1n << timestampBits) - 1n,
    timestampShift,
    clockSequenceShift,
    datacenterShift,
    workerShift,
    clockSequenceMask: (1n << clockSequenceBits) - 1n,
    datacenterMask: (1n << datacenterIdBits) - 1n,
    workerMask: (1n << workerIdBits) - 1n,
    sequenceMask: (1n << sequenceBits) - 1n,
  };
}

/** `id` as a BigInt: from a decimal string (an optional "-", then ASCII digits) or a BigInt. */
function toBigInt(id) {
  if (typeof id === "bigint") return id;
  if (typeof id === "string") {
    // BigInt() alone would also take "", " 1", "0x1F" and "1_0"... as ids.
    if (!DECIMAL.test(id)) throw new TypeError(`not a decimal id: ${describe(id)}`);
    return BigInt(id);
  }
  const why = typeof id === "number" ? ": ids exceed 2^53, which a Number cannot hold exactly" : "";
  throw new TypeError(`an id is a decimal string or a BigInt, got ${typeof id} ${describe(id)}${why}`);
}

/**
 * The parts of a snowflake id.
 *
 * @param {string | bigint} id a decimal string or a BigInt, 0 <= id < 2^63
 * @param {Partial<typeof DEFAULT_LAYOUT>} [layout] the server's layout; omitted fields (or
 *   all of it) are Twitter's
 * @returns {{id: bigint, timestampMs: number, time: Date, datacenterId: number,
 *   workerId: number, sequence: number, clockSequence: number}} timestampMs is ms since
 *   1970 (UTC); clockSequence is 0 in a layout without one
 * @throws {TypeError} not a string or BigInt, a string that is not a decimal integer, or
 *   a layout with unknown keys
 * @throws {RangeError} negative, 2^63 or more, wider than the layout, or a timestamp past
 *   what a Date holds
 */
function decode(id, layout) {
  const l = resolve(layout);
  const value = toBigInt(id);
  if (value < 0n || value > l.maxId) {
    throw new RangeError(`${value} is not an id of this layout: ids are in 0..${l.maxId}`);
  }
  const timestamp = (value >> l.timestampShift) + l.epoch;
  if (timestamp > MAX_DATE_MS) {
    throw new RangeError(`${value} is stamped ${timestamp} ms after 1970, past what a Date holds`);
  }
  const timestampMs = Number(timestamp);
  return {
    id: value,
    timestampMs,
    time: new Date(timestampMs),
    datacenterId: Number((value >> l.datacenterShift) & l.datacenterMask),
    workerId: Number((value >> l.workerShift) & l.workerMask),
    sequence: Number(value & l.sequenceMask),
    clockSequence: Number((value >> l.clockSequenceShift) & l.clockSequenceMask),
  };
}

/**
 * The id of these parts, as a BigInt: the inverse of decode.
 *
 * @param {{timestampMs: number | bigint, datacenterId: number | bigint,
 *   workerId: number | bigint, sequence: number | bigint,
 *   clockSequence?: number | bigint}} parts clockSequence left out is 0
 * @param {Partial<typeof DEFAULT_LAYOUT>} [layout]
 * @throws {TypeError} a part that is not an integer
 * @throws {RangeError} a part that does not fit its field
 */
function compose(parts, layout) {
  const l = resolve(layout);
  if (parts === null || typeof parts !== "object") {
    throw new TypeError(`compose takes {timestampMs, datacenterId, workerId, sequence}, got ${describe(parts)}`);
  }
  const timestamp = checkedInteger("timestampMs", parts.timestampMs, l.epoch, l.maxTimestamp);
  const datacenterId = checkedInteger("datacenterId", parts.datacenterId, 0n, l.datacenterMask);
  const workerId = checkedInteger("workerId", parts.workerId, 0n, l.workerMask);
  const sequence = checkedInteger("sequence", parts.sequence, 0n, l.sequenceMask);
  // Left out is 0, so that parts written before clock sequences still compose; but a
  // null or a "2" is a mistake, not a 0.
  const clockSequence =
    parts.clockSequence === undefined
      ? 0n
      : checkedInteger("clockSequence", parts.clockSequence, 0n, l.clockSequenceMask);
  return (
    ((timestamp - l.epoch) << l.timestampShift) |
    (clockSequence << l.clockSequenceShift) |
    (datacenterId << l.datacenterShift) |
    (workerId << l.workerShift) |
    sequence
  );
}

/**
 * A layout from the server's snake_case JSON: GET /v1/layout, or the fields of the
 * Thrift get_layout reply. Other fields (datacenter_id, worker_id) are ignored, and a
 * missing or null clock_sequence_bits (a server from before it) is 0.
 *
 * @throws {TypeError} a missing field; {RangeError} a layout no server could have
 */
function layoutFromJSON(json) {
  if (json === null || typeof json !== "object") {
    throw new TypeError(`a layout's JSON is an object, got ${describe(json)}`);
  }
  const layout = {};
  for (const [key, jsonKey] of Object.entries(JSON_KEYS)) {
    if (jsonKey in JSON_DEFAULTS && json[jsonKey] == null) layout[key] = JSON_DEFAULTS[jsonKey];
    else if (jsonKey in json) layout[key] = json[jsonKey];
    else throw new TypeError(`the layout's JSON has no ${JSON.stringify(jsonKey)}`);
  }
  resolve(layout);
  return Object.freeze(layout);
}

// Assigned one by one so that Node's ES-module loader sees named exports too.
exports.DEFAULT_LAYOUT = DEFAULT_LAYOUT;
exports.decode = decode;
exports.compose = compose;
exports.layoutFromJSON = layoutFromJSON;
