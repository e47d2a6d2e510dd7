#!/usr/bin/env bash
# Packs shardtrain for a GPU machine that has the NVIDIA driver and CUDA runtime but none of the
# Debian libraries it was built against.
#
#   launch/bundle.sh [BUILD_DIR]
#
# Without BUILD_DIR it configures and builds build-bundle/ (Release, CUDA on, device code for
# the architectures in $BUNDLE_CUDA_ARCHS, default 90 = H100/H200, compressed for size). With
# BUILD_DIR it takes what is already built there. Either way it writes bundle/ (git-ignored):
#
#   bundle/bin/        shardtrain and shardtrain-kernel-bench (stripped)
#   bundle/tests/      the GoogleTest executables unit_* and cuda_* (stripped); the MPI tests
#                      are left out: they need an Open MPI runtime that GPU images lack
#   bundle/lib/        every shared library those need except the system core (libc, libm,
#                      libpthread, libdl, librt, ld-linux) and what the CUDA install and driver
#                      provide (libcuda, libcudart, libcublas*, libnccl)
#   bundle/configs/    configs/
#   bundle/data/       tests/data/
#   bundle/env.sh      source it: sets LD_LIBRARY_PATH (and expands compressed files once)
#   bundle/run-tests.sh  runs every test executable and prints a summary; exit 1 on failure
#
# On the GPU machine:
#   source bundle/env.sh
#   bundle/run-tests.sh                  # or: bundle/run-tests.sh cuda_   (name filter)
#   bundle/bin/shardtrain-kernel-bench --json bench.json
#
# The bundle must stay under 60 MiB (what a device session may carry). When the plain copy is
# larger, files over 1 MiB are stored xz-compressed (NAME.xz) and env.sh expands them in place
# the first time it is sourced.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="$root/bundle"
limit=$((60 * 1024 * 1024))

