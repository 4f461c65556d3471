"""The Thrift side: the service's methods, the dispatch, the hardened server, TLS."""
