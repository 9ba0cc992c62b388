#!/usr/bin/env bash
# slurm-down.sh - stop the cluster tools/slurm-up.sh started in $SLURM_RUN (/tmp/fastload-slurm)
# and remove the directory. Only processes whose command line names this run's files are stopped.
set -euo pipefail
RUN=${SLURM_RUN:-/tmp/fastload-slurm}
[ -d "$RUN" ] || exit 0
ours() { { tr '\0' ' ' <"/proc/$1/cmdline"; } 2>/dev/null | grep -q -- "$RUN/"; }
pids=()
for f in "$RUN"/pid/slurmd "$RUN"/pid/slurmctld "$RUN"/pid/munged; do
  [ -f "$f" ] || continue
  pid=$(cat "$f")
  if ours "$pid"; then kill "$pid" 2>/dev/null && pids+=("$pid") || true; fi
done
for pid in "${pids[@]}"; do # wait up to 10 s each, then SIGKILL
  for _ in $(seq 40); do ours "$pid" || break; sleep 0.25; done
  if ours "$pid"; then kill -9 "$pid" 2>/dev/null || true; fi
done
rm -rf "$RUN"
