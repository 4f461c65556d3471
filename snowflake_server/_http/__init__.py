"""HTTP: the strict parser and response builder, the HTTP/JSON API as a protocol of
the serving core, the admin endpoint."""
