#!/usr/bin/env bash
# ctl.sh COMMAND [ARG] - send one command to the control port of the HDFS that tools/hdfs-up.sh
# started from $HDFS_RUN (/tmp/fastload-hdfs) and print the reply; exit 1 if it starts with
# "error". Commands (see MiniHDFS.java): status, stop-datanode I, start-datanode I,
# stop-namenode, start-namenode, restart-namenode [SECONDS], safemode enter|leave, shutdown.
set -euo pipefail
RUN=${HDFS_RUN:-/tmp/fastload-hdfs}
[ $# -ge 1 ] || { echo "usage: $0 COMMAND [ARG]" >&2; exit 2; }
port=$(cat "$RUN/control.port" 2>/dev/null) || { echo "ctl: no cluster in $RUN (run tools/hdfs-up.sh)" >&2; exit 1; }
exec 3<>"/dev/tcp/127.0.0.1/$port"
printf '%s\n' "$*" >&3
read -r -t 300 reply <&3
exec 3<&-
echo "$reply"
[[ $reply == ok* ]]
