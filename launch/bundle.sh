#!/usr/bin/env bash
# Packs shardtrain for a GPU machine that has the NVIDIA driver and CUDA runtime but none of the
# Debian libraries it was built against.
#
#   launch/bundle.sh [BUILD_DIR]
#
# Without BUILD_DIR it configures build-bundle/ (Release, CUDA on, device code for the
# architectures in $BUNDLE_CUDA_ARCHS, default 90 = H100/H200, compressed for size); with
# BUILD_DIR it uses that build. Either way it builds (or brings up to date) what it ships there.
# Either way it writes bundle/ (git-ignored):
#
#   bundle/bin/        shardtrain and shardtrain-kernel-bench (stripped)
#   bundle/tests/      the GoogleTest executables unit_* and cuda_* (stripped); left out are the
#                      MPI tests (they need an Open MPI runtime that GPU images lack) and the
#                      emulated-GPU unit_simt_* (CI runs those; cuda_* run the same code for real)
#   bundle/lib/        every shared library those need except the system core (libc, libm,
#                      libpthread, libdl, librt, ld-linux) and what the CUDA install and driver
#                      provide (libcuda, libcudart, libcublas*, libnccl)
#   bundle/configs/    configs/
#   bundle/data/       tests/data/ (the golden case and test data; `shardtrain bench` and the
#                      llama configs use the corpus built into the binary)
#   bundle/bench/      tests/bench/*.py: the PyTorch SDPA reference and the attention comparison
#   bundle/gpu-verify.sh   launch/gpu-verify.sh: every GPU check and measurement, by phase
#   bundle/env.sh      source it: sets LD_LIBRARY_PATH (and expands compressed files once); finds
#                      the CUDA libraries in the CUDA toolkit or in PyTorch's nvidia-* wheels.
#                      Source it where the bundle's programs run (a job script, a subshell): every
#                      program started there loads bundle/lib's copies (libstdc++, libssl, ...)
#   bundle/run-tests.sh  runs every test executable and prints a summary; exit 1 on failure
#   bundle/link-build-paths.sh  makes the build machine's paths the tests were compiled with
#                      (test data, configs, the CLI binary) point into the bundle where missing
#   bundle/VERSION     the commit it was built from (+dirty when the tree had changes), the
#                      date and the CUDA architectures
#
# On the GPU machine:
#   source bundle/env.sh
#   bundle/run-tests.sh                  # or: bundle/run-tests.sh cuda_   (name filter)
#   bundle/bin/shardtrain-kernel-bench --json bench.json
#   launch/gpu-verify.sh tests|kernels|train|qlora|cli|profile|all  # or bundle/gpu-verify.sh; docs/benchmarks.md
#
# The bundle is kept under 60 MiB so that it ships quickly to a fresh node. When the plain copy is
# larger, the test executables are stored as one solid archive (tests.tar.xz) and other files
# over 1 MiB xz-compressed (NAME.xz); env.sh expands them in place the first time it is sourced: a bundle used here is then larger (it says so), and is rebuilt
# with this script before it is carried anywhere with a size limit.
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
fi
# What is shipped must match the sources: bring those targets up to date. With Ninja only them:
# the emulated-GPU tests, which are not shipped, take most of a whole build's time on a small
# machine. Otherwise the whole build.
if [[ -f "$build/build.ninja" ]]; then
  all_targets="$(ninja -C "$build" -t targets all)"
  targets=(shardtrain_bin)
  [[ "$all_targets" == *$'\nshardtrain-kernel-bench:'* ]] && targets+=(shardtrain-kernel-bench)
  while IFS= read -r t; do targets+=("$t"); done < <(
    grep -oE '^tests/(unit|cuda)_[a-z_0-9]+' <<<"$all_targets" | grep -v '^tests/unit_simt_' |
      sort -u)
  cmake --build "$build" -j "$(nproc)" --target "${targets[@]}"
else
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
# The unit_simt_* tests run the CUDA code on an emulated GPU, which is what CI is for; on a GPU
# node the cuda_* tests run it for real (and some emulated runs take minutes).
tests=()
while IFS= read -r t; do tests+=("$t"); done < <(
  find "$build/tests" -maxdepth 1 -type f -perm -u+x \( -name 'unit_*' -o -name 'cuda_*' \) \
    ! -name 'unit_simt_*' | sort)
