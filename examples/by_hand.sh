#!/usr/bin/env bash
# peerwatch with ranks started by hand: a shell loop, no launcher.
#
# How to run (CPU, gloo; the training script is examples/torchrun_ddp.py):
#
#   examples/by_hand.sh                          # 4 ranks; rank 2 is SIGKILLed at step 20
#   FAIL_RANK=-1 examples/by_hand.sh             # nobody fails: every rank exits 0
#   FAIL_HOW=raise WORLD=3 FAIL_RANK=0 examples/by_hand.sh
#   PYTHON=.venv/bin/python examples/by_hand.sh  # which python (default: python)
#
# The ranks agree on a run directory with no configuration: they share MASTER_ADDR,
# MASTER_PORT and their parent (this shell), so each picks
# master-<addr>-<port>-<shell pid>.<start>. Export PEERWATCH_DIR to choose it yourself.
#
# What you will see when a rank fails: the other ranks, blocked in all_reduce waiting for
# it, each log one line naming it and are gone within milliseconds (without peerwatch
# they would wait for gloo, or for NCCL's 10-30 minute timeout); the report follows, and
# this script prints every rank's exit code. A SIGKILLed rank's cause is known only to
# its parent, this shell, not to its peers: they exit with peerwatch's documented code
# for that case, 1 (PEERWATCH_EXIT_CODE); a rank that raises or calls sys.exit(3) gives
# its own code (1, 3) to all of them.
set -u
cd "$(dirname "$0")/.."
WORLD=${WORLD:-4}
PYTHON=${PYTHON:-python}
export MASTER_ADDR=127.0.0.1
export MASTER_PORT=${MASTER_PORT:-$(( 20000 + RANDOM % 20000 ))}
export WORLD_SIZE=$WORLD
export FAIL_RANK=${FAIL_RANK:-2} FAIL_STEP=${FAIL_STEP:-20} FAIL_HOW=${FAIL_HOW:-kill}

pids=()
for ((rank = 0; rank < WORLD; rank++)); do
  RANK=$rank LOCAL_RANK=$rank "$PYTHON" examples/torchrun_ddp.py &
  pids+=($!)
done

status=0
for rank in "${!pids[@]}"; do
  wait "${pids[$rank]}"
  code=$?
  echo "by_hand.sh: rank $rank exited with code $code"
  if [ "$code" -ne 0 ] && [ "$status" -eq 0 ]; then status=$code; fi
done
exit "$status"
