#!/bin/bash
# Open MPI: one process per GPU (8 GPUs over the hosts in hosts.txt). jax.distributed
# detects Open MPI's environment; mm.distributed.initialize() joins the job.
#
#   scripts/mpirun.sh -m multimesh.examples.train_multiprocess --steps 100
#
set -euo pipefail
NP="${NP:-8}"
exec mpirun -np "$NP" --hostfile "${HOSTFILE:-hosts.txt}" --bind-to none \
  -x MULTIMESH_HEARTBEAT_TIMEOUT="${MULTIMESH_HEARTBEAT_TIMEOUT:-60}" \
  python "$@"
