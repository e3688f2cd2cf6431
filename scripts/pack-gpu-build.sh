#!/usr/bin/env bash
# Packs BUILD_DIR for the GPU machine with ../shared/bench/pack-build.sh, libfabric included:
# the fabric backend loads libfabric.so.1 at run time (worker/comm/fabric/libfabric.h), so
# no program of the build links it, and pack-build.sh, which carries what the programs
# link, would leave it behind; the GPU machine has none. A copy goes to
# BUILD_DIR/.runtime-libs, where pack-build.sh takes it and the libraries it links, and
# scripts/gpu-check.sh finds it.
#   scripts/pack-gpu-build.sh BUILD_DIR OUT.tar.xz
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:?usage: scripts/pack-gpu-build.sh BUILD_DIR OUT.tar.xz} out=${2:?usage: scripts/pack-gpu-build.sh BUILD_DIR OUT.tar.xz}
# awk reads to the end: an early exit would end ldconfig with SIGPIPE, which pipefail
# turns into a silent exit of this script.
libfabric=$(ldconfig -p | awk '/libfabric\.so\.1 / && !found {print $NF; found = 1}')
[ -n "$libfabric" ] || { echo "pack-gpu-build: this machine has no libfabric.so.1 (apt-get install libfabric1)" >&2; exit 1; }
rm -rf "$build/.runtime-libs"
mkdir -p "$build/.runtime-libs"
cp -L "$libfabric" "$build/.runtime-libs/libfabric.so.1"
bash ../shared/bench/pack-build.sh "$build" "$out"
