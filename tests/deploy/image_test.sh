#!/usr/bin/env bash
# The CPU image, built here without a registry (scripts/build-cpu-image.sh), run with the
# real podman: the worker and operator binaries start from it as the non-root user, and
# `meshtrain run` trains a short tiny job inside it. Usage: image_test.sh BUILD_DIR
set -euo pipefail
build=$1
src=$(cd "$(dirname "$0")/../.." && pwd)
work=$(mktemp -d /tmp/meshtrain-image.XXXXXX)
trap 'rm -rf "$work"' EXIT
trap 'echo "FAIL (image): line $LINENO: $BASH_COMMAND exited $?" >&2' ERR
fail() { echo "FAIL (image): $*" >&2; exit 1; }

bash "$src/scripts/build-cpu-image.sh" "$build" "$work/out"
# This sandbox's limits (docker/README.md): runc, because crun refuses the machine's hybrid
# cgroups; no network; ulimits at or below the machine's hard limits, which podman's
# defaults pass.
podman=(podman --storage-driver vfs --root "$work/storage" --runroot "$work/run" --cgroup-manager cgroupfs
        --events-backend file --runtime runc)
run=(run --rm --network none --ulimit nofile=4096:4096 --ulimit nproc=4096:4096)
"${podman[@]}" load -q -i "$work/out/meshtrain-cpu.oci.tar" >/dev/null
image=localhost/meshtrain:cpu

out=$("${podman[@]}" "${run[@]}" "$image" --help 2>&1 || true)
[[ $out == *"meshtrain-worker launch"* ]] || fail "meshtrain-worker does not start from the image: $out"
out=$("${podman[@]}" "${run[@]}" --entrypoint meshtrain-operator "$image" --help 2>&1)
[[ $out == *"the TrainingJob controller"* ]] || fail "meshtrain-operator does not start from the image: $out"
[ "$("${podman[@]}" "${run[@]}" --entrypoint id "$image" -u)" = 65532 ] || fail "the image does not run as user 65532"

sed 's/steps: 300/steps: 20/; s/warmupSteps: 20/warmupSteps: 2/; s/evalInterval: 50/evalInterval: 10/' \
  "$src/examples/gpt2-tiny-local.yaml" >"$work/tiny.yaml"
mkdir -p "$work/data"
"$build/cli/meshtrain" prepare-data "$src/examples/data/pride-and-prejudice.txt" "$work/data/corpus.train.bin" \
  --validation "$work/data/corpus.val.bin" >/dev/null
out=$("${podman[@]}" "${run[@]}" -v "$work/data:/home/meshtrain/examples/data:ro" -v "$work/tiny.yaml:/home/meshtrain/tiny.yaml:ro" \
  --entrypoint meshtrain "$image" run tiny.yaml --sample-tokens 40 2>&1) || fail "meshtrain run in the image failed: $out"
[[ $out == *"step    20/20"* && $out == *"checkpoint: step 20"* && $out == *"sample:"* ]] ||
  fail "meshtrain run in the image did not train to the end: $out"
echo "$out" | tail -4
echo "ok: image"
