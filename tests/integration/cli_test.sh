#!/usr/bin/env bash
# Runs the real `meshtrain` binary and checks its output and exit codes.
# Usage: cli_test.sh PATH/TO/meshtrain   (run from the repository root)
set -uo pipefail
meshtrain=$1
failures=0
passes=0

# expect NAME EXIT_CODE PATTERN... -- COMMAND...: the command exits EXIT_CODE and its
# combined output matches every (grep -E) pattern.
expect() {
  local name=$1 code=$2; shift 2
  local patterns=()
  while [ "$1" != "--" ]; do patterns+=("$1"); shift; done
  shift
  local out rc
  out=$(timeout 60 "$@" 2>&1); rc=$?
  local ok=1
  [ "$rc" -eq "$code" ] || { echo "FAIL $name: exit $rc, expected $code"; ok=0; }
  for p in "${patterns[@]}"; do
    grep -qE -- "$p" <<<"$out" || { echo "FAIL $name: output lacks /$p/"; ok=0; }
  done
  if [ $ok -eq 1 ]; then passes=$((passes + 1)); echo "ok   $name"; else failures=$((failures + 1)); echo "$out" | sed 's/^/     | /'; fi
}

expect "validate the examples" 0 \
  'gpt2-tiny-local.yaml TrainingJob "gpt2-tiny-local": ok' 'gpt2-2p7b-32x8.yaml TrainingJob "gpt2-2p7b": ok' \
  -- "$meshtrain" validate examples/*.yaml examples/*.json

expect "validate names every bad field" 1 \
  'invalid-job.yaml TrainingJob "invalid-job": spec.training.shedule: unknown field' \
  'spec.parallelism.tensorParallelDegree: must divide spec.gpusPerNode \(8\), got 3' \
  'spec.runPolicy.cleanPodPolicy: must be one of None, Running, All; got "Sometimes"' \
  -- "$meshtrain" validate tests/data/invalid-job.yaml

expect "one bad file fails the whole run but the good ones still report" 1 \
  'gpt2-tiny-local.yaml TrainingJob "gpt2-tiny-local": ok' 'tensorParallelDegree' \
  -- "$meshtrain" validate examples/gpt2-tiny-local.yaml tests/data/invalid-job.yaml

expect "malformed YAML gets line and column" 2 \
  'tests/data/malformed.yaml:5:[0-9]+: ' \
  -- "$meshtrain" validate tests/data/malformed.yaml

expect "a missing file is named" 2 'nope.yaml' -- "$meshtrain" validate nope.yaml

expect "layout prints every group" 0 \
  '256 rank\(s\)' 'mesh: 2 replica\(s\) x 16 shard x 8 tp' 'tp groups \(32 of 8\)' \
  'shard groups \(16 of 16\)' '0-120 step 8  \(nodes 0-15\)' 'replica groups \(128 of 2\)' '0,128  \(nodes 0,16\)' \
  -- "$meshtrain" layout examples/gpt2-2p7b-32x8.yaml

expect "run validates and lays out the tiny job" 0 \
  'gpt2-tiny-local": ok' '842496 parameters' 'no training engine yet' \
  -- "$meshtrain" run examples/gpt2-tiny-local.yaml

expect "run refuses an invalid job" 1 'tensorParallelDegree' -- "$meshtrain" run tests/data/invalid-job.yaml
expect "an unknown log level is refused" 2 'log-level' -- "$meshtrain" --log-level loud validate examples/gpt2-tiny-local.yaml
expect "log level applies" 0 'ok' -- "$meshtrain" --log-level error run examples/gpt2-tiny-local.yaml
expect "version" 0 '^meshtrain [0-9]+\.[0-9]+\.[0-9]+ \(cuda (on|off)\)' -- "$meshtrain" --version

echo "$passes passed, $failures failed"
[ "$failures" -eq 0 ]
