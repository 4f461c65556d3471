// The Go anchor of the benchmark: Apache Thrift's TSimpleServer serving Twitter's
// IdWorker. `make bench-anchors` builds it into bench/build/ after `make stubs`, with
// Debian's golang-thrift-dev and the generated code of clients/go: no module proxy.
module snowflakeanchor

go 1.19

require (
	github.com/apache/thrift v0.17.0
	github.com/snowflake-id/snowflake/clients/go v0.0.0
)

// For a hand build after `make stubs`; the Makefile builds with a copy of this file
// whose paths point at $(CLIENTS), wherever it is.
replace (
	github.com/apache/thrift => ../../../clients/go/thrift-debian
	github.com/snowflake-id/snowflake/clients/go => ../../../clients/go
)
