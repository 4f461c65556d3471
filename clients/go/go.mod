module github.com/snowflake-id/snowflake/clients/go

go 1.19

require github.com/apache/thrift v0.17.0

// Debian's golang-thrift-dev, made a module by `make stubs` (no network needed). Go reads
// a replace line only in the main module's go.mod: a module that requires this one never
// sees it (it finds apache/thrift through the proxy, or replaces it itself). With access
// to the Go module proxy, delete this line and run `go mod tidy`.
replace github.com/apache/thrift => ./thrift-debian
