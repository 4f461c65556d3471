// Types of errors.js: every error of the client, under SnowflakeError (the Python client's names).

export declare class SnowflakeError extends Error {}

/** A value that cannot work: the message says which value and why. */
export declare class ConfigurationError extends SnowflakeError {}

/** A call that the server refused, with a reason declared in the IDL. */
export declare class RequestError extends SnowflakeError {}

/** The server's clock is behind the newest id it issued; another server may serve. */
export declare class ClockMovedBackwardsError extends RequestError {
  constructor(behindMs: number, message?: string, options?: { cause?: unknown });
  /** how far behind, in ms (0 if the server did not say) */
  readonly behindMs: number;
}

/** The user agent is not a letter followed by letters, digits and dashes: the caller's fault. */
export declare class InvalidUserAgentError extends RequestError {}

/** A batch size outside the allowed range: the caller's fault. */
export declare class InvalidCountError extends RequestError {}

/** This node cannot hand out ids now; another can. */
export declare class UnavailableError extends RequestError {}

export interface CallFailedOptions {
  connected: boolean;
  timedOut?: boolean;
  cause?: unknown;
}

/** A call to one server failed for a reason the IDL does not declare; the connection was dropped. */
export declare class CallFailedError extends SnowflakeError {
  constructor(address: string, reason: string, options: CallFailedOptions);
  /** the server, "host:port" */
  readonly address: string;
  /** what went wrong, in a few words */
  readonly reason: string;
  /** false if no connection could be opened at all */
  readonly connected: boolean;
  /** true if the server did not answer within the timeout */
  readonly timedOut: boolean;
}

/** No connection could be opened, or it broke during the call. */
export declare class ConnectionFailedError extends CallFailedError {}

/** The server did not answer within the timeout. */
export declare class CallTimedOutError extends CallFailedError {}

export interface Failure {
  readonly address: string;
  readonly error: CallFailedError | RequestError;
}

/** No server could serve the call: every try failed, as `failures` lists in order. */
export declare class NoServerAvailableError extends SnowflakeError {
  constructor(message: string, failures?: readonly Failure[]);
  readonly failures: readonly Failure[];
  /** A NoServerAnsweredError if every failure timed out, else a NoServerAvailableError. */
  static from(message: string, failures?: readonly Failure[]): NoServerAvailableError;
}

/** Every try timed out. */
export declare class NoServerAnsweredError extends NoServerAvailableError {}
