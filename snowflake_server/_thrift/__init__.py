"""The Thrift protocol: framing, the get_id fast path, the dispatch onto the service."""
