// Call the snowflake service from Java with Apache Thrift (Debian: libthrift-java).
//
//   make stubs                       # generates clients/java/gen-java from idl/
//   cd clients/java
//   javac -d build -cp /usr/share/java/thrift.jar $(find gen-java -name '*.java') Example.java
//   java -cp build:/usr/share/java/thrift.jar:/usr/share/java/slf4j-nop.jar Example [HOST [PORT]]
//
// Java's long is a signed 64-bit integer: ids fit exactly.

import com.twitter.service.snowflake.gen.InvalidSystemClock;
import com.twitter.service.snowflake.gen.InvalidUserAgentError;
import com.twitter.service.snowflake.gen.Snowflake;
import org.apache.thrift.protocol.TBinaryProtocol;
import org.apache.thrift.transport.TSocket;
import org.apache.thrift.transport.TTransport;
import org.apache.thrift.transport.layered.TFramedTransport;

public class Example {
  public static void main(String[] args) throws Exception {
    String host = args.length > 0 ? args[0] : "127.0.0.1";
    int port = args.length > 1 ? Integer.parseInt(args[1]) : 7609;

    // Framed is the server's default; for --transport buffered use the TSocket itself.
    TTransport transport = new TFramedTransport(new TSocket(host, port, 5000));
    transport.open();
    try {
      Snowflake.Client client = new Snowflake.Client(new TBinaryProtocol(transport));
      System.out.println(client.get_id("example-java"));
      for (long id : client.get_ids("example-java", 3)) {
        System.out.println(id);
      }
      try {
        client.get_id("not a valid agent");
      } catch (InvalidUserAgentError e) {
        System.err.println("refused: " + e.getMessage());
      } catch (InvalidSystemClock e) { // the server's clock went back: try another server
        System.err.println("clock: " + e.getMessage());
      }
    } finally {
      transport.close();
    }
  }
}
