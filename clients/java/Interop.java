// Interop check: the Apache Thrift Java client against a running server.
//
//   java -cp build:/usr/share/java/thrift.jar:/usr/share/java/slf4j-nop.jar Interop HOST PORT framed|buffered
//
// Prints one JSON object a line (ids as decimal strings) for tests/test_interop.py.
// Everything happens on ONE connection. Each {"step": "waiting"} line is followed
// by reading a line from stdin: meanwhile the test steps the server's clock back,
// then restores it.

import com.twitter.service.snowflake.gen.InvalidCountError;
import com.twitter.service.snowflake.gen.InvalidSystemClock;
import com.twitter.service.snowflake.gen.InvalidUserAgentError;
import com.twitter.service.snowflake.gen.Layout;
import com.twitter.service.snowflake.gen.Snowflake;
import java.io.BufferedReader;
import java.io.InputStreamReader;
import java.nio.charset.StandardCharsets;
import java.util.ArrayList;
import java.util.List;
import org.apache.thrift.TException;
import org.apache.thrift.protocol.TBinaryProtocol;
import org.apache.thrift.transport.TSocket;
import org.apache.thrift.transport.TTransport;
import org.apache.thrift.transport.layered.TFramedTransport;

public class Interop {
  static final String AGENT = "interop-java";

  interface Call {
    Object run() throws TException;
  }

  static String quote(String s) {
    StringBuilder out = new StringBuilder("\"");
    for (char c : s.toCharArray()) {
      if (c == '"' || c == '\\') out.append('\\').append(c);
      else if (c < 0x20) out.append(String.format("\\u%04x", (int) c));
      else out.append(c);
    }
    return out.append('"').toString();
  }

  /** One JSON line from key/value pairs; values are quoted unless they are Integers. */
  static void emit(Object... pairs) {
    StringBuilder out = new StringBuilder("{");
    for (int i = 0; i < pairs.length; i += 2) {
      if (i > 0) out.append(", ");
      out.append(quote((String) pairs[i])).append(": ");
      Object value = pairs[i + 1];
      if (value == null) out.append("null");
      else if (value instanceof Integer) out.append(value);
      else if (value instanceof List) {
        List<String> items = new ArrayList<>();
        for (Object item : (List<?>) value) items.add(quote(String.valueOf(item)));
        out.append("[").append(String.join(", ", items)).append("]");
      } else out.append(quote(String.valueOf(value)));
    }
    System.out.println(out.append("}"));
    System.out.flush();
  }

  static void expectError(String step, Call call) throws TException {
    try {
      Object result = call.run();
      emit("step", step, "error", null, "result", String.valueOf(result));
    } catch (InvalidUserAgentError e) {
      emit("step", step, "error", "InvalidUserAgentError", "message", e.getMessage());
    } catch (InvalidCountError e) {
      emit("step", step, "error", "InvalidCountError", "message", e.getMessage());
    } catch (InvalidSystemClock e) {
      emit("step", step, "error", "InvalidSystemClock", "message", e.getMessage());
    }
  }

  public static void main(String[] args) throws Exception {
    String host = args[0];
    int port = Integer.parseInt(args[1]);
    TSocket socket = new TSocket(host, port, 10000);
    TTransport transport = args[2].equals("framed") ? new TFramedTransport(socket) : socket;
    BufferedReader stdin =
        new BufferedReader(new InputStreamReader(System.in, StandardCharsets.UTF_8));
    transport.open();
    try {
      Snowflake.Client client = new Snowflake.Client(new TBinaryProtocol(transport));
      emit("step", "get_id", "id", client.get_id(AGENT));
      emit("step", "get_ids", "ids", client.get_ids(AGENT, 5));
      expectError("bad_agent", () -> client.get_id("1bad"));
      expectError("bad_count", () -> client.get_ids(AGENT, 0));
      expectError("bad_agent_batch", () -> client.get_ids("no spaces", 3));
      emit("step", "after_errors", "id", client.get_id(AGENT));
      Layout layout = client.get_layout();
      emit(
          "step", "layout",
          "epoch_ms", layout.epoch_ms,
          "timestamp_bits", layout.timestamp_bits,
          "datacenter_id_bits", layout.datacenter_id_bits,
          "worker_id_bits", layout.worker_id_bits,
          "sequence_bits", layout.sequence_bits,
          "datacenter_id", layout.datacenter_id,
          "worker_id", layout.worker_id);
      emit(
          "step", "ids",
          "worker_id", client.get_worker_id(),
          "datacenter_id", client.get_datacenter_id(),
          "timestamp", client.get_timestamp());
      emit("step", "waiting", "until", "clock_back");
      stdin.readLine();
      expectError("clock", () -> client.get_id(AGENT));
      expectError("clock_batch", () -> client.get_ids(AGENT, 2));
      emit("step", "after_clock", "worker_id", client.get_worker_id());
      emit("step", "waiting", "until", "clock_restored");
      stdin.readLine();
      emit("step", "recovered", "id", client.get_id(AGENT));
      emit("step", "done");
    } finally {
      transport.close();
    }
  }
}
