#!/usr/bin/env bash
# From a fresh checkout to a trained model: installs the Debian packages, builds shardtrain
# (Release) and trains configs/tiny.yaml, on the GPU when there is one, else on the CPU (about
# 3-5 minutes on 2 cores). Extra arguments go to `shardtrain train`, e.g.
#   launch/quickstart.sh --set train.steps=50
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

bash launch/install-deps.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release
cmake --build build -j "$(nproc)" --target shardtrain_bin

device_args=()
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
  echo "quickstart: training on $(nvidia-smi -L | head -n 1)"
else
  echo "quickstart: no GPU found, training on the CPU"
  device_args=(--set train.device=cpu)
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(nproc)}"
fi
exec build/bin/shardtrain train --config configs/tiny.yaml "${device_args[@]}" "$@"
