#!/usr/bin/env bash
# From a fresh checkout to a trained model: installs the Debian packages, builds shardtrain
# (Release) and trains configs/tiny.yaml, on the GPU when there is one, else on the CPU (the
# build about 4 minutes and the training under a minute on 2 cores). Run again, it continues
# the run in runs/tiny. Extra arguments go to `shardtrain train`; a run with other settings
# belongs in its own directory, e.g.
#   launch/quickstart.sh --set train.steps=50 --set train.out_dir=runs/tiny-50
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

bash launch/install-deps.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release
cmake --build build -j "$(nproc)" --target shardtrain_bin

# The GPU is used when there is one and the build has the CUDA backend (nvcc was found):
# a driver without the CUDA Toolkit builds the CPU backend only.
gpu=""
if command -v nvidia-smi >/dev/null 2>&1; then
  gpu="$(nvidia-smi -L 2>/dev/null | grep '^GPU' | head -n 1 || true)"
elif [[ -e /dev/nvidia0 || -n "$(ls -A /proc/driver/nvidia/gpus 2>/dev/null)" ]]; then
  # A container with the driver's device files but without nvidia-smi.
  gpu="an NVIDIA GPU (/dev/nvidia0)"
fi
cuda_build=no
if grep -q '^SHARDTRAIN_BUILT_WITH_CUDA:INTERNAL=ON$' build/CMakeCache.txt 2>/dev/null; then
  cuda_build=yes
fi
device_args=()
if [[ -n "$gpu" && "$cuda_build" == yes ]]; then
  echo "quickstart: training on $gpu"
  device_args=(--set train.device=cuda)
else
  if [[ -n "$gpu" ]]; then
    echo "quickstart: $gpu is present but this build has no CUDA backend (nvcc was not found:" \
      "install the CUDA Toolkit and rebuild); training on the CPU"
  else
    echo "quickstart: no GPU found, training on the CPU"
  fi
  device_args=(--set train.device=cpu)
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(nproc)}"
fi
# Run again, it continues the run in runs/tiny (or says there is nothing left to train): the
# checkpoint directory of an earlier run is never trained over from scratch.
exec build/bin/shardtrain train --config configs/tiny.yaml "${device_args[@]}" \
  --set train.resume=auto "$@"