if (($# > 1)); then
  echo "usage: launch/bundle.sh [BUILD_DIR]" >&2
  exit 2
fi

if (($# == 1)); then
  build="$(cd "$1" && pwd)"
  [[ -f "$build/CMakeCache.txt" ]] || { echo "bundle: $build is not a CMake build directory" >&2; exit 2; }
else
  build="$root/build-bundle"
  cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DSHARDTRAIN_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES="${BUNDLE_CUDA_ARCHS:-90}" \
    -DCMAKE_CUDA_FLAGS="--compress-mode=size"
  cmake --build "$build" -j "$(nproc)"
fi

# ---- collect executables -----------------------------------------------------------------
executables=()
[[ -x "$build/bin/shardtrain" ]] || { echo "bundle: $build/bin/shardtrain is not built" >&2; exit 1; }
executables+=("$build/bin/shardtrain")
if [[ -x "$build/bin/shardtrain-kernel-bench" ]]; then
  executables+=("$build/bin/shardtrain-kernel-bench")
else
  echo "bundle: no shardtrain-kernel-bench in $build/bin (a build without CUDA?)" >&2
fi
tests=()
while IFS= read -r t; do tests+=("$t"); done < <(
  find "$build/tests" -maxdepth 1 -type f -perm -u+x \( -name 'unit_*' -o -name 'cuda_*' \) | sort)
((${#tests[@]} > 0)) || echo "bundle: no test executables in $build/tests" >&2

rm -rf "$out"
mkdir -p "$out/bin" "$out/tests" "$out/lib"
for e in "${executables[@]}"; do strip --strip-unneeded -o "$out/bin/$(basename "$e")" "$e"; done
for t in "${tests[@]}"; do strip --strip-unneeded -o "$out/tests/$(basename "$t")" "$t"; done

# ---- shared libraries ----------------------------------------------------------------------
skip_library() {
  case "$(basename "$1")" in
    libc.so* | libm.so* | libpthread.so* | libdl.so* | librt.so* | ld-linux*.so* | \
      libcuda.so* | libcudart.so* | libcublas*.so* | libnccl*.so* | libnvidia*.so* | \
      linux-vdso.so*) return 0 ;;
  esac
  return 1
}
declare -A copied=()
for e in "${executables[@]}" "${tests[@]}"; do
  while read -r name path; do
    [[ -n "$path" && -f "$path" ]] || continue
    skip_library "$name" && continue
    [[ -n "${copied[$name]:-}" ]] && continue
    copied[$name]=1
    cp -L "$path" "$out/lib/$name"
    strip --strip-unneeded "$out/lib/$name" 2>/dev/null || true
  done < <(ldd "$e" | awk '$2 == "=>" { print $1, $3 }')
done

cp -r "$root/configs" "$out/configs"
cp -r "$root/tests/data" "$out/data"

# Where the tests look for their data and the CLI binary (compiled-in absolute paths).
source_dir="$(sed -n 's/^CMAKE_HOME_DIRECTORY:INTERNAL=//p' "$build/CMakeCache.txt")"

# ---- size: compress the largest files when the plain copy is over the limit -----------------
size_of() { du -sb "$1" | cut -f1; }
compressed=0
if (($(size_of "$out") > limit)); then
  compressed=1
  while IFS= read -r f; do
    xz -9 -T0 "$f"
  done < <(find "$out/bin" "$out/tests" "$out/lib" -type f -size +1M)
fi
size=$(size_of "$out")

# ---- env.sh ----------------------------------------------------------------------------------
cat >"$out/env.sh" <<'ENV'
# Source this file: puts the bundled libraries on LD_LIBRARY_PATH and, on first use, expands
# files that were stored compressed.
bundle_dir="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
for packed in "$bundle_dir"/bin/*.xz "$bundle_dir"/tests/*.xz "$bundle_dir"/lib/*.xz; do
  [ -e "$packed" ] || continue
  if command -v xz >/dev/null 2>&1; then
    xz -d -f "$packed"
  else
    python3 -c 'import lzma, os, sys; p = sys.argv[1]; open(p[:-3], "wb").write(lzma.open(p).read()); os.remove(p)' "$packed"
  fi
  case "$packed" in */lib/*) ;; *) chmod +x "${packed%.xz}" ;; esac
done
export LD_LIBRARY_PATH="$bundle_dir/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PATH="$bundle_dir/bin:$PATH"
ENV

# ---- run-tests.sh ----------------------------------------------------------------------------
cat >"$out/run-tests.sh" <<RUN
#!/usr/bin/env bash
# Runs the bundled test executables (all, or those whose name contains \$1) and prints one line
# per executable and a summary. Exit status 1 when any failed.
set -uo pipefail
bundle_dir="\$(cd "\$(dirname "\${BASH_SOURCE[0]}")" && pwd)"
source "\$bundle_dir/env.sh"
# The tests were compiled with absolute paths to their data and to the CLI binary on the build
# machine; point those paths at the bundle when they do not exist here.
link_if_missing() {
  [ -e "\$1" ] && return 0
  mkdir -p "\$(dirname "\$1")" 2>/dev/null && ln -s "\$2" "\$1" 2>/dev/null ||
    echo "run-tests: cannot create \$1 (tests that read it will fail)" >&2
}
link_if_missing "$source_dir/tests/data" "\$bundle_dir/data"
link_if_missing "$build/bin/shardtrain" "\$bundle_dir/bin/shardtrain"
export OMP_NUM_THREADS="\${OMP_NUM_THREADS:-4}" OPENBLAS_NUM_THREADS=1
filter="\${1:-}"
passed=0; failed=0; failed_names=()
logs="\$(mktemp -d)"
for t in "\$bundle_dir"/tests/*; do
  name="\$(basename "\$t")"
  [[ -z "\$filter" || "\$name" == *"\$filter"* ]] || continue
  start=\$(date +%s)
  if "\$t" >"\$logs/\$name.log" 2>&1; then
    status=ok; passed=\$((passed + 1))
  else
    status=FAILED; failed=\$((failed + 1)); failed_names+=("\$name")
  fi
  skipped=\$(grep -c '^\[  SKIPPED \] .* ([0-9]* ms)$' "\$logs/\$name.log" || true)
  summary=\$(grep -E '^\[==========\] [0-9]+ tests? from' "\$logs/\$name.log" | tail -n 1)
  printf '%-28s %-7s %4ss  %s%s\n' "\$name" "\$status" "\$((\$(date +%s) - start))" \\
    "\${summary#\[==========\] }" "\$( ((skipped > 0)) && echo ", \$skipped skipped")"
  if [[ \$status == FAILED ]]; then
    grep -E '^\[  FAILED  \]|Failure|error' "\$logs/\$name.log" | head -n 20 | sed 's/^/    /'
  fi
done
echo
echo "run-tests: \$passed passed, \$failed failed (logs in \$logs)"
((failed == 0)) || { printf '  failed: %s\n' "\${failed_names[@]}"; exit 1; }
RUN
chmod +x "$out/run-tests.sh"

size=$(size_of "$out")
echo "bundle: $out ($((size / 1024 / 1024)) MiB; ${#tests[@]} test executables, ${#copied[@]} libraries$(
  ((compressed)) && echo ", large files xz-compressed"))"
if ((size > limit)); then
  echo "bundle: larger than $((limit / 1024 / 1024)) MiB; build with fewer CUDA architectures" \
    "(BUNDLE_CUDA_ARCHS) or fewer tests" >&2
  exit 1
fi
