// Types of decode.js: decode and compose snowflake ids with BigInt.

/** How ids are packed: an epoch (ms since 1970) and the width of each field in bits. */
export interface Layout {
  readonly epochMs: number | bigint;
  readonly timestampBits: number;
  readonly datacenterIdBits: number;
  readonly workerIdBits: number;
  readonly sequenceBits: number;
  /** bits between the timestamp and the datacenter id; 0 unless the server runs with --clock-sequence-bits */
  readonly clockSequenceBits: number;
}

/** The server's snake_case layout: GET /v1/layout, or the Thrift get_layout reply. */
export interface LayoutJSON {
  readonly epoch_ms: number | bigint;
  readonly timestamp_bits: number;
  readonly datacenter_id_bits: number;
  readonly worker_id_bits: number;
  readonly sequence_bits: number;
  /** left out (or null) by a server from before clock sequences: 0 */
  readonly clock_sequence_bits?: number | null;
  readonly [other: string]: unknown;
}

/** The parts of an id. */
export interface DecodedId {
  readonly id: bigint;
  /** ms since 1970-01-01T00:00:00Z */
  readonly timestampMs: number;
  /** the same instant; `time.toISOString()` gives e.g. "2017-09-20T13:43:08.849Z" */
  readonly time: Date;
  readonly datacenterId: number;
  readonly workerId: number;
  readonly sequence: number;
  /** the clock-sequence value the server made the id with; always 0 in a layout without one */
  readonly clockSequence: number;
}

export interface IdParts {
  readonly timestampMs: number | bigint;
  readonly datacenterId: number | bigint;
  readonly workerId: number | bigint;
  readonly sequence: number | bigint;
  /** 0 if left out */
  readonly clockSequence?: number | bigint;
}

/** Twitter's layout, the server's default: epoch 1288834974657, 41/5/5/12 bits, no clock sequence. */
export declare const DEFAULT_LAYOUT: Readonly<{
  epochMs: 1288834974657;
  timestampBits: 41;
  datacenterIdBits: 5;
  workerIdBits: 5;
  sequenceBits: 12;
  clockSequenceBits: 0;
}>;

/**
 * The parts of a snowflake id: a decimal string or a BigInt, 0 <= id < 2^63 and within
 * the layout (fields left out are the default's). Never pass a Number: ids exceed 2^53.
 *
 * @throws TypeError for anything but a BigInt or a decimal string, or a layout with an
 *   unknown key
 * @throws RangeError for an id out of range or a timestamp past what a Date holds
 */
export declare function decode(id: string | bigint, layout?: Partial<Layout>): DecodedId;

/**
 * The id of these parts: the inverse of decode.
 *
 * @throws TypeError for a part that is not an integer; RangeError for one that does not fit
 */
export declare function compose(parts: IdParts, layout?: Partial<Layout>): bigint;

/**
 * A Layout from the server's snake_case JSON; its other fields are ignored, and a missing
 * or null clock_sequence_bits is 0.
 */
export declare function layoutFromJSON(json: LayoutJSON): Layout;
