#!/usr/bin/env bash
# Starts a one-node Slurm cluster on this machine, as root and without systemd (a container, a
# CI runner): Debian's slurm-wlm (its PMIx plugin is in slurm-wlm-basic-plugins) and munge,
# installed when missing; then munged, slurmctld and slurmd. The node advertises more CPUs
# than the machine has (SlurmdParameters=config_overrides) and its partition oversubscribes
# them, so that jobs of several tasks, and a step inside a larger job, run on a 2-core machine.
#
#   scripts/slurm-up.sh                 # prints the SLURM_CONF to export
#   export SLURM_CONF=/tmp/burn-accelerate-slurm/slurm.conf
#   srun -n 2 --mpi=pmix hostname
#   scripts/slurm-down.sh               # stops what this script started, by its pid files
#
# Everything it writes (slurm.conf, the daemons' state, logs and pid files) is under
# BURN_ACCELERATE_SLURM_DIR (default /tmp/burn-accelerate-slurm); /etc/slurm is left alone, so
# the commands need SLURM_CONF. A munged already running is used and left running.
set -euo pipefail
dir="${BURN_ACCELERATE_SLURM_DIR:-/tmp/burn-accelerate-slurm}"
# More than any test asks for (a job of 4 tasks), whatever the machine has.
cpus="${BURN_ACCELERATE_SLURM_CPUS:-8}"

if [ "$(id -u)" != 0 ]; then
  echo "scripts/slurm-up.sh: run it as root (it starts slurmd, which starts jobs as their users)" >&2
  exit 1
fi
# slurm-wlm-basic-plugins has the PMIx plugin (srun --mpi=pmix), which loads libpmix2.
packages=(slurm-wlm slurm-wlm-basic-plugins munge libpmix2)
if ! dpkg -s "${packages[@]}" >/dev/null 2>&1; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${packages[@]}" >/dev/null
fi

if [ -s "$dir/slurmctld.pid" ] && kill -0 "$(cat "$dir/slurmctld.pid")" 2>/dev/null; then
  echo "Slurm already runs from $dir (scripts/slurm-down.sh stops it): export SLURM_CONF=$dir/slurm.conf"
  exit 0
fi
mkdir -p "$dir/state" "$dir/spool"

# munge: Slurm's daemons and commands authenticate each other through it.
if ! munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; then
  [ -s /etc/munge/munge.key ] || mungekey --create --keyfile /etc/munge/munge.key
  chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
  install -d -o munge -g munge -m 0755 /run/munge
  runuser -u munge -- munged --pid-file /run/munge/munged.pid
  echo /run/munge/munged.pid >"$dir/munged.pidfile" # slurm-down.sh stops only what this started
  for _ in $(seq 50); do
    munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1 && break
    sleep 0.1
  done
fi

host="$(hostname -s)"
cat >"$dir/slurm.conf" <<EOF
# One node, written by scripts/slurm-up.sh.
ClusterName=burn-accelerate
SlurmctldHost=$host
SlurmUser=root
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
# No cgroups in a container: tasks are tracked by their parent pids, and not bound to CPUs.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
# A task that fails ends its step at once rather than after Slurm's default wait.
KillWait=5
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.log
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
# The node may claim more than the machine has (its CPUs below).
SlurmdParameters=config_overrides
NodeName=$host CPUs=$cpus State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
EOF
export SLURM_CONF="$dir/slurm.conf"

# -c: a fresh cluster, without the jobs of an earlier run.
slurmctld -c -f "$SLURM_CONF"
slurmd -f "$SLURM_CONF"
for _ in $(seq 100); do
  if sinfo -h -n "$host" -o %t 2>/dev/null | grep -qE '^(idle|mix|alloc)'; then
    echo "Slurm is up: export SLURM_CONF=$SLURM_CONF"
    exit 0
  fi
  sleep 0.2
done
echo "scripts/slurm-up.sh: the node did not come up within 20 s; the daemons' logs:" >&2
tail -n 20 "$dir/slurmctld.log" "$dir/slurmd.log" >&2 || true
exit 1