((${#tests[@]} > 0)) || echo "bundle: no test executables in $build/tests" >&2

rm -rf "$out"
mkdir -p "$out/bin" "$out/tests" "$out/lib"
for e in "${executables[@]}"; do strip --strip-unneeded -o "$out/bin/$(basename "$e")" "$e"; done
for t in "${tests[@]}"; do strip --strip-unneeded -o "$out/tests/$(basename "$t")" "$t"; done

# ---- shared libraries ----------------------------------------------------------------------
skip_library() {
  case "$(basename "$1")" in
    libc.so* | libm.so* | libpthread.so* | libdl.so* | librt.so* | ld-linux*.so* | \
      libresolv.so* | libnsl.so* | libutil.so* | libanl.so* | \
      libcuda.so* | libcudart.so* | libcublas*.so* | libnccl*.so* | libnvidia*.so* | \
      linux-vdso.so*) return 0 ;;
  esac
  return 1
}
declare -A copied=() provided=()
for e in "${executables[@]}" "${tests[@]}"; do
  # A library the loader cannot find here would be missing there too.
  deps="$(ldd "$e")"
  missing="$(awk '/=> not found/ { print $1 }' <<<"$deps" | sort -u | tr '\n' ' ')"
  if [[ -n "$missing" ]]; then
    echo "bundle: $(basename "$e") needs libraries that are not found here: $missing" >&2
    exit 1
  fi
  while read -r name path; do
    [[ -n "$path" && -f "$path" ]] || continue
    if skip_library "$name"; then
      # What the GPU machine's CUDA install must provide (env.sh looks for these).
      case "$name" in libcudart.so* | libcublas*.so* | libnccl*.so*) provided[$name]=1 ;; esac
      continue
    fi
    [[ -n "${copied[$name]:-}" ]] && continue
    copied[$name]=1
    cp -L "$path" "$out/lib/$name"
    strip --strip-unneeded "$out/lib/$name" 2>/dev/null || true
  done < <(awk '$2 == "=>" { print $1, $3 }' <<<"$deps")
done

cp -r "$root/configs" "$out/configs"
cp -r "$root/tests/data" "$out/data"
mkdir -p "$out/bench"
cp "$root"/tests/bench/*.py "$out/bench/"
cp "$root/launch/gpu-verify.sh" "$out/gpu-verify.sh"

# The C library is the target's own (never bundled): the newest glibc symbol version any bundled
# file needs is the oldest glibc it runs on. env.sh compares it with the node's.
glibc_needed="$(find "$out/bin" "$out/tests" "$out/lib" -type f -exec objdump -T {} + 2>/dev/null |
  grep -o 'GLIBC_[0-9][0-9.]*' | sed 's/GLIBC_//' | sort -V | tail -n 1 || true)"
{
  echo "glibc needed: ${glibc_needed:-unknown}"
  echo "commit: $(git -C "$root" describe --always --dirty 2>/dev/null || echo unknown)"
  echo "built: $(date -u +%Y-%m-%dT%H:%M:%SZ) from $build"
  echo "cuda architectures: $(sed -n 's/^CMAKE_CUDA_ARCHITECTURES:[A-Z]*=//p' "$build/CMakeCache.txt")"
} >"$out/VERSION"

# Where the tests look for their data and the CLI binary (compiled-in absolute paths).
source_dir="$(sed -n 's/^CMAKE_HOME_DIRECTORY:INTERNAL=//p' "$build/CMakeCache.txt")"

# ---- size: compress the largest files when the plain copy is over the limit -----------------
size_of() { du -sb "$1" | cut -f1; }
compressed=0
if (($(size_of "$out") > limit)); then
  compressed=1
  # The test executables share most of their bytes (each links the same static libraries and
  # device code): one solid archive stores those once, where per-file compression stores them
  # in every file. Single-threaded, so that xz does not cut the stream into independent blocks.
  if [[ -d "$out/tests" ]] && [[ -n "$(ls -A "$out/tests")" ]]; then
    tar -C "$out" -cf - tests | xz -9 -T1 >"$out/tests.tar.xz"
    rm -rf "$out/tests"
  fi
  while IFS= read -r f; do
    xz -9 -T0 "$f"
  done < <(find "$out/bin" "$out/lib" -type f -size +1M)
fi
size=$(size_of "$out")

# ---- env.sh ----------------------------------------------------------------------------------
cat >"$out/env.sh" <<ENV
# Source this file: puts the bundled libraries on LD_LIBRARY_PATH and, on first use, expands
# files that were stored compressed.
bundle_glibc_needed="${glibc_needed:-}"
ENV
cat >>"$out/env.sh" <<'ENV'
bundle_dir="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# The bundled libraries (libstdc++ above all) were built against the build machine's glibc: an
# older one on this node makes every program fail to start with "version GLIBC_x not found".
bundle_glibc_here="$(getconf GNU_LIBC_VERSION 2>/dev/null | awk '{ print $2 }')"
if [ -n "$bundle_glibc_needed" ] && [ -n "$bundle_glibc_here" ] &&
  [ "$(printf '%s\n%s\n' "$bundle_glibc_needed" "$bundle_glibc_here" | sort -V | head -n 1)" != \
    "$bundle_glibc_needed" ]; then
  echo "bundle/env.sh: this bundle needs glibc $bundle_glibc_needed or newer and this node has" \
    "$bundle_glibc_here: its programs will not start here; build the bundle on a machine with" \
    "glibc $bundle_glibc_here or older (a container of this node's distribution)" >&2
fi
unset bundle_glibc_needed bundle_glibc_here
# Expanded once, by one process: others that source this at the same moment (the tasks of one
# job on a shared file system) wait on the lock, then find nothing left to expand. A file is
# written under a temporary name and renamed into place, never loaded half-written.
bundle_expand() {
  local packed target bundle_expanded=0
  if [ -e "$bundle_dir/tests.tar.xz" ]; then
    bundle_expanded=1
    if command -v xz >/dev/null 2>&1; then
      xz -dc "$bundle_dir/tests.tar.xz" | tar -C "$bundle_dir" -xf -
    else
      python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1], "r:xz").extractall(sys.argv[2])' \
        "$bundle_dir/tests.tar.xz" "$bundle_dir"
    fi && rm -f "$bundle_dir/tests.tar.xz" || return 1
  fi
  for packed in "$bundle_dir"/bin/*.xz "$bundle_dir"/lib/*.xz; do
    [ -e "$packed" ] || continue
    bundle_expanded=1
    target="${packed%.xz}"
    if command -v xz >/dev/null 2>&1; then
      xz -dc "$packed" >"$target.expanding" || return 1
    else
      python3 -c 'import lzma, sys; open(sys.argv[2], "wb").write(lzma.open(sys.argv[1]).read())' \
        "$packed" "$target.expanding" || return 1
    fi
    case "$packed" in */lib/*) ;; *) chmod +x "$target.expanding" ;; esac
    mv -f "$target.expanding" "$target" && rm -f "$packed" || return 1
  done
  if [ "$bundle_expanded" = 1 ]; then
    echo "bundle/env.sh: expanded the compressed files in place ($(du -sh "$bundle_dir" | cut -f1));" \
      "run launch/bundle.sh again before copying the bundle where a size limit applies" >&2
  fi
}
if [ -e "$bundle_dir/tests.tar.xz" ] || [ -n "$(find "$bundle_dir/bin" "$bundle_dir/lib" -name '*.xz' -print -quit 2>/dev/null)" ]; then
  if ! (
    if command -v flock >/dev/null 2>&1; then flock 9; fi
    bundle_expand
  ) 9>"$bundle_dir/.expand.lock"; then
    echo "bundle/env.sh: could not expand the bundle's compressed files in $bundle_dir (is it" \
      "read-only, or are xz and python3 both missing?): copy the bundle somewhere writable" >&2
  fi
fi
unset -f bundle_expand
export LD_LIBRARY_PATH="$bundle_dir/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PATH="$bundle_dir/bin:$PATH"
ENV
# The CUDA libraries are not bundled (hundreds of MiB). The binaries look for them where the
# build machine had them; elsewhere env.sh adds the CUDA toolkit's directories, then PyTorch's
# nvidia-* wheel directories, for each one the loader cannot find.
cat >>"$out/env.sh" <<ENV
bundle_cuda_libs="${!provided[*]}"
ENV
cat >>"$out/env.sh" <<'ENV'
bundle_lib_found() {
  local d
  for d in ${LD_LIBRARY_PATH//:/ }; do [ -e "$d/$1" ] && return 0; done
  # Not grep -q: it would stop reading early, and under pipefail ldconfig's SIGPIPE fails the test.
  ldconfig -p 2>/dev/null | grep "[[:space:]]$1 " >/dev/null && return 0
  return 1
}
bundle_python_lib_dirs() {
  command -v python3 >/dev/null 2>&1 || return 0
  python3 -c 'import glob, os, site, sysconfig
roots = [sysconfig.get_paths()["purelib"]] + list(getattr(site, "getsitepackages", list)())
for d in sorted({d for r in roots for d in glob.glob(os.path.join(r, "nvidia", "*", "lib"))}):
    print(d)' 2>/dev/null
}
for lib in $bundle_cuda_libs; do
  bundle_lib_found "$lib" && continue
  for d in /usr/local/cuda/lib64 /usr/local/cuda/lib /usr/local/cuda/targets/x86_64-linux/lib \
    $(bundle_python_lib_dirs); do
    if [ -e "$d/$lib" ]; then
      export LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$d"
      break
    fi
  done
  bundle_lib_found "$lib" ||
    echo "bundle/env.sh: $lib not found in the CUDA toolkit or PyTorch's nvidia-* wheels;" \
      "the bundled programs need it" >&2
done
unset -f bundle_lib_found bundle_python_lib_dirs
unset lib d bundle_cuda_libs
ENV

# ---- link-build-paths.sh -------------------------------------------------------------------
cat >"$out/link-build-paths.sh" <<LINKS
#!/usr/bin/env bash
# The tests were compiled with absolute paths to their data, the configs and the CLI binary on
# the build machine; where those do not exist here, links into the bundle take their place.
bundle_dir="\$(cd "\$(dirname "\${BASH_SOURCE[0]}")" && pwd)"
link_if_missing() {
  [ -e "\$1" ] && return 0
  mkdir -p "\$(dirname "\$1")" 2>/dev/null && ln -sfn "\$2" "\$1" 2>/dev/null ||
    echo "link-build-paths: cannot create \$1 (tests that read it will fail)" >&2
}
link_if_missing "$source_dir/tests/data" "\$bundle_dir/data"
link_if_missing "$source_dir/configs" "\$bundle_dir/configs"
link_if_missing "$build/bin/shardtrain" "\$bundle_dir/bin/shardtrain"
LINKS
chmod +x "$out/link-build-paths.sh"

# ---- run-tests.sh ----------------------------------------------------------------------------
cat >"$out/run-tests.sh" <<RUN
#!/usr/bin/env bash
# Runs the bundled test executables (all, or those whose name contains \$1) and prints one line
# per executable and a summary. Exit status 1 when any failed.
set -uo pipefail
bundle_dir="\$(cd "\$(dirname "\${BASH_SOURCE[0]}")" && pwd)"
# One process, no launcher: a launcher's variables (srun, a login environment) would make the
# programs start MPI, whose components the bundle does not carry.
launcher_vars="\$(compgen -e | grep -E '^(OMPI_COMM_WORLD_|PMI_|PMIX_|SLURM_)' || true)"
if [[ -n "\$launcher_vars" ]]; then
  echo "run-tests: unsetting launcher variables: \$(echo \$launcher_vars)" >&2
  unset \$launcher_vars
fi
source "\$bundle_dir/env.sh"
"\$bundle_dir/link-build-paths.sh"
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
  ((compressed)) && echo ", tests and large files xz-compressed"))"
if ((size > limit)); then
  echo "bundle: larger than $((limit / 1024 / 1024)) MiB; build with fewer CUDA architectures" \
    "(BUNDLE_CUDA_ARCHS) or fewer tests" >&2
  exit 1
fi
