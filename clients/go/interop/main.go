// Interop check: the Apache Thrift Go client against a running server.
//
//	cd clients/go && go run ./interop HOST PORT framed|buffered
//
// Prints one JSON object a line (ids as decimal strings) for tests/test_interop.py.
// Everything happens on ONE connection. Each {"step": "waiting"} line is followed
// by reading a line from stdin: meanwhile the test steps the server's clock back,
// then restores it.
package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"strconv"
	"time"

	"github.com/apache/thrift/lib/go/thrift"

	"github.com/snowflake-id/snowflake/clients/go/gen-go/snowflake"
)

const agent = "interop-go"

type fields map[string]any

func emit(f fields) {
	line, err := json.Marshal(f)
	if err != nil {
		panic(err)
	}
	fmt.Println(string(line))
}

func str(v int64) string { return strconv.FormatInt(v, 10) }

func fail(step string, err error) {
	emit(fields{"step": "failed", "at": step, "error": err.Error()})
	os.Exit(1)
}

func must(step string, v int64, err error) string {
	if err != nil {
		fail(step, err)
	}
	return str(v)
}

// expectError reports which declared exception err is; anything else fails the run.
func expectError(step string, result any, err error) {
	var agentErr *snowflake.InvalidUserAgentError
	var countErr *snowflake.InvalidCountError
	var clockErr *snowflake.InvalidSystemClock
	switch {
	case err == nil:
		emit(fields{"step": step, "error": nil, "result": fmt.Sprint(result)})
	case errors.As(err, &agentErr):
		emit(fields{"step": step, "error": "InvalidUserAgentError", "message": agentErr.Message})
	case errors.As(err, &countErr):
		emit(fields{"step": step, "error": "InvalidCountError", "message": countErr.Message})
	case errors.As(err, &clockErr):
		emit(fields{"step": step, "error": "InvalidSystemClock", "message": clockErr.Message})
	default:
		fail(step, err)
	}
}

func main() {
	host, port, transportName := os.Args[1], os.Args[2], os.Args[3]
	conf := &thrift.TConfiguration{ConnectTimeout: 10 * time.Second, SocketTimeout: 10 * time.Second}
	socket := thrift.NewTSocketConf(net.JoinHostPort(host, port), conf)
	var transport thrift.TTransport = thrift.NewTBufferedTransport(socket, 4096)
	if transportName == "framed" {
		transport = thrift.NewTFramedTransportConf(socket, conf)
	}
	if err := transport.Open(); err != nil {
		fail("open", err)
	}
	defer transport.Close()
	protocol := thrift.NewTBinaryProtocolConf(transport, conf)
	client := snowflake.NewSnowflakeClient(thrift.NewTStandardClient(protocol, protocol))
	ctx := context.Background()
	stdin := bufio.NewReader(os.Stdin)

	id, err := client.GetID(ctx, agent)
	emit(fields{"step": "get_id", "id": must("get_id", id, err)})
	ids, err := client.GetIds(ctx, agent, 5)
	if err != nil {
		fail("get_ids", err)
	}
	texts := make([]string, len(ids))
	for i, each := range ids {
		texts[i] = str(each)
	}
	emit(fields{"step": "get_ids", "ids": texts})
	id, err = client.GetID(ctx, "1bad")
	expectError("bad_agent", id, err)
	ids, err = client.GetIds(ctx, agent, 0)
	expectError("bad_count", ids, err)
	ids, err = client.GetIds(ctx, "no spaces", 3)
	expectError("bad_agent_batch", ids, err)
	id, err = client.GetID(ctx, agent)
	emit(fields{"step": "after_errors", "id": must("after_errors", id, err)})

	layout, err := client.GetLayout(ctx)
	if err != nil {
		fail("get_layout", err)
	}
	emit(fields{
		"step": "layout", "epoch_ms": str(layout.EpochMs),
		"timestamp_bits": layout.TimestampBits, "datacenter_id_bits": layout.DatacenterIDBits,
		"worker_id_bits": layout.WorkerIDBits, "sequence_bits": layout.SequenceBits,
		"datacenter_id": str(layout.DatacenterID), "worker_id": str(layout.WorkerID),
	})
	worker, err := client.GetWorkerID(ctx)
	workerText := must("get_worker_id", worker, err)
	datacenter, err := client.GetDatacenterID(ctx)
	datacenterText := must("get_datacenter_id", datacenter, err)
	now, err := client.GetTimestamp(ctx)
	emit(fields{"step": "ids", "worker_id": workerText, "datacenter_id": datacenterText,
		"timestamp": must("get_timestamp", now, err)})

	emit(fields{"step": "waiting", "until": "clock_back"})
	_, _ = stdin.ReadString('\n')
	id, err = client.GetID(ctx, agent)
	expectError("clock", id, err)
	ids, err = client.GetIds(ctx, agent, 2)
	expectError("clock_batch", ids, err)
	worker, err = client.GetWorkerID(ctx)
	emit(fields{"step": "after_clock", "worker_id": must("after_clock", worker, err)})
	emit(fields{"step": "waiting", "until": "clock_restored"})
	_, _ = stdin.ReadString('\n')
	id, err = client.GetID(ctx, agent)
	emit(fields{"step": "recovered", "id": must("recovered", id, err)})
	emit(fields{"step": "done"})
}
