// MiniHDFS: a real single-machine HDFS (Hadoop's own MiniDFSCluster: 1 NameNode, N DataNodes) on
// 127.0.0.1 for fastload's tests and benchmarks, with a line-based control port so that tests can
// stop and restart DataNodes and the NameNode while clients read. Started by tools/hdfs-up.sh.
//
// Usage: java -cp CLASSPATH MiniHDFS RUN_DIR NAMENODE_PORT CONTROL_PORT DATANODES BLOCK_SIZE REPLICATION
//
// Writes into RUN_DIR: url (hdfs://127.0.0.1:PORT), control.port, datanodes (one "INDEX HOST:PORT"
// line per DataNode), and the cluster's storage under RUN_DIR/data. It writes url last, once the
// NameNode has left safe mode and every DataNode has registered, so a reader of that file finds a
// cluster that accepts writes.
//
// Control port (127.0.0.1 only; one command per line, one reply line per command, starting with
// "ok" or "error"):
//   status                       ok url=... namenode=up|down datanodes=0:up,1:down safemode=off
//   stop-datanode I              stops DataNode I (0-based, the numbering of the datanodes file)
//   start-datanode I             starts a stopped DataNode I again on its old ports, waits until
//                                the NameNode has it
//   stop-namenode                stops the NameNode (clients get connection refused)
//   start-namenode               starts it again on the same port, waits until it is active and
//                                out of safe mode
//   restart-namenode [SECONDS]   stop-namenode, wait SECONDS (default 0), start-namenode
//   safemode enter|leave         puts the NameNode into safe mode (writes fail) or out of it
//   shutdown                     stops the cluster and exits (tools/hdfs-down.sh uses this)

import java.io.BufferedReader;
import java.io.IOException;
import java.io.InputStreamReader;
import java.io.PrintWriter;
import java.net.InetAddress;
import java.net.ServerSocket;
import java.net.Socket;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Path;
import java.nio.file.StandardCopyOption;
import java.util.ArrayList;
import java.util.HashMap;
import java.util.List;
import java.util.Map;

import org.apache.hadoop.conf.Configuration;
import org.apache.hadoop.fs.permission.FsPermission;
import org.apache.hadoop.hdfs.DistributedFileSystem;
import org.apache.hadoop.hdfs.MiniDFSCluster;
import org.apache.hadoop.hdfs.protocol.HdfsConstants.SafeModeAction;
import org.apache.hadoop.hdfs.server.datanode.DataNode;

public final class MiniHDFS {
  private final MiniDFSCluster cluster;
  private final String url;
  private final List<String> names = new ArrayList<>(); // DataNode i's transfer address
  private final Map<Integer, MiniDFSCluster.DataNodeProperties> stopped = new HashMap<>();
  private boolean nameNodeUp = true;

  private MiniHDFS(MiniDFSCluster cluster, String url) {
    this.cluster = cluster;
    this.url = url;
    for (DataNode dn : cluster.getDataNodes()) {
      names.add(dn.getDatanodeId().getXferAddr());
    }
  }

