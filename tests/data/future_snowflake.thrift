/* A client from a newer IDL than the server's: it knows a method the server does not. */
service Snowflake {
  i64 get_id(1:string useragent)
  i64 get_id_v9(1:string useragent)
}
