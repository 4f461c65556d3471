// Types of snowflake-thrift-client: the pool, its errors, and decode/compose on BigInt.
export * from "./client";
export * from "./decode";
export * from "./errors";
/** the package's version, which is the server's (one VERSION file) */
export declare const version: string;