  public static void main(String[] args) throws Exception {
    if (args.length != 6) {
      System.err.println(
          "usage: MiniHDFS RUN_DIR NAMENODE_PORT CONTROL_PORT DATANODES BLOCK_SIZE REPLICATION");
      System.exit(2);
    }
    Path run = Path.of(args[0]).toAbsolutePath();
    int nnPort = Integer.parseInt(args[1]);
    int controlPort = Integer.parseInt(args[2]);
    int dataNodes = Integer.parseInt(args[3]);
    long blockSize = Long.parseLong(args[4]);
    int replication = Integer.parseInt(args[5]);

    Configuration conf = new Configuration();
    conf.setLong("dfs.blocksize", blockSize);
    conf.setLong("dfs.namenode.fs-limits.min-block-size", Math.min(blockSize, 1024 * 1024));
    conf.setInt("dfs.replication", replication);
    conf.setInt("dfs.namenode.safemode.extension", 0);
    conf.set("dfs.namenode.rpc-address", "127.0.0.1:" + nnPort);
    conf.set("dfs.datanode.hostname", "127.0.0.1");
    // Listen on loopback only (MiniDFSCluster's DataNodes do; the NameNode's HTTP server too).
    conf.set("dfs.namenode.http-address", "127.0.0.1:0");
    // A stopped DataNode stays in the NameNode's block locations for ~10 min (the default dead
    // interval): clients must fail over to the other replica, which is what the tests check.
    Path data = run.resolve("data");
    MiniDFSCluster cluster =
        new MiniDFSCluster.Builder(conf, data.toFile())
            .nameNodePort(nnPort)
            .numDataNodes(dataNodes)
            .format(true)
            .manageNameDfsDirs(true)
            .checkDataNodeHostConfig(true)
            .build();
    cluster.waitActive();
    MiniHDFS mini = new MiniHDFS(cluster, "hdfs://127.0.0.1:" + cluster.getNameNodePort());
    mini.waitOutOfSafeMode();
    // Any local user may write (tests run as whoever they run as, the launcher too).
    DistributedFileSystem fs = cluster.getFileSystem();
    fs.setPermission(new org.apache.hadoop.fs.Path("/"), new FsPermission((short) 0777));

    ServerSocket control = new ServerSocket(controlPort, 16, InetAddress.getLoopbackAddress());
    StringBuilder dns = new StringBuilder();
    for (int i = 0; i < mini.names.size(); i++) {
      dns.append(i).append(' ').append(mini.names.get(i)).append('\n');
    }
    write(run.resolve("datanodes"), dns.toString());
    write(run.resolve("control.port"), control.getLocalPort() + "\n");
    write(run.resolve("url"), mini.url + "\n");
    System.out.println("MiniHDFS up: " + mini.url + " control port " + control.getLocalPort());
    System.out.flush();
    Runtime.getRuntime().addShutdownHook(new Thread(cluster::shutdown));
    mini.serve(control);
  }

  private static void write(Path path, String text) throws IOException {
    Path tmp = path.resolveSibling(path.getFileName() + ".tmp");
    Files.writeString(tmp, text, StandardCharsets.UTF_8);
    Files.move(tmp, path, StandardCopyOption.ATOMIC_MOVE, StandardCopyOption.REPLACE_EXISTING);
  }

  private void waitOutOfSafeMode() throws IOException, InterruptedException {
    DistributedFileSystem fs = cluster.getFileSystem();
    long deadline = System.currentTimeMillis() + 120_000;
    while (fs.setSafeMode(SafeModeAction.SAFEMODE_GET)) {
      if (System.currentTimeMillis() > deadline) {
        throw new IOException("the NameNode did not leave safe mode within 120 s");
      }
      Thread.sleep(100);
    }
  }

  private void serve(ServerSocket control) throws IOException {
    while (true) {
      try (Socket socket = control.accept();
          BufferedReader in =
              new BufferedReader(
                  new InputStreamReader(socket.getInputStream(), StandardCharsets.UTF_8));
          PrintWriter out =
              new PrintWriter(socket.getOutputStream(), true, StandardCharsets.UTF_8)) {
        String line;
        while ((line = in.readLine()) != null) {
          line = line.trim();
          if (line.isEmpty()) {
            continue;
          }
          String reply;
          try {
            reply = "ok " + command(line.split("\\s+"));
          } catch (Exception e) {
            reply = "error " + e.getClass().getSimpleName() + ": " + e.getMessage();
          }
          System.out.println("control: " + line + " -> " + reply);
          System.out.flush();
          out.println(reply.replace('\n', ' '));
          if (line.equals("shutdown")) {
            cluster.shutdown();
            System.exit(0);
          }
        }
      } catch (IOException e) {
        System.out.println("control connection: " + e);
      }
    }
  }

