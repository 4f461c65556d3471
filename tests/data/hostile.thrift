/* What a confused or hostile client might send: the server's method names with
   the wrong argument types. The exceptions mirror the server's (same field ids)
   so that its declared errors arrive typed. */
exception InvalidUserAgentError { 1: string message }
exception InvalidCountError { 1: string message }

service Snowflake {
  i64 get_id(1: i32 useragent) throws (2: InvalidUserAgentError agent_error)
  list<i64> get_ids(1: binary useragent, 2: string count)
    throws (2: InvalidUserAgentError agent_error, 3: InvalidCountError count_error)
}
