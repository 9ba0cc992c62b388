#!/usr/bin/env bash
# ceph-down.sh - stop the daemons tools/ceph-up.sh started from $CEPH_RUN (by recorded PID only,
# checked against the CEPH_CONF in their environment so that a reused PID is never signalled),
# then delete $CEPH_RUN. Safe to run twice.
set -uo pipefail
T0=$(date +%s.%N)
RUN=${CEPH_RUN:-/tmp/fastload-ceph}
[ -d "$RUN" ] || { echo "ceph-down: nothing to do ($RUN absent)"; exit 0; }

ours() { { tr '\0' '\n' <"/proc/$1/environ"; } 2>/dev/null | grep -qx "CEPH_CONF=$RUN/ceph.conf"; }
for f in rgw osd.0 mon.a; do # reverse start order, one at a time (an OSD whose mon is gone waits)
  [ -f "$RUN/pid/$f" ] || continue
  pid=$(cat "$RUN/pid/$f")
  ours "$pid" || continue
  kill -TERM "$pid"
  for ((i = 0; i < 40; i++)); do ours "$pid" || break; sleep 0.25; done
  if ours "$pid"; then kill -KILL "$pid"; echo "ceph-down: $f (pid $pid) killed after 10 s"
  else echo "ceph-down: $f (pid $pid) stopped"; fi
done
ENDPOINT=$(sed -n 's/^export S3_ENDPOINT_URL=//p' "$RUN/s3.env" 2>/dev/null || true)
rm -rf "$RUN"
awk -v a="$T0" -v b="$(date +%s.%N)" -v r="$RUN" 'BEGIN { printf "ceph-down: %s removed (%.2fs)\n", r, b - a }'
# A shell that ran eval "$(tools/ceph-up.sh)" still points boto3 and fastload at the dead gateway.
if [ -n "$ENDPOINT" ] && [ "${AWS_ENDPOINT_URL:-}" = "$ENDPOINT" ]; then
  echo "ceph-down: this shell's AWS_ENDPOINT_URL still names $ENDPOINT; to stop using it:" \
    "unset AWS_ENDPOINT_URL S3_ENDPOINT_URL AWS_ACCESS_KEY_ID AWS_SECRET_ACCESS_KEY AWS_DEFAULT_REGION CEPH_CONF"
fi
