#!/bin/bash
# opguard exit hook: finish, on every node of the allocation, any final drain that a SIGKILL cut
# short (a wrapper killed by the OOM killer, a node-local crash...), then report what is still
# unpublished. The durable local state (OPGUARD_LOCAL_DUMP_BASE/state) makes this resumable:
# batches already published are not published again, nothing is lost or duplicated.
#
# Use it from the batch script, with the staging environment exported (see slurm/*.sbatch):
#   trap '/path/to/opguard/slurm/exit-hook.sh' EXIT       # runs whenever the batch shell exits
# or as a plain step once srun has returned:
#   srun ... opguard-run ... ; /path/to/opguard/slurm/exit-hook.sh
# It runs  srun -n $SLURM_NNODES --ntasks-per-node=1 opguard sync --all --final  (one per node,
# --overlap so it also starts while another step still holds the CPUs), except on nodes where
# nothing was ever staged (no ranks/, node/ or stream state), so a job that opguard-run refused to
# start leaves the shared target untouched.
#
# Bounded in time: OPGUARD_EXIT_HOOK_TIMEOUT seconds if set, else the job's remaining time
# (squeue %L) minus OPGUARD_EXIT_HOOK_MARGIN (default 15 s) so the hook ends before Slurm's kill.
# After scancel or the time limit Slurm starts no new step: the hook says so and exits 1; then
# run `opguard sync --all --final` on each node with the same environment (e.g. a follow-up job
# with --dependency=afterany:$SLURM_JOB_ID on the same nodes).
# Exit status: 0 when every node drained, 1 otherwise (the EXIT trap does not change the job's).
set -u
say() { echo "opguard exit-hook: $*" >&2; }

[ -n "${SLURM_JOB_ID:-}" ] || { say "error: SLURM_JOB_ID is not set; fix: run it inside a Slurm batch script"; exit 1; }
[ -n "${OPGUARD_LOCAL_DUMP_BASE:-}" ] || { say "error: OPGUARD_LOCAL_DUMP_BASE is not set; fix: export the staging environment before the trap runs"; exit 1; }
command -v opguard >/dev/null || { say "error: opguard is not on PATH; fix: export PATH=\$OPGUARD_VENV/bin:\$PATH"; exit 1; }

to_seconds() {  # Slurm time [D-]HH:MM:SS | MM:SS -> seconds, or nothing for UNLIMITED/INVALID
  local t=$1 d=0 h=0 m=0 s=0
  case "$t" in *-*) d=${t%%-*}; t=${t#*-};; esac
  IFS=: read -r -a p <<< "$t"
  case ${#p[@]} in 3) h=${p[0]}; m=${p[1]}; s=${p[2]};; 2) m=${p[0]}; s=${p[1]};; 1) s=${p[0]};; esac
  case "$d$h$m$s" in *[!0-9]*) return;; esac
  echo $(( 10#$d * 86400 + 10#$h * 3600 + 10#$m * 60 + 10#$s ))
}
read -r STATE LEFT <<< "$(squeue -h -j "$SLURM_JOB_ID" -o '%T %L' 2>/dev/null)"
if [ "${STATE:-}" != RUNNING ]; then
  say "job $SLURM_JOB_ID is ${STATE:-gone} (scancel or time limit): Slurm starts no new step now."
  say "fix: run 'opguard sync --all --final' on each node with this job's environment (e.g. a job with --dependency=afterany:$SLURM_JOB_ID)"
  exit 1
fi
if [ -n "${OPGUARD_EXIT_HOOK_TIMEOUT:-}" ]; then
  T=$OPGUARD_EXIT_HOOK_TIMEOUT
else
  left_s=$(to_seconds "${LEFT:-}")
  T=$(( ${left_s:-3600} - ${OPGUARD_EXIT_HOOK_MARGIN:-15} ))
fi
case "$T" in ''|*[!0-9]*|0) say "error: no time left for a drain (job time left: ${LEFT:-?}); fix: raise --time or the --signal warning"; exit 1;; esac

say "draining on $SLURM_NNODES node(s) of job $SLURM_JOB_ID, at most ${T} s"
# One task per node: final drain, then list what is still waiting for publication on that node
# (pending.json = a complete batch not yet published, docs/format.md section 6).
timeout --kill-after=5 "$T" srun --overlap -n "$SLURM_NNODES" -N "$SLURM_NNODES" --ntasks-per-node=1 \
  --kill-on-bad-exit=0 bash -c '
    node=${OPGUARD_NODE_ID:-${SLURMD_NODENAME:-$(hostname)}}
    b=$OPGUARD_LOCAL_DUMP_BASE
    if [ -z "$(ls -A "$b/ranks" "$b/node" "$b/state/streams" 2>/dev/null)" ]; then
      # nothing was ever staged here (e.g. opguard-run refused to start): do not touch the target
      echo "opguard exit-hook: node=$node nothing staged in $b" >&2; exit 0
    fi
    opguard sync --all --final; rc=$?
    pending=$(ls "$OPGUARD_LOCAL_DUMP_BASE"/state/streams/*/pending.json 2>/dev/null | wc -l)
    echo "opguard exit-hook: node=$node rc=$rc pending_batches=$pending" >&2
    [ "$rc" = 0 ] && [ "$pending" = 0 ]'
rc=$?
if [ $rc = 0 ]; then
  say "every node drained: nothing left unpublished"
elif [ $rc = 124 ] || [ $rc = 137 ]; then
  say "error: the drain did not finish within ${T} s; what is unpublished stays in each node's $OPGUARD_LOCAL_DUMP_BASE; fix: rerun 'opguard sync --all --final' there"
else
  say "error: some node did not drain (see its node=... line above); its data stays in $OPGUARD_LOCAL_DUMP_BASE on that node"
fi
[ $rc = 0 ]
