// The errors of the snowflake client: the same names and meanings as the Python
// client's (snowflake_thrift_client), under one root, SnowflakeError.
//
//   SnowflakeError
//   ├── ConfigurationError              a value that cannot work (an address, a setting)
//   ├── RequestError                    a call the server refused; declared in the IDL
//   │   ├── ClockMovedBackwardsError    <- InvalidSystemClock
//   │   ├── InvalidUserAgentError       <- InvalidUserAgentError
//   │   ├── InvalidCountError           <- InvalidCountError
//   │   └── UnavailableError            <- UnavailableError: not serving now, try another node
//   ├── CallFailedError                 a call to one server failed any other way
//   │   ├── ConnectionFailedError       no connection, or it broke during the call
//   │   └── CallTimedOutError           no answer in time
//   └── NoServerAvailableError          a pool ran out of servers or tries
//       └── NoServerAnsweredError       every try timed out
//
// JavaScript has no ConnectionError or TimeoutError to inherit from as Python does: test
// with instanceof, or compare `error.name`, which is the class's name.
"use strict";

class SnowflakeError extends Error {
  constructor(message, options) {
    super(message, options);
    // The class's own name, also for subclasses: what `String(error)` and logs show.
    Object.defineProperty(this, "name", { value: new.target.name, configurable: true, writable: true });
  }
}

/** A value that cannot work: the message says which value and why. */
class ConfigurationError extends SnowflakeError {}

/** A call that the server refused, with a reason declared in the IDL. */
class RequestError extends SnowflakeError {}

/**
 * The server's clock is behind the newest id it issued. `behindMs` is by how much (0 if
 * the message did not say); another server may have a good clock.
 */
class ClockMovedBackwardsError extends RequestError {
  constructor(behindMs, message, options) {
    super(message || `Clock moved backwards.  Refusing to generate id for ${behindMs} milliseconds`, options);
    this.behindMs = behindMs;
  }
}

/** The user agent is not a letter followed by letters, digits and dashes (the caller's fault). */
class InvalidUserAgentError extends RequestError {}

/** A batch size outside the allowed range (the caller's fault). */
class InvalidCountError extends RequestError {}

/** This node cannot hand out ids now (ZooKeeper session in doubt, shutting down); another can. */
class UnavailableError extends RequestError {}

/**
 * A call to one server failed for a reason the IDL does not declare; the connection was
 * discarded. `address` is the server, `reason` a few words, `connected` false if no
 * connection could be opened, `timedOut` true if it did not answer in time; `cause` is
 * the underlying error, if any.
 */
class CallFailedError extends SnowflakeError {
  constructor(address, reason, { connected, timedOut = false, cause } = {}) {
    super(`${address}: ${reason}`, cause === undefined ? undefined : { cause });
    this.address = address;
    this.reason = reason;
    this.connected = Boolean(connected);
    this.timedOut = Boolean(timedOut);
  }
}

/** No connection could be opened (refused, unreachable), or it broke during the call. */
class ConnectionFailedError extends CallFailedError {}

/** The server did not answer within the timeout, while connecting or during the call. */
class CallTimedOutError extends CallFailedError {
  constructor(address, reason, options = {}) {
    super(address, reason, { ...options, timedOut: true });
  }
}

function noServerMessage(message, failures) {
  const details = failures.map((f) => f.error.message).join("; ");
  return details ? `${message}: ${details}` : message;
}

/**
 * No server could serve the call: every try failed. `failures` lists `{address, error}`
 * for each try, in order; each error is a CallFailedError or the RequestError with which
 * that server refused. Use `NoServerAvailableError.from` to get a NoServerAnsweredError
 * when every try timed out.
 */
class NoServerAvailableError extends SnowflakeError {
  constructor(message, failures = []) {
    const last = failures.length ? failures[failures.length - 1].error : undefined;
    super(noServerMessage(message, failures), last === undefined ? undefined : { cause: last });
    this.failures = Object.freeze([...failures]);
  }

  /** A NoServerAnsweredError if every failure is a CallTimedOutError, else a NoServerAvailableError. */
  static from(message, failures = []) {
    const timedOut = failures.length > 0 && failures.every((f) => f.error instanceof CallTimedOutError);
    return timedOut ? new NoServerAnsweredError(message, failures) : new NoServerAvailableError(message, failures);
  }
}

/** Every try timed out: the servers, or the network to them, are too slow for the timeout. */
class NoServerAnsweredError extends NoServerAvailableError {}

module.exports = {
  SnowflakeError,
  ConfigurationError,
  RequestError,
  ClockMovedBackwardsError,
  InvalidUserAgentError,
  InvalidCountError,
  UnavailableError,
  CallFailedError,
  ConnectionFailedError,
  CallTimedOutError,
  NoServerAvailableError,
  NoServerAnsweredError,
};
