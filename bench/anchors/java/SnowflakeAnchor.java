// The Java anchor of the benchmark: Twitter's IdWorker behind Apache Thrift's
// TThreadPoolServer (a thread per connection), framed transport, binary protocol, on
// the code `make stubs` generates into clients/java/gen-java, with Debian's
// libthrift-java. `make bench-anchors` builds it into bench/build/java.
//
//   java -cp bench/build/java:/usr/share/java/thrift.jar:/usr/share/java/slf4j-nop.jar \
//       SnowflakeAnchor [--port 0] [--worker-id 0] [--datacenter-id 0]
//
// It listens on 127.0.0.1 only, prints "anchor ready thrift=127.0.0.1:PORT" once it
// accepts connections, and exits on SIGTERM (the JVM's default). It keeps no state: a
// restart may repeat ids, which is fine for a benchmark and nothing else.

import com.twitter.service.snowflake.gen.InvalidCountError;
import com.twitter.service.snowflake.gen.InvalidSystemClock;
import com.twitter.service.snowflake.gen.InvalidUserAgentError;
import com.twitter.service.snowflake.gen.Layout;
import com.twitter.service.snowflake.gen.Snowflake;
import java.net.InetAddress;
import java.net.InetSocketAddress;
import java.util.ArrayList;
import java.util.List;
import java.util.regex.Pattern;
import org.apache.thrift.protocol.TBinaryProtocol;
import org.apache.thrift.server.TThreadPoolServer;
import org.apache.thrift.transport.TServerSocket;
import org.apache.thrift.transport.layered.TFramedTransport;

public final class SnowflakeAnchor {
  private SnowflakeAnchor() {}

  /**
   * Twitter's IdWorker (snowflake-2010, IdWorker.scala) in Java: a synchronized nextId, a
   * spin to the next ms when a ms's sequence is spent, a refusal when the clock went back.
   * Its stats counters and audit reporter are left out.
   */
  static final class IdWorker implements Snowflake.Iface {
    static final long TWEPOCH = 1288834974657L;
    static final long WORKER_ID_BITS = 5L;
    static final long DATACENTER_ID_BITS = 5L;
    static final long MAX_WORKER_ID = -1L ^ (-1L << WORKER_ID_BITS);
    static final long MAX_DATACENTER_ID = -1L ^ (-1L << DATACENTER_ID_BITS);
    static final long SEQUENCE_BITS = 12L;
    static final long WORKER_ID_SHIFT = SEQUENCE_BITS;
    static final long DATACENTER_ID_SHIFT = SEQUENCE_BITS + WORKER_ID_BITS;
    static final long TIMESTAMP_LEFT_SHIFT = SEQUENCE_BITS + WORKER_ID_BITS + DATACENTER_ID_BITS;
    static final long SEQUENCE_MASK = -1L ^ (-1L << SEQUENCE_BITS);
    static final int MAX_BATCH = 1 << SEQUENCE_BITS;
    /** Twitter's AgentParser, matched against the whole user agent. */
    static final Pattern AGENT_PARSER = Pattern.compile("([a-zA-Z][a-zA-Z\\-0-9]*)");

    private final long workerId;
    private final long datacenterId;
    private long sequence = 0L;
    private long lastTimestamp = -1L;

    IdWorker(long workerId, long datacenterId) {
      // Twitter's sanity checks.
      if (workerId > MAX_WORKER_ID || workerId < 0) {
        throw new IllegalArgumentException(
            String.format("worker Id can't be greater than %d or less than 0", MAX_WORKER_ID));
      }
      if (datacenterId > MAX_DATACENTER_ID || datacenterId < 0) {
        throw new IllegalArgumentException(
            String.format(
                "datacenter Id can't be greater than %d or less than 0", MAX_DATACENTER_ID));
      }
      this.workerId = workerId;
      this.datacenterId = datacenterId;
    }

    private static long timeGen() {
      return System.currentTimeMillis();
    }

    private static long tilNextMillis(long lastTimestamp) {
      long timestamp = timeGen();
      while (timestamp <= lastTimestamp) {
        timestamp = timeGen();
      }
      return timestamp;
    }

