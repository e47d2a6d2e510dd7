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

cd build
failed=()
echo "== tests (all but MPI), $parallel_tests at a time =="
if ! ctest --output-on-failure --timeout 600 --no-tests=error -LE mpi -j "$parallel_tests"; then
  failed+=("$(cat Testing/Temporary/LastTestsFailed.log 2>/dev/null || echo 'non-MPI tests')")
fi
echo "== MPI tests, one at a time =="
if ! ctest --output-on-failure --timeout 600 --no-tests=ignore -L mpi; then
  failed+=("$(cat Testing/Temporary/LastTestsFailed.log 2>/dev/null || echo 'MPI tests')")
fi

if ((${#failed[@]})); then
  echo "FAILED tests:"
  printf '%s\n' "${failed[@]}"
  exit 1
fi
echo "all tests passed"
