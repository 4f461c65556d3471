// The Go anchor of the benchmark: Twitter's IdWorker behind Apache Thrift's
// TSimpleServer (a goroutine per connection), framed transport over a buffered one,
// binary protocol, on the code `make stubs` generates from idl/snowflake.thrift.
//
//	bench/build/anchor-go [--port 0] [--worker-id 0] [--datacenter-id 0]
//
// It listens on 127.0.0.1 only, prints "anchor ready thrift=127.0.0.1:PORT" once it
// accepts connections, and exits on SIGTERM or SIGINT. It keeps no state: a
// restart may repeat ids, which is fine for a benchmark and nothing else.
package main

import (
	"context"
	"flag"
	"fmt"
	"net"
	"os"
	"os/signal"
	"regexp"
	"sync"
	"syscall"
	"time"

	"github.com/apache/thrift/lib/go/thrift"

	"github.com/snowflake-id/snowflake/clients/go/gen-go/snowflake"
)

// Twitter's layout: 41 bits of ms since its epoch, 5 datacenter, 5 worker, 12 sequence.
const (
	twepoch            int64 = 1288834974657
	workerIDBits             = 5
	datacenterIDBits         = 5
	sequenceBits             = 12
	maxWorkerID        int64 = -1 ^ (-1 << workerIDBits)
	maxDatacenterID    int64 = -1 ^ (-1 << datacenterIDBits)
	workerIDShift            = sequenceBits
	datacenterIDShift        = sequenceBits + workerIDBits
	timestampLeftShift       = sequenceBits + workerIDBits + datacenterIDBits
	sequenceMask       int64 = -1 ^ (-1 << sequenceBits)
	maxBatch                 = 1 << sequenceBits
)

// Twitter's AgentParser, matched against the whole user agent.
var agentParser = regexp.MustCompile(`^[a-zA-Z][a-zA-Z\-0-9]*$`)

// idWorker is Twitter's IdWorker (snowflake-2010, IdWorker.scala): one lock around
// nextId, a spin to the next ms when a ms's sequence is spent, a refusal when the
// clock went back. Its stats counters and audit reporter are left out.
type idWorker struct {
	workerID, datacenterID int64

	mu            sync.Mutex
	sequence      int64
	lastTimestamp int64
}

func timeGen() int64 { return time.Now().UnixMilli() }

func tilNextMillis(lastTimestamp int64) int64 {
	timestamp := timeGen()
	for timestamp <= lastTimestamp {
		timestamp = timeGen()
	}
	return timestamp
}

func (w *idWorker) nextID() (int64, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	timestamp := timeGen()
	if timestamp < w.lastTimestamp {
		return 0, &snowflake.InvalidSystemClock{Message: fmt.Sprintf(
			"Clock moved backwards.  Refusing to generate id for %d milliseconds",
			w.lastTimestamp-timestamp)}
	}
	if w.lastTimestamp == timestamp {
		w.sequence = (w.sequence + 1) & sequenceMask
		if w.sequence == 0 {
			timestamp = tilNextMillis(w.lastTimestamp)
		}
	} else {
		w.sequence = 0
	}
	w.lastTimestamp = timestamp
	return (timestamp-twepoch)<<timestampLeftShift |
		w.datacenterID<<datacenterIDShift |
		w.workerID<<workerIDShift |
		w.sequence, nil
}

func checkAgent(useragent string) error {
	if !agentParser.MatchString(useragent) {
		return &snowflake.InvalidUserAgentError{Message: fmt.Sprintf(
			"invalid user agent %q: expected [a-zA-Z][a-zA-Z\\-0-9]*", useragent)}
	}
	return nil
}

func (w *idWorker) GetID(_ context.Context, useragent string) (int64, error) {
	if err := checkAgent(useragent); err != nil {
		return 0, err
	}
	return w.nextID()
}

// GetIds is our IDL's batch call, which Twitter's server did not have: nextId in a
// loop, as a Twitter client calling get_id count times would get them.
func (w *idWorker) GetIds(_ context.Context, useragent string, count int32) ([]int64, error) {
	if err := checkAgent(useragent); err != nil {
		return nil, err
	}
	if count < 1 || count > maxBatch {
		return nil, &snowflake.InvalidCountError{Message: fmt.Sprintf(
			"count %d: expected 1..%d", count, maxBatch)}
	}
	ids := make([]int64, count)
	for i := range ids {
		id, err := w.nextID()
		if err != nil {
			return nil, err
		}
		ids[i] = id
	}
	return ids, nil
}

func (w *idWorker) GetWorkerID(context.Context) (int64, error)     { return w.workerID, nil }
func (w *idWorker) GetDatacenterID(context.Context) (int64, error) { return w.datacenterID, nil }
func (w *idWorker) GetTimestamp(context.Context) (int64, error)    { return timeGen(), nil }

func (w *idWorker) GetLayout(context.Context) (*snowflake.Layout, error) {
	return &snowflake.Layout{
		EpochMs: twepoch, TimestampBits: 41, DatacenterIDBits: datacenterIDBits,
		WorkerIDBits: workerIDBits, SequenceBits: sequenceBits,
		DatacenterID: w.datacenterID, WorkerID: w.workerID,
	}, nil
}

func main() {
	port := flag.Int("port", 0, "port on 127.0.0.1; 0 picks a free one")
	workerID := flag.Int64("worker-id", 0, "worker id, 0..31")
	datacenterID := flag.Int64("datacenter-id", 0, "datacenter id, 0..31")
	flag.Parse()
	// Twitter's sanity checks of the constructor.
	if *workerID < 0 || *workerID > maxWorkerID {
		fmt.Fprintf(os.Stderr, "worker Id can't be greater than %d or less than 0\n", maxWorkerID)
		os.Exit(2)
	}
	if *datacenterID < 0 || *datacenterID > maxDatacenterID {
		fmt.Fprintf(os.Stderr, "datacenter Id can't be greater than %d or less than 0\n",
			maxDatacenterID)
		os.Exit(2)
	}
	if *port < 0 || *port > 65535 || flag.NArg() > 0 {
		fmt.Fprintln(os.Stderr, "usage: anchor-go [--port N] [--worker-id N] [--datacenter-id N]")
		os.Exit(2)
	}

	worker := &idWorker{workerID: *workerID, datacenterID: *datacenterID, lastTimestamp: -1}
	socket, err := thrift.NewTServerSocket(net.JoinHostPort("127.0.0.1", fmt.Sprint(*port)))
	if err == nil {
		err = socket.Listen()
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "listen:", err)
		os.Exit(1)
	}
	conf := &thrift.TConfiguration{}
	// Framed over buffered: the frame's length and body leave in one write.
	transports := thrift.NewTFramedTransportFactoryConf(thrift.NewTBufferedTransportFactory(8192), conf)
	server := thrift.NewTSimpleServer4(snowflake.NewSnowflakeProcessor(worker), socket,
		transports, thrift.NewTBinaryProtocolFactoryConf(conf))

	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGTERM, syscall.SIGINT)
	go func() {
		<-stop
		os.Exit(0) // no state to keep; open connections simply close
	}()
	fmt.Printf("anchor ready thrift=%s\n", socket.Addr())
	if err := server.Serve(); err != nil {
		fmt.Fprintln(os.Stderr, "serve:", err)
		os.Exit(1)
	}
}
