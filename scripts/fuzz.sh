#!/usr/bin/env bash
# Builds the libFuzzer targets with clang and fuzzes each for N seconds (default 60): the
# manifest parser, the checkpoint metadata parser, what faces the network (the rendezvous
# Store's server and the worker's HTTP endpoint), and every file a user downloads: a model
# directory's tokenizer.json (loaded and encoding), config.json, safetensors headers and
# index, and a data set's token shards and loss masks.
# Seeds come from tests/fuzz/corpus/TARGET; new inputs go to build/fuzz/corpus/TARGET,
# crashes to build/fuzz/TARGET-crash-*. A crash fails the script; add the crashing input
# to tests/fuzz/corpus/TARGET once fixed.
set -uo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-60}

cmake --preset fuzz >/dev/null && cmake --build --preset fuzz || exit 1
# Undefined behaviour stops the run like a crash (the sanitizer would otherwise go on).
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-halt_on_error=1:print_stacktrace=1}

# fuzz TARGET [LIBFUZZER_FLAGS...]
fuzz() {
  local target=$1; shift
  local log=build/fuzz/$target.log
  mkdir -p "build/fuzz/corpus/$target"
  rm -f build/fuzz/"$target"-crash-* build/fuzz/"$target"-leak-* build/fuzz/"$target"-timeout-* build/fuzz/"$target"-oom-*
  # libFuzzer can stall while reporting an out-of-memory; the outer timeout bounds that too.
  timeout -s KILL $((seconds + 120)) "build/fuzz/tests/fuzz/${target}_fuzzer" "build/fuzz/corpus/$target" \
    "tests/fuzz/corpus/$target" "$@" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -malloc_limit_mb=512 \
    -artifact_prefix="build/fuzz/$target-" -print_final_stats=1 >"$log" 2>&1
  local rc=$?
  if [ $rc -ne 0 ] || ls build/fuzz/"$target"-crash-* build/fuzz/"$target"-leak-* build/fuzz/"$target"-timeout-* \
      build/fuzz/"$target"-oom-* >/dev/null 2>&1; then
    tail -60 "$log"
    echo "fuzz: $target FAILED (exit $rc); the input is in build/fuzz/"
    return 1
  fi
  grep -E "^stat::(number_of_executed_units|peak_rss_mb)" "$log"
  echo "fuzz: $target ${seconds}s, no crash; corpus $(ls "build/fuzz/corpus/$target" | wc -l) inputs"
}

targets=(
  "manifest -dict=tests/fuzz/manifest.dict -max_len=8192"
  "checkpoint_metadata -max_len=4096"
  "store -max_len=4096"
  "http_request -dict=tests/fuzz/http_request.dict -max_len=10000"  # past the 8 KiB head limit
  "tokenizer -dict=tests/fuzz/tokenizer.dict -max_len=16384"  # the seeds' cut vocabularies fit
  "hf_config -dict=tests/fuzz/hf_config.dict -max_len=4096"
  "safetensors -dict=tests/fuzz/safetensors.dict -max_len=8192"  # a header and its index
  "token_file -max_len=4096"  # past llm.c's 1 KiB header
  "loss_mask -max_len=1024"
)
# Each target runs on one core: as many at once as there are cores, each one's report
# printed in order once its batch ends.
width=$(nproc)
failed=0
for ((first = 0; first < ${#targets[@]}; first += width)); do
  batch=("${targets[@]:first:width}") pids=()
  for t in "${batch[@]}"; do
    read -ra args <<<"$t"
    fuzz "${args[@]}" >"build/fuzz/${args[0]}.report" 2>&1 &
    pids+=($!)
  done
  for i in "${!batch[@]}"; do
    wait "${pids[i]}" || failed=1
    read -ra args <<<"${batch[i]}"
    cat "build/fuzz/${args[0]}.report"
  done
done
exit $failed
