#!/usr/bin/env bash
# hdfs-up.sh - start a throw-away real HDFS on 127.0.0.1 for development and CI: Hadoop's own
# MiniDFSCluster (org.apache.hadoop:hadoop-client-minicluster, version in tools/hdfs/pom.xml) with
# 1 NameNode and $HDFS_DATANODES DataNodes, run by tools/hdfs/MiniHDFS.java. Needs Java 17 (or 11)
# and Maven; the first run downloads ~110 MB of jars into ~/.m2 (about 15 s on the project's
# machines), later runs use them from there.
#
# stdout: the cluster's URL, hdfs://127.0.0.1:PORT (also in $HDFS_RUN/url), so
#   url=$(tools/hdfs-up.sh) && fastload convert SRC "$url/datasets/x" --format webdataset
# Progress goes to stderr. It returns once the NameNode is out of safe mode and every DataNode
# has registered. If a cluster from the same $HDFS_RUN is already up and answering, its URL is
# printed and nothing is started (exit 0); a run directory left by a killed cluster is removed.
#
# Everything lives in $HDFS_RUN: data/ (NameNode and DataNode storage), log/minihdfs.log, pid,
# url, control.port and datanodes (one "INDEX HOST:PORT" line per DataNode). Faults for tests go
# through the launcher's control port, e.g. tools/hdfs/ctl.sh stop-datanode 1 (see MiniHDFS.java).
# tools/hdfs-down.sh stops the cluster and removes $HDFS_RUN.
#
# Env: HDFS_RUN (/tmp/fastload-hdfs), HDFS_PORT (NameNode RPC port, 0 = a free one),
# HDFS_DATANODES (2), HDFS_BLOCK_SIZE (1048576: test files span several blocks), HDFS_REPLICATION
# (2), HDFS_LOG_LEVEL (warn), HDFS_JAVA_OPTS (-Xmx1g -XX:+UseSerialGC -XX:TieredStopAtLevel=1).
set -euo pipefail
T0=$(date +%s.%N)
RUN=${HDFS_RUN:-/tmp/fastload-hdfs}
PORT=${HDFS_PORT:-0}
DATANODES=${HDFS_DATANODES:-2}
BLOCK_SIZE=${HDFS_BLOCK_SIZE:-1048576}
REPLICATION=${HDFS_REPLICATION:-2}
LOG_LEVEL=${HDFS_LOG_LEVEL:-warn}
read -r -a JAVA_OPTS <<<"${HDFS_JAVA_OPTS:--Xmx1g -XX:+UseSerialGC -XX:TieredStopAtLevel=1}"
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
SRC=$HERE/hdfs
BUILD=$SRC/target

el() { awk -v a="$T0" -v b="$(date +%s.%N)" -v m="$*" 'BEGIN { printf "hdfs-up [%5.2fs] %s\n", b - a, m }' >&2; }
die() { echo "hdfs-up: $* - logs in $RUN/log; clean up with tools/hdfs-down.sh" >&2; exit 1; }
ours() { # pid $1 is this run's launcher (the run directory is on its command line)
  { tr '\0' '\n' <"/proc/$1/cmdline"; } 2>/dev/null | grep -qx -- "-Dfastload.hdfs.run=$RUN"
}
answers() { # the control port of this run answers "status" with "ok"
  local port line
  port=$(cat "$RUN/control.port" 2>/dev/null) || return 1
  exec 3<>"/dev/tcp/127.0.0.1/$port" || return 1
  printf 'status\n' >&3
  read -r -t 10 line <&3 || true
  exec 3<&-
  [[ $line == ok* ]]
}

