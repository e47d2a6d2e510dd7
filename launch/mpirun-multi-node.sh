#!/usr/bin/env bash
# Sharded training over several machines with Open MPI and a hostfile. Run it on one of the
# nodes; every node needs the same build at the same path and passwordless ssh between nodes.
#
#   HOSTFILE=hosts RANKS_PER_NODE=8 launch/mpirun-multi-node.sh configs/llama-1b.yaml \
#       --set dist.sharding=hybrid_shard
#
# The hostfile has one line per node: "node01 slots=8". Variables:
#   HOSTFILE         the hostfile (required)
#   RANKS_PER_NODE   ranks per node, normally the GPUs per node (default 8)
#   IFACE            network interface for MPI and NCCL traffic between nodes (default eth0)
# Extra arguments go to `shardtrain train`.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
config="${1:?usage: HOSTFILE=hosts $0 CONFIG.yaml [shardtrain train flags...]}"
shift
hostfile="${HOSTFILE:?set HOSTFILE to a hostfile with one 'host slots=N' line per node}"
per_node="${RANKS_PER_NODE:-8}"
iface="${IFACE:-eth0}"
nodes="$(grep -cv '^\s*\(#\|$\)' "$hostfile")"
binary="${SHARDTRAIN_BIN:-$root/build/bin/shardtrain}"

export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

exec mpirun -np $(( nodes * per_node )) --hostfile "$hostfile" --map-by "ppr:${per_node}:node" \
  --bind-to none \
  --mca btl_tcp_if_include "$iface" --mca oob_tcp_if_include "$iface" \
  -x NCCL_SOCKET_IFNAME="$iface" -x OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}" \
  -x OPENBLAS_NUM_THREADS=1 -x LD_LIBRARY_PATH -x PATH \
  ${NCCL_DEBUG:+-x NCCL_DEBUG} ${NCCL_IB_HCA:+-x NCCL_IB_HCA} ${NCCL_IB_DISABLE:+-x NCCL_IB_DISABLE} \
  "$binary" train --config "$config" "$@"
