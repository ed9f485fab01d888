#!/usr/bin/env bash
# Stops the one-node Slurm cluster scripts/slurm-up.sh started (same BURN_ACCELERATE_SLURM_DIR),
# by the pid files it left: slurmd, slurmctld, and munged where slurm-up.sh started it.
set -uo pipefail
dir="${BURN_ACCELERATE_SLURM_DIR:-/tmp/burn-accelerate-slurm}"

pidfiles=("$dir/slurmd.pid" "$dir/slurmctld.pid")
[ -s "$dir/munged.pidfile" ] && pidfiles+=("$(cat "$dir/munged.pidfile")")
pids=()
for file in "${pidfiles[@]}"; do
  [ -s "$file" ] || continue
  pid="$(cat "$file")"
  kill "$pid" 2>/dev/null && pids+=("$pid")
  rm -f "$file"
done
rm -f "$dir/munged.pidfile"
# Each is given 10 s to end after SIGTERM (all at once), then killed.
for _ in $(seq 100); do
  alive=()
  for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive+=("$pid"); done
  [ ${#alive[@]} -eq 0 ] && exit 0
  sleep 0.1
done
kill -KILL "${alive[@]}" 2>/dev/null
exit 0
