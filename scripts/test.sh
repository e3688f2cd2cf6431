#!/usr/bin/env bash
# Sets up a fresh Debian 12 machine, builds meshtrain and runs every test:
# the ctest suite (labels unit, integration, ...) and a 45-second fuzz run of each parser
# (the manifest, the checkpoint metadata, the Store's wire protocol and the worker's HTTP
# requests).
# Under CI (CI set) warnings are errors.
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/setup.sh
bash scripts/install-kube-tools.sh
bash scripts/install-gpt2-reference.sh
bash scripts/install-tokenizer-references.sh
preset=default
[ -n "${CI:-}" ] && preset=ci

cmake --preset "$preset"
cmake --build --preset "$preset"
bash scripts/fuzz.sh "${MESHTRAIN_FUZZ_SECONDS:-45}"
ctest --preset "$preset"
