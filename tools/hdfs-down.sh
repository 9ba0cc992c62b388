#!/usr/bin/env bash
# hdfs-down.sh - stop the HDFS tools/hdfs-up.sh started from $HDFS_RUN (asked through its control
# port first, then by recorded PID only, checked against the run directory on its command line so
# that a reused PID is never signalled), then delete $HDFS_RUN. Safe to run twice.
set -uo pipefail
T0=$(date +%s.%N)
RUN=${HDFS_RUN:-/tmp/fastload-hdfs}
[ -d "$RUN" ] || { echo "hdfs-down: nothing to do ($RUN absent)"; exit 0; }

ours() { { tr '\0' '\n' <"/proc/$1/cmdline"; } 2>/dev/null | grep -qx -- "-Dfastload.hdfs.run=$RUN"; }
pid=$(cat "$RUN/pid" 2>/dev/null || echo 0)
if [ "$pid" -gt 0 ] && ours "$pid"; then
  port=$(cat "$RUN/control.port" 2>/dev/null || true)
  if [ -n "$port" ] && exec 3<>"/dev/tcp/127.0.0.1/$port"; then
    printf 'shutdown\n' >&3
    read -r -t 20 _ <&3 || true
    exec 3<&-
  fi 2>/dev/null
  for ((i = 0; i < 80; i++)); do ours "$pid" || break; sleep 0.25; done
  if ours "$pid"; then
    kill -TERM "$pid"
    for ((i = 0; i < 40; i++)); do ours "$pid" || break; sleep 0.25; done
  fi
  if ours "$pid"; then kill -KILL "$pid"; echo "hdfs-down: launcher (pid $pid) killed after 30 s"
  else echo "hdfs-down: launcher (pid $pid) stopped"; fi
fi
rm -rf "$RUN"
awk -v a="$T0" -v b="$(date +%s.%N)" -v r="$RUN" 'BEGIN { printf "hdfs-down: %s removed (%.2fs)\n", r, b - a }'
