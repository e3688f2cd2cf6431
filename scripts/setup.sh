#!/usr/bin/env bash
# Installs the Debian 12 packages that meshtrain's build and tests need, if any are missing.
# Idempotent: when everything is present it only asks dpkg, and takes well under a second.
# As root it runs apt-get; otherwise it prints the exact apt-get line to run.
set -euo pipefail

packages=(
  # toolchain
  g++ cmake ninja-build pkg-config git
  # clang with libFuzzer (its runtime) and OpenMP for the fuzz build
  clang libclang-rt-14-dev libomp-14-dev
  # libraries
  libcpprest-dev libssl-dev libyaml-cpp-dev prometheus-cpp-dev libspdlog-dev libfmt-dev
  libfabric-dev libopenblas-openmp-dev nlohmann-json3-dev libcli11-dev libgtest-dev libpcre2-dev
  libsentencepiece-dev sentencepiece libutf8proc-dev
  # e2e tests: unzip for the kubectl layer, a real Prometheus (server and promtool) and curl
  # to query it; npm comes below unless Node.js is already there
  unzip prometheus curl
  # TLS tests of the Kubernetes client: a private CA and certificates
  openssl
  # the reference that writes a tiny Hugging Face GPT-2 and its logits for the import test;
  # YAML to JSON for the chart tests
  python3 python3-yaml
  # PyTorch, the independent implementation the Llama class is checked against
  # (tests/data/torch_llama_reference.py)
  python3-torch
  # the CPU image: a Debian root filesystem, made an OCI image and run (deploy tests)
  debootstrap buildah podman runc
)

missing=()
for p in "${packages[@]}"; do
  status=$(dpkg-query -W -f='${db:Status-Status}' "$p" 2>/dev/null || true)
  [ "$status" = "installed" ] || missing+=("$p")
done

# kubectl, helm and kubernetes-models come from npm (scripts/install-kube-tools.sh). A
# machine with its own Node.js keeps it; Debian's npm would conflict with other builds.
command -v npm >/dev/null 2>&1 || missing+=(npm)

if [ ${#missing[@]} -eq 0 ]; then
  echo "setup: all ${#packages[@]} packages present"
  exit 0
fi

line="apt-get install -y --no-install-recommends ${missing[*]}"
if [ "$(id -u)" -ne 0 ]; then
  echo "setup: missing packages; run as root:"
  echo "  apt-get update && $line"
  exit 1
fi
echo "setup: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -q
$line
