#!/usr/bin/env bash
# ceph-up.sh - start a throw-away single-node Ceph (1 mon, 1 memstore OSD, radosgw with an S3 user)
# on 127.0.0.1, without systemd, for development and CI. Needs Debian's packages:
#   apt-get install -y --no-install-recommends ceph-mon ceph-osd radosgw ceph-common
# Everything (conf, keys, mon store, logs, pids) lives in $CEPH_RUN; tools/ceph-down.sh removes it.
#
# stdout: the S3 settings as shell exports (also written to $CEPH_RUN/s3.env), so
#   eval "$(tools/ceph-up.sh)"
# configures the current shell: AWS_ENDPOINT_URL (read by boto3 >= 1.28, hence by fastload, the
# fastload command and the aws CLI), the credentials and the region; S3_ENDPOINT_URL (the same URL)
# is kept for older scripts. Progress goes to stderr. If a cluster from the same $CEPH_RUN is
# already up and answering, its settings are printed and nothing is started (exit 0). A run
# directory left behind by a killed cluster (no recorded daemon alive) is removed and started over.
#
# Env: CEPH_RUN (/tmp/fastload-ceph), RGW_PORT (7480), MON_PORT and MON_V1_PORT (3300, 6789; other
# ports let a second cluster run beside the first, with another CEPH_RUN), MEMSTORE_BYTES (OSD capacity, default 3 GiB;
# the OSD holds ~2x the stored bytes in RAM), S3_ACCESS_KEY, S3_SECRET_KEY.
set -euo pipefail
T0=$(date +%s.%N)
RUN=${CEPH_RUN:-/tmp/fastload-ceph}
RGW_PORT=${RGW_PORT:-7480}
MON_PORT=${MON_PORT:-3300}        # msgr2; the legacy msgr1 port is MON_V1_PORT
MON_V1_PORT=${MON_V1_PORT:-6789}
MON_ADDR="[v2:127.0.0.1:$MON_PORT,v1:127.0.0.1:$MON_V1_PORT]"
MEMSTORE_BYTES=${MEMSTORE_BYTES:-$((3 * 1024 * 1024 * 1024))}
S3_ACCESS_KEY=${S3_ACCESS_KEY:-CIACCESSKEY000000001}
S3_SECRET_KEY=${S3_SECRET_KEY:-CIsecretkey0000000000000000000000000001}

el() { awk -v a="$T0" -v b="$(date +%s.%N)" -v m="$*" 'BEGIN { printf "ceph-up [%5.2fs] %s\n", b - a, m }' >&2; }
die() { echo "ceph-up: $* - logs in $RUN/log; clean up with tools/ceph-down.sh" >&2; exit 1; }
http_code() { # status code of "GET /" on 127.0.0.1:$1 via bash's /dev/tcp (no curl needed)
  local line
  exec 3<>"/dev/tcp/127.0.0.1/$1" || return 1
  printf 'GET / HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n' >&3
  read -r -t 5 line <&3 || true
  exec 3<&-
  echo "$line" | awk '{ print $2 }'
}
rgw_ok() { [ "$(http_code "$RGW_PORT" 2>/dev/null)" = 200 ]; }
wait_for() { # wait_for <seconds> <description> <command...>
  local t=$1 what=$2 i; shift 2
  for ((i = 0; i < t * 4; i++)); do "$@" >/dev/null 2>&1 && return 0; sleep 0.25; done
  die "timeout waiting for $what"
}
alive() { # a recorded daemon of this run is alive (CEPH_CONF in its environment guards PID reuse)
  local f pid
  for f in "$RUN"/pid/mon.a "$RUN"/pid/osd.0 "$RUN"/pid/rgw; do
    [ -f "$f" ] || continue
    pid=$(cat "$f")
    { tr '\0' '\n' <"/proc/$pid/environ"; } 2>/dev/null | grep -qx "CEPH_CONF=$RUN/ceph.conf" && return 0
  done
  return 1
}

