/*
 * Snowflake id service.
 *
 * Wire-compatible with Twitter's original IDL (snowflake-2010): the four
 * original methods keep their names, field ids and types, so a client
 * generated from that IDL works unchanged over framed transport + binary
 * protocol.  Adding `throws` only extends each method's result struct: an old
 * client still decodes every success and sees an error as a clean
 * "unknown result" application exception on a connection that stays usable.
 *
 * Id layout (defaults): 0 | 41 bits ms since epoch | 5 datacenter | 5 worker | 12 sequence
 */
namespace java com.twitter.service.snowflake.gen
namespace py snowflake
namespace go snowflake
namespace js Snowflake
namespace rb Snowflake

/** The server's clock is behind the last id it issued; retry later or elsewhere. */
exception InvalidSystemClock {
  1: string message,
}

/** The user agent does not match [a-zA-Z][a-zA-Z\-0-9]* (whole string). */
exception InvalidUserAgentError {
  1: string message,
}

/**
 * This node cannot hand out ids right now (for example its ZooKeeper session is
 * in doubt, or it is shutting down); ask another node.
 */
exception UnavailableError {
  1: string message,
}

/** get_ids was asked for a count outside 1..min(max_batch, 2^sequence_bits): 1..4096 by default. */
exception InvalidCountError {
  1: string message,
}

/** Kept from the original: one entry of the audit trail of issued ids. */
struct AuditLogEntry {
  1: i64 id,
  2: string useragent,
  3: i64 tag
}

/**
 * How this server packs ids, so that clients can decode them locally:
 * id = ((ms - epoch_ms) << (clock_sequence_bits + datacenter_id_bits + worker_id_bits
 *                           + sequence_bits))
 *    | (clock_sequence << (datacenter_id_bits + worker_id_bits + sequence_bits))
 *    | (datacenter_id << (worker_id_bits + sequence_bits))
 *    | (worker_id << sequence_bits)
 *    | sequence
 * clock_sequence_bits is 0 unless the server runs with --clock-sequence-bits; a
 * server from before it leaves the field out, which means 0.
 */
struct Layout {
  1: i64 epoch_ms,
  2: i32 timestamp_bits,
  3: i32 datacenter_id_bits,
  4: i32 worker_id_bits,
  5: i32 sequence_bits,
  6: i64 datacenter_id,
  7: i64 worker_id,
  8: i32 clock_sequence_bits,
}

service Snowflake {
  /** This server's worker id. */
  i64 get_worker_id()

  /** The server's current time in ms since the Unix epoch. */
  i64 get_timestamp()

  /** One new id. */
  i64 get_id(1: string useragent)
    throws (1: InvalidSystemClock clock_error, 2: InvalidUserAgentError agent_error,
            4: UnavailableError unavailable)

  /** This server's datacenter id. */
  i64 get_datacenter_id()

  /** 1..min(max_batch, 2^sequence_bits) new ids (4096 by default), increasing, in one round trip. */
  list<i64> get_ids(1: string useragent, 2: i32 count)
    throws (1: InvalidSystemClock clock_error, 2: InvalidUserAgentError agent_error,
            3: InvalidCountError count_error, 4: UnavailableError unavailable)

  /** The layout this server packs ids with. */
  Layout get_layout()
}
