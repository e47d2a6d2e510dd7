#!/usr/bin/env bash
# Installs the Debian packages shardtrain builds and tests against (docs/dependencies.md lists
# what each is for). Packages already installed are skipped; `apt-get update` runs only when
# something is missing. The CUDA Toolkit (nvcc, cuBLAS, NCCL) is not a Debian package: it is
# used from /usr/local/cuda when present.
set -euo pipefail

packages=(
  cmake ninja-build g++
  libopenblas-openmp-dev
  libhdf5-dev hdf5-tools
  libopenmpi-dev openmpi-bin
  libyaml-cpp-dev nlohmann-json3-dev libfmt-dev
  libboost-dev libboost-iostreams-dev
  libgtest-dev
  gnuplot-nox
  xz-utils
  python3
)

missing=()
for package in "${packages[@]}"; do
  if ! dpkg -s "$package" 2>/dev/null | grep '^Status: install ok installed' >/dev/null; then
    missing+=("$package")
  fi
done

if ((${#missing[@]} == 0)); then
  exit 0
fi

echo "install-deps: installing ${missing[*]}"
sudo=()
if [[ $(id -u) -ne 0 ]]; then
  if ! command -v sudo >/dev/null 2>&1; then
    echo "install-deps: ${missing[*]} must be installed, which needs root, and sudo is not" \
      "installed: run this script as root (su -c 'bash $0') or install sudo first" >&2
    exit 1
  fi
  sudo=(sudo)
fi
# A freshly booted machine's unattended upgrades may hold the dpkg lock for a while: wait for it
# instead of failing at once.
lock_wait=(-o DPkg::Lock::Timeout=600)
"${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get "${lock_wait[@]}" update
"${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get "${lock_wait[@]}" install -y \
  --no-install-recommends "${missing[@]}"
