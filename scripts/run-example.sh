#!/usr/bin/env bash
# Sets up a fresh Debian 12 machine, builds meshtrain and runs the example job on this machine.
# Usage: scripts/run-example.sh [JOB.yaml]   (default examples/gpt2-tiny-tp-fsdp.yaml)
set -euo pipefail
cd "$(dirname "$0")/.."
job=${1:-examples/gpt2-tiny-tp-fsdp.yaml}

bash scripts/setup.sh
cmake --preset default >/dev/null
cmake --build --preset default --target meshtrain meshtrain-worker
meshtrain=build/default/cli/meshtrain
# The tiny example trains on Pride and Prejudice, tokenized once.
if [ ! -f examples/data/corpus.train.bin ] || [ ! -f examples/data/corpus.val.bin ]; then
  "$meshtrain" prepare-data examples/data/pride-and-prejudice.txt examples/data/corpus.train.bin \
    --validation examples/data/corpus.val.bin --validation-fraction 0.1
fi
# A fresh run each time: a second one would otherwise resume from the first's last
# checkpoint (run `meshtrain run JOB` to resume, `meshtrain checkpoints PATH` to list them).
exec "$meshtrain" run "$job" --no-resume
