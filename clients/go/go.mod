module snowflakeclient

go 1.19

require github.com/apache/thrift v0.17.0

// Debian's golang-thrift-dev, made a module by `make stubs` (no network needed).
// With access to the Go module proxy, delete this line and run `go mod tidy`.
replace github.com/apache/thrift => ./thrift-debian
