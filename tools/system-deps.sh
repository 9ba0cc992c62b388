#!/usr/bin/env bash
# Installs the Debian packages the test suite needs (a local Ceph cluster: mon, OSD, radosgw; a C
# compiler and libjpeg-turbo's headers for fastload's native JPEG region decoder, setup.py; Open
# MPI's mpirun and a one-node SLURM cluster (tools/slurm-up.sh) for tests/e2e/test_launchers.py;
# iproute2's `ss`, which cuts DataNode connections in tests/e2e/test_hdfs.py), if they are missing. Needs root or sudo. Idempotent: does nothing when everything is there.
set -euo pipefail
PKGS=(ceph-mon ceph-osd radosgw ceph-common uuid-runtime gcc libc6-dev libjpeg62-turbo-dev
  openmpi-bin slurmctld slurmd slurm-client munge iproute2)
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0
SUDO=""
if [ "$(id -u)" != 0 ]; then
  if command -v sudo >/dev/null 2>&1; then SUDO="sudo"; else
    echo "system-deps: need root to install ${missing[*]} (apt-get); the Ceph, MPI and SLURM tests will be skipped" >&2
    exit 0
  fi
fi
echo "system-deps: installing ${missing[*]}"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
