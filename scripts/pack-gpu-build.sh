#!/usr/bin/env bash
# Packs a build made on a CPU machine for a GPU machine that has glibc, libstdc++, CUDA,
# cuDNN and NCCL but not the other Debian libraries the build loads.
#
#   scripts/pack-gpu-build.sh BUILD_DIR OUT.tar.xz
#
# The archive holds, at their absolute paths (CTest's files name them):
#   - every ELF program and shared object of BUILD_DIR (CMake's own probes left out) and
#     every CTestTestfile.cmake;
#   - BUILD_DIR/.carried-libs: each shared library those files load from this machine,
#     less what the GPU machine has, and a file PATHS naming the build and source folders;
#   - BUILD_DIR/.runtime-libs/libfabric.so.1: the fabric backend loads libfabric at run
#     time (worker/comm/fabric/libfabric.h), so no program links it and ldd would not find
#     it; a copy goes here, the libraries it loads go to .carried-libs, and
#     scripts/gpu-check.sh puts this folder on LD_LIBRARY_PATH.
#
# On the GPU machine, from the root of a checkout of the same commit:
#   tar -xJf OUT.tar.xz -C /       # BUILD_DIR comes back at the path it was built at
#   export LD_LIBRARY_PATH=BUILD_DIR/.carried-libs:/usr/local/cuda/lib64:/usr/lib/x86_64-linux-gnu
#   mkdir -p "$(dirname SOURCE_DIR)"; ln -sfn "$PWD" SOURCE_DIR   # if the checkout lives elsewhere
#   scripts/gpu-check.sh OUTDIR --build BUILD_DIR
set -euo pipefail
usage="usage: scripts/pack-gpu-build.sh BUILD_DIR OUT.tar.xz"
[ $# -eq 2 ] || { echo "$usage" >&2; exit 2; }
[ -f "$1/CMakeCache.txt" ] || { echo "pack-gpu-build: $1 is no CMake build folder" >&2; exit 2; }
build=$(cd "$1" && pwd)
out=$(cd "$(dirname "$2")" && pwd)/$(basename "$2")
source_dir=$(sed -n 's/^CMAKE_HOME_DIRECTORY:INTERNAL=//p' "$build/CMakeCache.txt")

# libfabric: the first libfabric.so.1 the loader knows. awk reads all of ldconfig's output:
# leaving early would kill ldconfig with SIGPIPE, which pipefail would make this script's end.
libfabric=$(ldconfig -p | awk '$1 == "libfabric.so.1" && path == "" {path = $NF} END {print path}')
[ -n "$libfabric" ] || { echo "pack-gpu-build: this machine has no libfabric.so.1 (apt-get install libfabric1)" >&2; exit 1; }
rm -rf "$build/.runtime-libs" "$build/.carried-libs"
mkdir -p "$build/.runtime-libs" "$build/.carried-libs"
cp -L "$libfabric" "$build/.runtime-libs/libfabric.so.1"

files=$(mktemp)
trap 'rm -f "$files"' EXIT
is_elf() { [ "$(head -c 4 "$1" | od -An -c | tr -d ' ')" = '177ELF' ]; }
# The build's programs and shared objects.
while IFS= read -r -d '' f; do
  is_elf "$f" && printf '%s\n' "$f"
done < <(find "$build" -path "$build/CMakeFiles" -prune -o -path "$build/.carried-libs" -prune -o -type f \
           \( -perm -u+x -o -name '*.so' -o -name '*.so.*' \) -print0) > "$files"
programs=$(wc -l < "$files")

# What they load, less the loader, glibc, the compiler's runtime and NVIDIA's libraries,
# which the GPU machine has in versions that match its driver.
gpu_machine_has='^(linux-vdso|ld-linux|libc|libm|libmvec|libpthread|libdl|librt|libresolv|libgcc_s|libstdc\+\+|libcuda|libcudart|libcublas|libcublasLt|libcudnn[a-z_]*|libnccl|libnvrtc|libnvJitLink|libcufft|libcurand|libcusparse|libcusolver)(\.so|-)'
tr '\n' '\0' < "$files" | xargs -0 -r ldd 2>/dev/null | awk '$2 == "=>" && $3 ~ /^\// {print $1, $3}' | sort -u |
  while read -r name path; do
    [[ $name =~ $gpu_machine_has ]] || cp -L "$path" "$build/.carried-libs/$name"
  done
printf 'build %s\nsource %s\n' "$build" "$source_dir" > "$build/.carried-libs/PATHS"
find "$build/.carried-libs" -type f >> "$files"
find "$build" -path "$build/CMakeFiles" -prune -o -name CTestTestfile.cmake -print >> "$files"

tar -cJf "$out" --absolute-names --files-from="$files"
echo "pack-gpu-build: $programs programs and libraries, $(find "$build/.carried-libs" -name '*.so*' | wc -l)" \
     "carried libraries, into $out ($(du -h "$out" | cut -f1))"
