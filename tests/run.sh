#!/usr/bin/env bash
# Installs the dependencies, builds shardtrain (Release, CUDA when nvcc is found) in build/ and
# runs the whole test suite. Exits non-zero when anything fails.
#
# MPI tests start several ranks each, so they run one at a time after the others.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

bash launch/install-deps.sh

# Open MPI refuses to run as root (CI containers) without these.
export OMPI_ALLOW_RUN_AS_ROOT=1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

cores="$(nproc)"
# Tests run in parallel, so each keeps to one thread (tests/CMakeLists.txt also sets
# this per test); more would only oversubscribe the cores.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
export OMP_WAIT_POLICY=passive
export OPENBLAS_NUM_THREADS="${OPENBLAS_NUM_THREADS:-1}"
parallel_tests=$((cores / 2 > 2 ? cores / 2 : 2))

cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release
cmake --build build -j "$cores"
# Without nvcc the CUDA backend, its kernels and their tests on the emulated GPU are not built:
# a passing run then covers the CPU build only, which must be said.
if ! grep -q '^SHARDTRAIN_BUILT_WITH_CUDA:INTERNAL=ON$' build/CMakeCache.txt; then
  echo "warning: nvcc was not found (CUDA Toolkit at /usr/local/cuda, or CUDACXX): the CUDA" \
    "backend and its tests on the emulated GPU are not built; these results cover the CPU" \
    "build only" >&2
fi

cd build
failed=()
run_phase() {  # name, then ctest arguments
  local name="$1"
  shift
  echo "== $name =="
  rm -f Testing/Temporary/LastTestsFailed.log  # a list left by an earlier ctest is not this one's
  if ! ctest --output-on-failure --timeout 900 "$@"; then
    failed+=("$(cat Testing/Temporary/LastTestsFailed.log 2>/dev/null || echo "$name")")
  fi
}
run_phase "unit and cuda tests, $parallel_tests at a time" --no-tests=error -LE "mpi|slow" \
  -j "$parallel_tests"
# MPI tests start several ranks each, so they run one at a time.
run_phase "MPI tests, one at a time" --no-tests=ignore -L mpi
# Whole training runs: one at a time, with every core.
OMP_NUM_THREADS="$cores" OPENBLAS_NUM_THREADS="$cores" run_phase "slow tests, one at a time" --no-tests=ignore -L slow -LE mpi

if ((${#failed[@]})); then
  echo "FAILED tests:"
  printf '%s\n' "${failed[@]}"
  exit 1
fi
echo "all tests passed"
