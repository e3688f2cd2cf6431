#!/usr/bin/env bash
# A CPU image of meshtrain built without any image registry: a Debian 12 root filesystem
# from debootstrap (Debian's mirror) with the runtime libraries, the three binaries of
# BUILD_DIR added, made into an OCI image by buildah and written as an OCI archive.
#   scripts/build-cpu-image.sh BUILD_DIR OUT_DIR
# writes OUT_DIR/meshtrain-cpu.oci.tar (image localhost/meshtrain:cpu). Needs root,
# debootstrap and buildah (Debian packages); storage is vfs, under OUT_DIR.
set -euo pipefail
build=$(cd "$1" && pwd) out=$(mkdir -p "$2" && cd "$2" && pwd)
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
[ "$(id -u)" -eq 0 ] || { echo "build-cpu-image: debootstrap needs root" >&2; exit 1; }
for tool in debootstrap buildah; do
  command -v "$tool" >/dev/null || { echo "build-cpu-image: $tool is not installed (apt-get install $tool)" >&2; exit 1; }
done
for bin in cli/meshtrain worker/meshtrain-worker operator/meshtrain-operator; do
  [ -x "$build/$bin" ] || { echo "build-cpu-image: $build/$bin is not built" >&2; exit 1; }
done

rootfs=$out/rootfs
rm -rf "$rootfs"
# The shared libraries the binaries link (ldd of each), and libfabric, which the fabric
# backend loads with its first endpoint, as Debian 12 packages.
libraries=libcpprest2.10,libfabric1,libfmt9,libopenblas0-openmp,libprometheus-cpp-core1.0,libprometheus-cpp-pull1.0
libraries+=,libspdlog1.10,libssl3,libyaml-cpp0.7,libpcre2-8-0,libsentencepiece0,libutf8proc2,ca-certificates
debootstrap --variant=minbase --include="$libraries" bookworm "$rootfs" "$mirror" >"$out/debootstrap.log" 2>&1 ||
  { echo "build-cpu-image: debootstrap from $mirror failed; see $out/debootstrap.log" >&2; exit 1; }
rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/* "$rootfs"/usr/share/doc \
       "$rootfs"/usr/share/man "$rootfs"/usr/share/locale
install -m 0755 "$build/cli/meshtrain" "$build/worker/meshtrain-worker" "$build/operator/meshtrain-operator" \
  "$rootfs/usr/local/bin/"
echo 'meshtrain:x:65532:65532:meshtrain:/home/meshtrain:/usr/sbin/nologin' >>"$rootfs/etc/passwd"
echo 'meshtrain:x:65532:' >>"$rootfs/etc/group"
install -d -o 65532 -g 65532 "$rootfs/home/meshtrain"
# Every binary finds every library in the root filesystem.
for bin in meshtrain meshtrain-worker meshtrain-operator; do
  missing=$(chroot "$rootfs" ldd "/usr/local/bin/$bin" | grep "not found" || true)
  [ -z "$missing" ] || { echo "build-cpu-image: $bin lacks libraries in the image: $missing" >&2; exit 1; }
done
# Read whole before grep -q, which stops at its match: ldconfig, cut short by SIGPIPE, would
# fail the pipeline (pipefail) and this check with it.
cache=$(chroot "$rootfs" ldconfig -p)
grep -q 'libfabric\.so\.1 ' <<<"$cache" ||
  { echo "build-cpu-image: the image lacks libfabric.so.1, which the fabric backend loads" >&2; exit 1; }

buildah=(buildah --storage-driver vfs --root "$out/storage" --runroot "$out/run")
container=$("${buildah[@]}" from scratch)
"${buildah[@]}" copy "$container" "$rootfs" / >/dev/null
"${buildah[@]}" config --user 65532:65532 --workingdir /home/meshtrain --env PATH=/usr/local/bin:/usr/bin:/bin \
  --entrypoint '["meshtrain-worker"]' --cmd launch --label org.opencontainers.image.title=meshtrain-cpu "$container"
"${buildah[@]}" commit -q --rm "$container" localhost/meshtrain:cpu >/dev/null
rm -f "$out/meshtrain-cpu.oci.tar"
"${buildah[@]}" push -q localhost/meshtrain:cpu "oci-archive:$out/meshtrain-cpu.oci.tar:meshtrain:cpu"
rm -rf "$rootfs"
echo "build-cpu-image: $out/meshtrain-cpu.oci.tar ($(du -m "$out/meshtrain-cpu.oci.tar" | cut -f1) MiB)"