  private synchronized String command(String[] words) throws Exception {
    switch (words[0]) {
      case "status":
        return status();
      case "stop-datanode": {
        int i = dataNodeIndex(words);
        if (stopped.containsKey(i)) {
          return "datanode " + i + " already stopped";
        }
        MiniDFSCluster.DataNodeProperties props = cluster.stopDataNode(names.get(i));
        if (props == null) {
          throw new IllegalStateException("datanode " + i + " (" + names.get(i) + ") not found");
        }
        stopped.put(i, props);
        return "datanode " + i + " stopped";
      }
      case "start-datanode": {
        int i = dataNodeIndex(words);
        MiniDFSCluster.DataNodeProperties props = stopped.remove(i);
        if (props == null) {
          return "datanode " + i + " already running";
        }
        // Not cluster.waitActive(): it waits until the NameNode's live count equals the running
        // DataNodes, and the NameNode still counts a stopped DataNode as live for ~10 minutes.
        cluster.restartDataNode(props, true);
        DataNode dn = cluster.getDataNodes().get(cluster.getDataNodes().size() - 1);
        long deadline = System.currentTimeMillis() + 120_000;
        while (nameNodeUp && !dn.isDatanodeFullyStarted()) {
          if (System.currentTimeMillis() > deadline) {
            throw new IllegalStateException("datanode " + i + " did not start within 120 s");
          }
          Thread.sleep(100);
        }
        return "datanode " + i + " started";
      }
      case "stop-namenode":
        cluster.shutdownNameNode(0);
        nameNodeUp = false;
        return "namenode stopped";
      case "start-namenode":
        startNameNode();
        return "namenode started";
      case "restart-namenode": {
        double seconds = words.length > 1 ? Double.parseDouble(words[1]) : 0;
        cluster.shutdownNameNode(0);
        nameNodeUp = false;
        Thread.sleep((long) (seconds * 1000));
        startNameNode();
        return "namenode restarted";
      }
      case "safemode": {
        if (words.length != 2 || !(words[1].equals("enter") || words[1].equals("leave"))) {
          throw new IllegalArgumentException("safemode takes enter or leave");
        }
        boolean on = cluster.getFileSystem().setSafeMode(
            words[1].equals("enter") ? SafeModeAction.SAFEMODE_ENTER : SafeModeAction.SAFEMODE_LEAVE);
        return "safemode " + (on ? "on" : "off");
      }
      case "shutdown":
        return "shutting down";
      default:
        throw new IllegalArgumentException(
            "unknown command " + words[0] + " (status, stop-datanode I, start-datanode I, "
                + "stop-namenode, start-namenode, restart-namenode [SECONDS], safemode enter|leave, "
                + "shutdown)");
    }
  }

  private void startNameNode() throws Exception {
    if (nameNodeUp) {
      return;
    }
    cluster.restartNameNode(0, true);
    nameNodeUp = true;
    waitOutOfSafeMode();
  }

  private int dataNodeIndex(String[] words) {
    if (words.length != 2) {
      throw new IllegalArgumentException(words[0] + " takes a DataNode index");
    }
    int i = Integer.parseInt(words[1]);
    if (i < 0 || i >= names.size()) {
      throw new IllegalArgumentException(
          "no datanode " + i + "; there are " + names.size() + " (0.." + (names.size() - 1) + ")");
    }
    return i;
  }

  private String status() throws IOException {
    StringBuilder dns = new StringBuilder();
    for (int i = 0; i < names.size(); i++) {
      dns.append(i == 0 ? "" : ",").append(i).append(stopped.containsKey(i) ? ":down" : ":up");
    }
    String safe = "unknown";
    if (nameNodeUp) {
      safe = cluster.getFileSystem().setSafeMode(SafeModeAction.SAFEMODE_GET) ? "on" : "off";
    }
    return "url=" + url + " namenode=" + (nameNodeUp ? "up" : "down") + " datanodes=" + dns
        + " safemode=" + safe;
  }
}
