#!/usr/bin/env bash
# The release build of meshtrain's two images, from the repository root, with a registry:
#   REGISTRY=123456789012.dkr.ecr.us-west-2.amazonaws.com TAG=0.1.0 scripts/build-images.sh [--push]
# builds $REGISTRY/meshtrain-worker:$TAG (docker/Dockerfile.worker: CUDA 13, NCCL, EFA,
# aws-ofi-nccl) and $REGISTRY/meshtrain-operator:$TAG (docker/Dockerfile.operator), with
# podman, or docker when podman is missing; --push pushes both. The base images come from
# Docker Hub and NVIDIA's registry. Without a registry, scripts/build-cpu-image.sh builds a
# CPU image from Debian's packages alone.
set -euo pipefail
cd "$(dirname "$0")/.."
registry=${REGISTRY:?set REGISTRY to the registry to tag (and push) the images for}
tag=${TAG:-$(sed -n 's/^appVersion: "\(.*\)"/\1/p' helm/meshtrain/Chart.yaml)}
engine=$(command -v podman || command -v docker || true)
[ -n "$engine" ] || { echo "build-images: neither podman nor docker is installed" >&2; exit 1; }
for image in worker operator; do
  "$engine" build -f "docker/Dockerfile.$image" -t "$registry/meshtrain-$image:$tag" .
done
if [ "${1:-}" = "--push" ]; then
  for image in worker operator; do "$engine" push "$registry/meshtrain-$image:$tag"; done
fi
echo "built $registry/meshtrain-worker:$tag and $registry/meshtrain-operator:$tag"