if [ -e "$RUN" ]; then
  if [ -f "$RUN/s3.env" ] && alive && rgw_ok; then
    el "reusing the cluster already running from $RUN"
    # s3.env written by an older ceph-up.sh lacks AWS_ENDPOINT_URL: add it (same URL).
    if ! grep -q '^export AWS_ENDPOINT_URL=' "$RUN/s3.env"; then
      line=$(sed -n 's/^export S3_ENDPOINT_URL=/export AWS_ENDPOINT_URL=/p' "$RUN/s3.env")
      [ -z "$line" ] || echo "$line" >>"$RUN/s3.env"
    fi
    cat "$RUN/s3.env"
    exit 0
  fi
  alive && die "$RUN has live daemons but radosgw does not answer on 127.0.0.1:$RGW_PORT"
  el "removing stale $RUN (no daemon of it is alive)"
  rm -rf "$RUN"
fi
for bin in ceph-mon ceph-osd radosgw radosgw-admin ceph ceph-authtool monmaptool; do
  command -v "$bin" >/dev/null || { echo "ceph-up: $bin not found; apt-get install -y --no-install-recommends ceph-mon ceph-osd radosgw ceph-common" >&2; exit 2; }
done
for p in "$MON_PORT" "$MON_V1_PORT" "$RGW_PORT"; do
  (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null && { echo "ceph-up: port 127.0.0.1:$p already in use by another process" >&2; exit 1; }
done
mkdir -p "$RUN"/{mon/ceph-a,osd/ceph-0,rgw,log,asok,pid,crash}

FSID=$(cat /proc/sys/kernel/random/uuid)
CONF=$RUN/ceph.conf
export CEPH_CONF=$CONF # read by ceph, radosgw-admin and the daemons; ceph-down.sh checks it
cat >"$CONF" <<CONF
[global]
fsid = $FSID
mon_initial_members = a
mon_host = $MON_ADDR
public_network = 127.0.0.0/8
public_addr = 127.0.0.1
cluster_addr = 127.0.0.1
ms_bind_ipv4 = true
ms_bind_ipv6 = false
auth_cluster_required = cephx
auth_service_required = cephx
auth_client_required = cephx
auth_allow_insecure_global_id_reclaim = false
keyring = $RUN/ceph.client.admin.keyring
log_file = $RUN/log/\$name.log
admin_socket = $RUN/asok/\$name.asok
pid_file = $RUN/pid/\$name.cpid
run_dir = $RUN
crash_dir = $RUN/crash
osd_pool_default_size = 1
osd_pool_default_min_size = 1
osd_pool_default_pg_num = 8
osd_pool_default_pgp_num = 8
osd_pool_default_pg_autoscale_mode = off
osd_crush_chooseleaf_type = 0
mon_allow_pool_size_one = true
mon_warn_on_pool_no_redundancy = false
mon_max_pg_per_osd = 1000
mon_allow_pool_delete = true
mon_data_avail_warn = 10
# without this the monitor batches proposals for 1 s and start-up takes ~13 s instead of ~3 s
paxos_propose_interval = 0.1

[mon]
mon_data = $RUN/mon/ceph-\$id
mon_cluster_log_file = $RUN/log/cluster.log
keyring = $RUN/mon/ceph-\$id/keyring

[osd]
osd_data = $RUN/osd/ceph-\$id
keyring = $RUN/osd/ceph-\$id/keyring
osd_objectstore = memstore
memstore_device_bytes = $MEMSTORE_BYTES
osd_op_num_shards = 2
osd_op_num_threads_per_shard = 2

[client.rgw.local]
keyring = $RUN/rgw/keyring
rgw_data = $RUN/rgw
rgw_frontends = beast endpoint=127.0.0.1:$RGW_PORT
rgw_dns_name = 127.0.0.1
# memstore keeps deleted objects in RAM until RGW garbage collection (defaults: 2 h / 1 h)
rgw_gc_obj_min_wait = 60
rgw_gc_processor_period = 60
CONF

# --- monitor -----------------------------------------------------------------------------------
ceph-authtool --create-keyring "$RUN/mon.keyring" --gen-key -n mon. --cap mon 'allow *' >/dev/null
ceph-authtool --create-keyring "$RUN/ceph.client.admin.keyring" --gen-key -n client.admin \
  --cap mon 'allow *' --cap osd 'allow *' --cap mgr 'allow *' >/dev/null
ceph-authtool "$RUN/mon.keyring" --import-keyring "$RUN/ceph.client.admin.keyring" >/dev/null
monmaptool --create --fsid "$FSID" --addv a "$MON_ADDR" "$RUN/monmap" >/dev/null
ceph-mon --mkfs -i a --monmap "$RUN/monmap" --keyring "$RUN/mon.keyring" >"$RUN/log/mon.a.mkfs" 2>&1 ||
  die "mon mkfs failed: $(cat "$RUN/log/mon.a.mkfs")"
cp "$RUN/mon.keyring" "$RUN/mon/ceph-a/keyring"
# -f keeps the daemon in the foreground of its own background job, so $! is the daemon's PID
ceph-mon -f -i a >"$RUN/log/mon.a.stdout" 2>&1 &
echo $! >"$RUN/pid/mon.a"
wait_for 60 "the monitor's quorum" timeout 10 ceph --connect-timeout 5 mon stat
el "mon up (pid $(cat "$RUN/pid/mon.a"))"

# --- one memstore OSD --------------------------------------------------------------------------
OSD_UUID=$(cat /proc/sys/kernel/random/uuid)
OSD_SECRET=$(ceph-authtool --gen-print-key)
printf '{"cephx_secret": "%s"}\n' "$OSD_SECRET" >"$RUN/osd/new.json"
OSD_ID=$(ceph osd new "$OSD_UUID" -i "$RUN/osd/new.json")
[ "$OSD_ID" = 0 ] || die "unexpected osd id $OSD_ID"
ceph-authtool --create-keyring "$RUN/osd/ceph-0/keyring" --name osd.0 --add-key "$OSD_SECRET" >/dev/null
ceph-osd -i 0 --mkfs --osd-uuid "$OSD_UUID" >"$RUN/log/osd.0.mkfs" 2>&1 ||
  die "osd mkfs failed: $(cat "$RUN/log/osd.0.mkfs")"
ceph-osd -f -i 0 >"$RUN/log/osd.0.stdout" 2>&1 &
echo $! >"$RUN/pid/osd.0"
osd_up() { ceph osd stat | grep -q '1 osds: 1 up'; }
wait_for 60 "osd.0 up" osd_up
el "osd.0 up (pid $(cat "$RUN/pid/osd.0"), memstore $((MEMSTORE_BYTES >> 20)) MiB)"

# --- radosgw (beast) with one S3 user ----------------------------------------------------------
ceph auth get-or-create client.rgw.local mon 'allow rw' osd 'allow rwx' -o "$RUN/rgw/keyring"
radosgw -f -n client.rgw.local >"$RUN/log/rgw.stdout" 2>&1 &
echo $! >"$RUN/pid/rgw"
wait_for 120 "radosgw on 127.0.0.1:$RGW_PORT" rgw_ok
radosgw-admin user create --uid=ci --display-name="CI user" \
  --access-key="$S3_ACCESS_KEY" --secret-key="$S3_SECRET_KEY" >"$RUN/rgw/user-ci.json"
cat >"$RUN/s3.env" <<ENV
export CEPH_CONF=$CONF
export AWS_ENDPOINT_URL=http://127.0.0.1:$RGW_PORT
export S3_ENDPOINT_URL=http://127.0.0.1:$RGW_PORT
export AWS_ACCESS_KEY_ID=$S3_ACCESS_KEY
export AWS_SECRET_ACCESS_KEY=$S3_SECRET_KEY
export AWS_DEFAULT_REGION=us-east-1
ENV
el "S3 ready on http://127.0.0.1:$RGW_PORT (pid $(cat "$RUN/pid/rgw")); path-style addressing; settings in $RUN/s3.env"
cat "$RUN/s3.env"