if [ -e "$RUN" ]; then
  pid=$(cat "$RUN/pid" 2>/dev/null || echo 0)
  if [ -f "$RUN/url" ] && ours "$pid" && answers 2>/dev/null; then
    el "reusing the cluster already running from $RUN"
    cat "$RUN/url"
    exit 0
  fi
  if ours "$pid"; then
    # Still starting (another hdfs-up.sh is waiting for it) or wedged: do not start a second one.
    die "$RUN has a live launcher (pid $pid) that does not answer yet; wait, or stop it with tools/hdfs-down.sh"
  fi
  el "removing stale $RUN (its launcher is not running)"
  rm -rf "$RUN"
fi
for bin in java javac mvn; do
  command -v "$bin" >/dev/null || {
    echo "hdfs-up: $bin not found; apt-get install -y --no-install-recommends openjdk-17-jdk-headless maven" >&2
    exit 2
  }
done
mkdir -p "$RUN/log" "$BUILD"

# The classpath (resolved by Maven into ~/.m2) and the compiled launcher, kept in tools/hdfs/target
# and rebuilt when pom.xml or MiniHDFS.java changes. Written under temporary names and renamed, so
# two scripts starting at once (other HDFS_RUN) never see half a file.
if [ ! -s "$BUILD/classpath.txt" ] || [ "$SRC/pom.xml" -nt "$BUILD/classpath.txt" ]; then
  el "resolving Hadoop's jars with Maven (the first run downloads ~110 MB into ~/.m2)"
  tmp=$BUILD/classpath.txt.$$
  mvn -B -q -f "$SRC/pom.xml" dependency:build-classpath -Dmdep.outputFile="$tmp" \
    >"$RUN/log/mvn.log" 2>&1 || { cat "$RUN/log/mvn.log" >&2; rm -f "$tmp"; die "mvn dependency:build-classpath failed"; }
  mv -f "$tmp" "$BUILD/classpath.txt"
  el "jars resolved"
fi
CP=$(cat "$BUILD/classpath.txt")
if [ ! -f "$BUILD/classes/MiniHDFS.class" ] || [ "$SRC/MiniHDFS.java" -nt "$BUILD/classes/MiniHDFS.class" ] ||
  [ "$BUILD/classpath.txt" -nt "$BUILD/classes/MiniHDFS.class" ]; then
  tmp=$BUILD/classes.$$
  rm -rf "$tmp" && mkdir -p "$tmp"
  javac -nowarn -d "$tmp" -cp "$CP" "$SRC/MiniHDFS.java" 2>"$RUN/log/javac.log" ||
    { cat "$RUN/log/javac.log" >&2; rm -rf "$tmp"; die "javac failed"; }
  rm -rf "$BUILD/classes" && mv "$tmp" "$BUILD/classes"
  el "launcher compiled"
fi

# A session of its own (setsid): Ctrl-C in the shell or the test runner does not reach it.
setsid java "${JAVA_OPTS[@]}" "-Dfastload.hdfs.run=$RUN" \
  "-Dorg.slf4j.simpleLogger.defaultLogLevel=$LOG_LEVEL" -Dorg.slf4j.simpleLogger.showDateTime=true \
  -cp "$BUILD/classes:$CP" MiniHDFS "$RUN" "$PORT" 0 "$DATANODES" "$BLOCK_SIZE" "$REPLICATION" \
  </dev/null >>"$RUN/log/minihdfs.log" 2>&1 &
pid=$!
echo "$pid" >"$RUN/pid"
el "launcher started (pid $pid); waiting for the NameNode to leave safe mode"
for ((i = 0; i < 180 * 4; i++)); do
  [ -f "$RUN/url" ] && break
  kill -0 "$pid" 2>/dev/null || { tail -n 30 "$RUN/log/minihdfs.log" >&2; die "the launcher exited"; }
  sleep 0.25
done
[ -f "$RUN/url" ] || { tail -n 30 "$RUN/log/minihdfs.log" >&2; die "timeout (180 s) waiting for the cluster"; }
el "HDFS up at $(cat "$RUN/url") with $DATANODES DataNodes (block size $BLOCK_SIZE, replication $REPLICATION)"
cat "$RUN/url"
