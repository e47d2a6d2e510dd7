#!/usr/bin/env bash
# Sharded training on one machine: NPROC ranks (default: one per GPU, else 2) of
# `shardtrain train`. Extra arguments go to `shardtrain train`.
#
#   launch/mpirun-single-node.sh configs/llama-125m.yaml --set dist.sharding=full_shard
#   NPROC=4 launch/mpirun-single-node.sh configs/tiny.yaml --set train.device=cpu
#
# Each rank takes the GPU of its local rank; on CPUs each rank gets cores / NPROC threads.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
config="${1:?usage: $0 CONFIG.yaml [shardtrain train flags...]}"
shift
if [[ "$config" == --config ]]; then  # the train command's own spelling
  config="${1:?usage: $0 CONFIG.yaml [shardtrain train flags...]}"
  shift
fi
binary="${SHARDTRAIN_BIN:-$root/build/bin/shardtrain}"
if [[ ! -x "$binary" ]]; then
  echo "error: no shardtrain binary at $binary: build it first (launch/quickstart.sh or" \
    "cmake --build build), or set SHARDTRAIN_BIN" >&2
  exit 1
fi

gpus=0
if command -v nvidia-smi >/dev/null 2>&1; then
  gpus="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)"
fi
nproc_default=$(( gpus > 0 ? gpus : 2 ))
ranks="${NPROC:-$nproc_default}"
if [[ ! "$ranks" =~ ^[1-9][0-9]*$ ]]; then
  echo "error: NPROC must be a positive number of ranks, got '$ranks'" >&2
  exit 1
fi
threads="${OMP_NUM_THREADS:-$(( $(nproc) / ranks > 0 ? $(nproc) / ranks : 1 ))}"

# Containers often run as root, which mpirun refuses unless told otherwise.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

exec mpirun -np "$ranks" --bind-to none --oversubscribe \
  -x OMP_NUM_THREADS="$threads" -x OPENBLAS_NUM_THREADS=1 \
  ${NCCL_DEBUG:+-x NCCL_DEBUG} \
  "$binary" train --config "$config" "$@"
