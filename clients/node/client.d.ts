// Types of client.js: SnowflakePool, a pool of connections with failover across servers.
import type { Layout } from "./decode";

export declare const DEFAULT_PORT: 7609;
export declare const DEFAULT_AGENT: "snowflake-node";

/** "host:port", "[v6]:port", "host" (port 7609), or an object. */
export type ServerAddress = string | { readonly host: string; readonly port?: number };

export interface PoolOptions {
  /** the user agent of every call unless a call names another (default "snowflake-node") */
  agent?: string;
  /** "framed" (the server's default) or "buffered" (a server run with --transport buffered) */
  transport?: "framed" | "buffered";
  /** how long to wait for each reply, in ms (default 5000) */
  timeoutMs?: number;
  /** how long to wait for a connection, in ms (default timeoutMs) */
  connectTimeoutMs?: number;
  /** tries per call across servers (default: one per server, plus one) */
  attempts?: number;
  /** idle connections kept open (default 8) */
  poolSize?: number;
  /** how long a server that failed stays at the back of the order, in ms (default 1000) */
  retryFailedAfterMs?: number;
  /** milliseconds that only go forward (default performance.now), for retryFailedAfterMs */
  clock?: () => number;
}

export interface ServerLayout {
  /** for decode() and compose() */
  readonly layout: Layout;
  readonly datacenterId: number;
  readonly workerId: number;
}

/**
 * A client of one or more snowflake servers, with a pool of connections and failover.
 * Rejects with NoServerAvailableError when every try failed, at once with
 * InvalidUserAgentError or InvalidCountError (the caller's own errors).
 */
export declare class SnowflakePool {
  constructor(servers?: ServerAddress | readonly ServerAddress[], options?: PoolOptions);
  readonly agent: string;
  /** the servers, as "host:port" */
  readonly servers: string[];
  /** one new id */
  getId(agent?: string): Promise<bigint>;
  /** `count` new ids (1..4096 by default), increasing, in one round trip */
  getIds(count: number, agent?: string): Promise<bigint[]>;
  /** the layout of the server that answers */
  getLayout(): Promise<ServerLayout>;
  /** close the idle connections; later calls reject */
  close(): Promise<void>;
}

export declare function parseServer(server: ServerAddress): { readonly host: string; readonly port: number; readonly address: string };
