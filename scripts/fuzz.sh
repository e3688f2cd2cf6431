#!/usr/bin/env bash
# Builds the libFuzzer target with clang and fuzzes the manifest parser for N seconds (default 60).
# Seeds come from tests/fuzz/corpus; new inputs go to build/fuzz/corpus, crashes to build/fuzz/crash-*.
# A crash fails the script; add the crashing input to tests/fuzz/corpus/manifest once fixed.
set -uo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-60}

cmake --preset fuzz >/dev/null && cmake --build --preset fuzz || exit 1
mkdir -p build/fuzz/corpus
rm -f build/fuzz/crash-* build/fuzz/leak-* build/fuzz/timeout-* build/fuzz/oom-*
# libFuzzer can stall while reporting an out-of-memory; the outer timeout bounds that too.
timeout -s KILL $((seconds + 120)) build/fuzz/tests/fuzz/manifest_fuzzer build/fuzz/corpus tests/fuzz/corpus/manifest \
  -dict=tests/fuzz/manifest.dict -max_total_time="$seconds" -max_len=8192 -timeout=10 -rss_limit_mb=2048 -malloc_limit_mb=512 \
  -artifact_prefix=build/fuzz/ -print_final_stats=1 >build/fuzz/fuzz.log 2>&1
rc=$?
if [ $rc -ne 0 ] || ls build/fuzz/crash-* build/fuzz/leak-* build/fuzz/timeout-* build/fuzz/oom-* >/dev/null 2>&1; then
  tail -60 build/fuzz/fuzz.log
  echo "fuzz: FAILED (exit $rc); the input is in build/fuzz/"
  exit 1
fi
grep -E "^stat::(number_of_executed_units|peak_rss_mb)" build/fuzz/fuzz.log
echo "fuzz: ${seconds}s, no crash; corpus $(ls build/fuzz/corpus | wc -l) inputs"
