#!/usr/bin/env bash
# Sets up a fresh Debian 12 machine, builds meshtrain and runs the example job on this machine.
# Usage: scripts/run-example.sh [JOB.yaml]   (default examples/gpt2-tiny-local.yaml)
set -euo pipefail
cd "$(dirname "$0")/.."
job=${1:-examples/gpt2-tiny-local.yaml}

bash scripts/setup.sh
cmake --preset default >/dev/null
cmake --build --preset default --target meshtrain
exec build/default/cli/meshtrain run "$job"
