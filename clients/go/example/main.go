// Call the snowflake service from Go with Apache Thrift.
//
//	make stubs        # generates clients/go/gen-go from idl/ (and clients/go/thrift-debian)
//	cd clients/go && go run ./example [HOST [PORT]]
//
// Go's int64 holds ids exactly.
package main

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"time"

	"github.com/apache/thrift/lib/go/thrift"

	"github.com/snowflake-id/snowflake/clients/go/gen-go/snowflake"
)

func main() {
	host, port := "127.0.0.1", "7609"
	if len(os.Args) > 1 {
		host = os.Args[1]
	}
	if len(os.Args) > 2 {
		port = os.Args[2]
	}
	conf := &thrift.TConfiguration{ConnectTimeout: 5 * time.Second, SocketTimeout: 5 * time.Second}
	socket := thrift.NewTSocketConf(net.JoinHostPort(host, port), conf)
	// Framed is the server's default; for --transport buffered use thrift.NewTBufferedTransport.
	transport := thrift.NewTFramedTransportConf(socket, conf)
	if err := transport.Open(); err != nil {
		fmt.Fprintln(os.Stderr, "cannot connect:", err)
		os.Exit(1)
	}
	defer transport.Close()
	protocol := thrift.NewTBinaryProtocolConf(transport, conf)
	client := snowflake.NewSnowflakeClient(thrift.NewTStandardClient(protocol, protocol))
	ctx := context.Background()

	id, err := client.GetID(ctx, "example-go")
	if err != nil {
		fmt.Fprintln(os.Stderr, "get_id:", err)
		os.Exit(1)
	}
	fmt.Println(id)
	ids, err := client.GetIds(ctx, "example-go", 3)
	if err != nil {
		fmt.Fprintln(os.Stderr, "get_ids:", err)
		os.Exit(1)
	}
	for _, each := range ids {
		fmt.Println(each)
	}

	_, err = client.GetID(ctx, "not a valid agent")
	var agentErr *snowflake.InvalidUserAgentError
	var clockErr *snowflake.InvalidSystemClock
	switch {
	case errors.As(err, &agentErr):
		fmt.Fprintln(os.Stderr, "refused:", agentErr.Message)
	case errors.As(err, &clockErr): // the server's clock went back: try another server
		fmt.Fprintln(os.Stderr, "clock:", clockErr.Message)
	case err != nil:
		fmt.Fprintln(os.Stderr, "get_id:", err)
		os.Exit(1)
	}
}