    synchronized long nextId() throws InvalidSystemClock {
      long timestamp = timeGen();
      if (timestamp < lastTimestamp) {
        throw new InvalidSystemClock(
            String.format(
                "Clock moved backwards.  Refusing to generate id for %d milliseconds",
                lastTimestamp - timestamp));
      }
      if (lastTimestamp == timestamp) {
        sequence = (sequence + 1) & SEQUENCE_MASK;
        if (sequence == 0) {
          timestamp = tilNextMillis(lastTimestamp);
        }
      } else {
        sequence = 0;
      }
      lastTimestamp = timestamp;
      return ((timestamp - TWEPOCH) << TIMESTAMP_LEFT_SHIFT)
          | (datacenterId << DATACENTER_ID_SHIFT)
          | (workerId << WORKER_ID_SHIFT)
          | sequence;
    }

    private static void checkAgent(String useragent) throws InvalidUserAgentError {
      if (useragent == null || !AGENT_PARSER.matcher(useragent).matches()) {
        throw new InvalidUserAgentError(
            "invalid user agent '" + useragent + "': expected [a-zA-Z][a-zA-Z\\-0-9]*");
      }
    }

    @Override
    public long get_id(String useragent) throws InvalidSystemClock, InvalidUserAgentError {
      checkAgent(useragent);
      return nextId();
    }

    /** Our IDL's batch call, which Twitter's server did not have: nextId in a loop. */
    @Override
    public List<Long> get_ids(String useragent, int count)
        throws InvalidSystemClock, InvalidUserAgentError, InvalidCountError {
      checkAgent(useragent);
      if (count < 1 || count > MAX_BATCH) {
        throw new InvalidCountError("count " + count + ": expected 1.." + MAX_BATCH);
      }
      List<Long> ids = new ArrayList<>(count);
      for (int i = 0; i < count; i++) {
        ids.add(nextId());
      }
      return ids;
    }

    @Override
    public long get_worker_id() {
      return workerId;
    }

    @Override
    public long get_datacenter_id() {
      return datacenterId;
    }

    @Override
    public long get_timestamp() {
      return timeGen();
    }

    @Override
    public Layout get_layout() {
      return new Layout(
          TWEPOCH,
          41,
          (int) DATACENTER_ID_BITS,
          (int) WORKER_ID_BITS,
          (int) SEQUENCE_BITS,
          datacenterId,
          workerId,
          0); // no clock sequence: Twitter's layout
    }
  }

  private static long flag(String[] args, String name, long fallback) {
    for (int i = 0; i < args.length; i++) {
      if (args[i].equals(name)) {
        if (i + 1 == args.length) {
          throw new IllegalArgumentException(name + " needs a value");
        }
        return Long.parseLong(args[i + 1]);
      }
    }
    return fallback;
  }

  public static void main(String[] args) throws Exception {
    for (int i = 0; i < args.length; i += 2) {
      if (!List.of("--port", "--worker-id", "--datacenter-id").contains(args[i])) {
        System.err.println(
            "usage: SnowflakeAnchor [--port N] [--worker-id N] [--datacenter-id N]");
        System.exit(2);
      }
    }
    int port = (int) flag(args, "--port", 0);
    IdWorker worker = new IdWorker(flag(args, "--worker-id", 0), flag(args, "--datacenter-id", 0));
    // A backlog like our server's (Java's default, 50, drops connects of a burst).
    TServerSocket socket =
        new TServerSocket(
            new TServerSocket.ServerSocketTransportArgs()
                .bindAddr(new InetSocketAddress(InetAddress.getByName("127.0.0.1"), port))
                .backlog(1024));
    TThreadPoolServer server =
        new TThreadPoolServer(
            new TThreadPoolServer.Args(socket)
                .processor(new Snowflake.Processor<>(worker))
                .transportFactory(new TFramedTransport.Factory())
                .protocolFactory(new TBinaryProtocol.Factory()));
    System.out.println(
        "anchor ready thrift=127.0.0.1:" + socket.getServerSocket().getLocalPort());
    System.out.flush();
    server.serve();
  }
}
