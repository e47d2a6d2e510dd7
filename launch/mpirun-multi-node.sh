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
#   IFACE            network interface for MPI and NCCL traffic between nodes (default: the one
#                    of this node's default route, e.g. eth0, ens5, ib0)
# Extra arguments go to `shardtrain train`. Every node reads the config file at the same path: give
# an absolute path, or one that is the same relative to this directory on every node.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
config="${1:?usage: HOSTFILE=hosts $0 CONFIG.yaml [shardtrain train flags...]}"
shift
if [[ "$config" == --config ]]; then  # the train command's own spelling
  config="${1:?usage: HOSTFILE=hosts $0 CONFIG.yaml [shardtrain train flags...]}"
  shift
fi
hostfile="${HOSTFILE:?set HOSTFILE to a hostfile with one 'host slots=N' line per node}"
per_node="${RANKS_PER_NODE:-8}"
if [[ ! "$per_node" =~ ^[1-9][0-9]*$ ]]; then
  echo "error: RANKS_PER_NODE must be a positive number, got '$per_node'" >&2
  exit 1
fi
if [[ ! -r "$hostfile" ]]; then
  echo "error: cannot read HOSTFILE '$hostfile'" >&2
  exit 1
fi
nodes="$(grep -cv '^\s*\(#\|$\)' "$hostfile" || true)"
if ((nodes == 0)); then
  echo "error: HOSTFILE '$hostfile' names no node: write one 'host slots=N' line per node" >&2
  exit 1
fi
iface="${IFACE:-}"
if [[ -z "$iface" ]] && command -v ip >/dev/null 2>&1; then
  iface="$(ip -o route show default 2>/dev/null |
    awk '{for (i = 1; i < NF; ++i) if ($i == "dev") print $(i + 1); exit}' || true)"
fi
if [[ -z "$iface" ]]; then
  echo "error: no default network interface found: set IFACE (e.g. eth0, ib0)" >&2
  exit 1
fi
binary="${SHARDTRAIN_BIN:-$root/build/bin/shardtrain}"
if [[ ! -x "$binary" ]]; then
  echo "error: no shardtrain binary at $binary: build it, or set SHARDTRAIN_BIN" >&2
  exit 1
fi

export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

exec mpirun -np $(( nodes * per_node )) --hostfile "$hostfile" --map-by "ppr:${per_node}:node" \
  --bind-to none \
  --mca btl_tcp_if_include "$iface" --mca oob_tcp_if_include "$iface" \
  -x NCCL_SOCKET_IFNAME="$iface" -x OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}" \
  -x OPENBLAS_NUM_THREADS=1 -x LD_LIBRARY_PATH -x PATH \
  ${NCCL_DEBUG:+-x NCCL_DEBUG} ${NCCL_IB_HCA:+-x NCCL_IB_HCA} ${NCCL_IB_DISABLE:+-x NCCL_IB_DISABLE} \
  "$binary" train --config "$config" "$@"
