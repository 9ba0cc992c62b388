#!/usr/bin/env bash
# slurm-up.sh - start a throw-away one-node SLURM cluster (munged, slurmctld, slurmd) on 127.0.0.1,
# without systemd, for the launcher tests (srun -n 3 ...). Needs root and Debian's packages:
#   apt-get install -y --no-install-recommends slurmctld slurmd slurm-client munge
# Everything (slurm.conf, the munge key and socket, state, spool, logs, pids) lives in $SLURM_RUN;
# tools/slurm-down.sh stops the daemons and removes it. Nothing under /etc is read or written.
#
# stdout: `export SLURM_CONF=$SLURM_RUN/slurm.conf` (also written to $SLURM_RUN/slurm.env), so
#   eval "$(tools/slurm-up.sh)"; srun -n 3 hostname
# works in the current shell. Progress goes to stderr. If a cluster from the same $SLURM_RUN is up
# and its node is idle or busy, its settings are printed and nothing is started (exit 0). A run
# directory left by a killed cluster (no recorded daemon alive) is removed and started over.
#
# Env: SLURM_RUN (/tmp/fastload-slurm), SLURMCTLD_PORT (6917), SLURMD_PORT (6918), SLURM_CPUS
# (CPUs the node declares, default 8: more than the machine has, so srun -n 3 runs on 2 cores;
# tasks then share cores).
set -euo pipefail
T0=$(date +%s.%N)
RUN=${SLURM_RUN:-/tmp/fastload-slurm}
CTLD_PORT=${SLURMCTLD_PORT:-6917}
SLURMD_PORT=${SLURMD_PORT:-6918}
CPUS=${SLURM_CPUS:-8}
NODE=$(hostname -s)

el() { awk -v a="$T0" -v b="$(date +%s.%N)" -v m="$*" 'BEGIN { printf "slurm-up [%5.2fs] %s\n", b - a, m }' >&2; }
die() { echo "slurm-up: $* - logs in $RUN/log; clean up with tools/slurm-down.sh" >&2; exit 1; }
alive() { # a recorded daemon of this run is alive (its command line names this run's files)
  local f pid
  for f in "$RUN"/pid/munged "$RUN"/pid/slurmctld "$RUN"/pid/slurmd; do
    [ -f "$f" ] || continue
    pid=$(cat "$f")
    { tr '\0' ' ' <"/proc/$pid/cmdline"; } 2>/dev/null | grep -q -- "$RUN/" && return 0
  done
  return 1
}
node_ready() { # the node answers: idle, or running jobs (mixed/allocated)
  SLURM_CONF="$RUN/slurm.conf" sinfo -h -n "$NODE" -o %T 2>/dev/null | grep -Eq '^(idle|mixed|allocated)'
}
wait_for() { # wait_for <seconds> <description> <command...>
  local t=$1 what=$2 i; shift 2
  for ((i = 0; i < t * 4; i++)); do "$@" >/dev/null 2>&1 && return 0; sleep 0.25; done
  die "timeout waiting for $what"
}

for prog in munged slurmctld slurmd sinfo srun; do
  command -v "$prog" >/dev/null || { echo "slurm-up: $prog not found; apt-get install -y --no-install-recommends slurmctld slurmd slurm-client munge" >&2; exit 1; }
done
[ "$(id -u)" = 0 ] || { echo "slurm-up: needs root (slurmd starts tasks as their user)" >&2; exit 1; }

if [ -e "$RUN" ]; then
  if [ -f "$RUN/slurm.env" ] && alive && node_ready; then
    el "reusing the cluster already running from $RUN"
    cat "$RUN/slurm.env"
    exit 0
  fi
  if alive; then
    die "$RUN has live daemons but the node does not answer; run tools/slurm-down.sh"
  fi
  el "removing $RUN left by a stopped cluster"
  rm -rf "$RUN"
fi
mkdir -p "$RUN"/{munge,state,spool,log,pid}
chmod 700 "$RUN/munge"
chmod 755 "$RUN" # munged wants its socket's directory reachable by everyone
head -c 1024 /dev/urandom >"$RUN/munge/munge.key"
chmod 400 "$RUN/munge/munge.key"

cat >"$RUN/slurm.conf" <<EOF
# Written by tools/slurm-up.sh: one node on 127.0.0.1, no accounting, no cgroups; RPCs wait up
# to 60 s (not 10) so that a loaded 2-core machine does not fail a task launch.
ClusterName=fastload
SlurmctldHost=$NODE(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
AuthType=auth/munge
AuthInfo=socket=$RUN/munge/munge.sock
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$RUN/state
SlurmdSpoolDir=$RUN/spool
SlurmctldPidFile=$RUN/pid/slurmctld
SlurmdPidFile=$RUN/pid/slurmd
SlurmctldLogFile=$RUN/log/slurmctld.log
SlurmdLogFile=$RUN/log/slurmd.log
ProctrackType=proctrack/pgid
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/builtin
ReturnToService=2
MessageTimeout=60
SlurmdParameters=config_overrides
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=1000 State=UNKNOWN
PartitionName=debug Nodes=$NODE Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
EOF

el "starting munged"
munged --force --socket="$RUN/munge/munge.sock" --key-file="$RUN/munge/munge.key" \
  --log-file="$RUN/log/munged.log" --pid-file="$RUN/pid/munged" --seed-file="$RUN/munge/seed" \
  || die "munged did not start"
wait_for 10 "munged's socket" test -S "$RUN/munge/munge.sock"

el "starting slurmctld (port $CTLD_PORT)"
slurmctld -f "$RUN/slurm.conf" || die "slurmctld did not start"
wait_for 30 "slurmctld" env SLURM_CONF="$RUN/slurm.conf" sinfo -h
el "starting slurmd on node $NODE (port $SLURMD_PORT)"
slurmd -f "$RUN/slurm.conf" || die "slurmd did not start"
wait_for 60 "node $NODE to be idle" node_ready

echo "export SLURM_CONF=$RUN/slurm.conf" >"$RUN/slurm.env"
el "up: $(SLURM_CONF="$RUN/slurm.conf" sinfo -h -o '%P %a %D %T %c CPUs')"
cat "$RUN/slurm.env"
