#!/usr/bin/env bash
# The GPU check: one command, on a machine with a GPU, that runs what only a GPU can show
# and writes every figure into OUTDIR/summary.txt (pass and fail counts first).
#
#   scripts/gpu-check.sh OUTDIR [--build DIR] [--peers DIR] [--quick] [--no-bench]
#
#   1. every test labelled gpu (ctest -L gpu)
#   2. GPT-2 tiny trained on the GPU in bf16 against the CPU's fp32 loss curve, and the
#      same job over 2 ranks (S=2) and 4 ranks (T=2 x S=2, offload at horizon 1) sharing the
#      GPU, against the one-rank GPU curve
#   3. bench train --device cuda at GPT-2 124M, B16 x T1024: world 1, sharded and replicated
#   4. the peers, in the same call, from --peers DIR: PyTorch (DIR/torch_gpt2_bench.py, as
#      ../shared/bench/ has it) and llm.c with cuDNN (DIR/llmc/train_gpt2cu, built; its data
#      made by DIR/llmc_data.py); each where present
#
# It starts from a build made on a CPU machine and carried over (../shared/bench/README.md:
# pack-build.sh, then unpack at the same path); --build names it (default build/default).
# Runs from the checkout's root. Exit status: 0 when every check passed.
set -uo pipefail
cd "$(dirname "$0")/.."

out=${1:?usage: scripts/gpu-check.sh OUTDIR [--build DIR] [--peers DIR] [--quick]}
shift
build=build/default peers= quick=0 bench=1
limit=${GPU_CHECK_STEP_SECONDS:-300}  # the bound on each step (each test, each run)
while [ $# -gt 0 ]; do
  case $1 in
    --build) build=$2; shift 2 ;;
    --peers) peers=$(cd "$2" && pwd); shift 2 ;;
    --quick) quick=1; shift ;;
    --no-bench) bench=0; shift ;;  # the checks of correctness only
    *) echo "gpu-check: unknown argument $1" >&2; exit 2 ;;
  esac
done
mkdir -p "$out"
out=$(cd "$out" && pwd)
summary=$out/summary.txt
meshtrain=$build/cli/meshtrain
passed=0 failed=0
: > "$summary"
note() { echo "$*" | tee -a "$summary"; }
check() {  # check NAME STATUS DETAIL
  if [ "$2" = 0 ]; then passed=$((passed + 1)); note "PASS $1: $3"; else failed=$((failed + 1)); note "FAIL $1: $3"; fi
}
start=$(date +%s)

note "gpu-check of $(git rev-parse --short HEAD 2>/dev/null || echo 'an unknown commit') on $(hostname), $(date -u +%FT%TZ)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | sed 's/^/device: /' | tee -a "$summary"
if [ ! -x "$meshtrain" ]; then
  check build 1 "no meshtrain at $meshtrain (pass --build DIR of a carried build)"
  exit 1
fi

# The order puts first what this call must not miss if it is cut short: the engine's
# first run on the GPU, the headline benchmark and its peers; every step has a timeout.

# GPT-2 tiny: the GPU against the CPU (the ranks sharing the GPU come later).
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$meshtrain" prepare-data examples/data/pride-and-prejudice.txt "$work/train.bin" --validation "$work/val.bin" \
  > /dev/null
steps=$([ $quick = 1 ] && echo 20 || echo 40)
tiny_job() {  # tiny_job NAME PRECISION GPUS TP SHARD OFFLOAD
  cat > "$work/$1.yaml" <<EOF
apiVersion: meshtrain.dev/v1alpha1
kind: TrainingJob
metadata: {name: $1}
spec:
  image: meshtrain
  nodes: 1
  gpusPerNode: $3
  model: {preset: gpt2-tiny}
  data: {train: $work/train.bin, validation: $work/val.bin}
  training: {steps: $steps, globalBatchTokens: 4096, microBatchSize: 8, learningRate: 0.001, warmupSteps: 5,
             weightDecay: 0.0, gradClip: 1.0, seed: 1337, precision: $2, evalInterval: 0, evalBatches: 4}
  parallelism: {tensorParallelDegree: $4, hybridShardDegree: $5$( [ "$6" -gt 0 ] && echo ", activationOffloading: true, activationLoadingHorizon: $6")}
EOF
  timeout "$limit" "$meshtrain" run "$work/$1.yaml" --no-resume --sample-tokens 0 > "$out/tiny-$1.log" 2>&1
  local status=$?
  grep -oE '^step +[0-9]+/[0-9]+ \| loss [0-9.]+' "$out/tiny-$1.log" | awk '{print $NF}' > "$work/$1.losses"
  return $status
}
# The largest relative difference of two loss curves, and whether the second one learns.
compare() {  # compare A B LIMIT -> prints "worst X at step N; loss A0 -> A1, B0 -> B1", status
  python3 - "$work/$1.losses" "$work/$2.losses" "$3" <<'EOF'
import sys
a = [float(x) for x in open(sys.argv[1])]; b = [float(x) for x in open(sys.argv[2])]; limit = float(sys.argv[3])
if not a or len(a) != len(b):
    print(f"{len(a)} and {len(b)} steps: the runs did not both finish"); sys.exit(1)
errors = [abs(x - y) / abs(x) for x, y in zip(a, b)]
worst = max(range(len(errors)), key=errors.__getitem__)
print(f"worst relative difference {errors[worst]:.2e} at step {worst + 1} (limit {limit:g}); "
      f"loss {a[0]:.4f} -> {a[-1]:.4f} and {b[0]:.4f} -> {b[-1]:.4f}")
sys.exit(0 if errors[worst] <= limit and b[-1] < b[0] - 0.5 else 1)
EOF
}
tiny_job cpu fp32 1 1 1 0; cpu_status=$?
tiny_job gpu bf16 1 1 1 0; gpu_status=$?
# bf16 keeps 8 significant bits: over this run the curves drift apart by up to about 1e-2.
detail=$(compare cpu gpu 0.03); status=$?
check "tiny bf16 on the GPU against fp32 on the CPU" $(( cpu_status | gpu_status | status )) "$detail"
if [ "$bench" = 1 ]; then
# GPT-2 124M at B16 x T1024 on the GPU, world 1.
bench_steps=$([ $quick = 1 ] && echo 10 || echo 20)
timeout "$limit" "$meshtrain" bench train --device cuda --model gpt2-124m --batch 16 --seq 1024 --steps "$bench_steps" \
  > "$out/bench-124m.log" 2>&1
status=$?
check "bench gpt2-124m B16 T1024 (world 1)" $status "$(grep -E 'tokens/s|MFU' "$out/bench-124m.log" | tr '\n' ';')"
sed 's/^/  /' "$out/bench-124m.log" >> "$summary"
ours=$(grep -oE '[0-9]+ tokens/s' "$out/bench-124m.log" | head -1 | grep -oE '[0-9]+')

# The peers, in the same call.
if [ -f "$peers/torch_gpt2_bench.py" ]; then
  timeout "$limit" python3 "$peers/torch_gpt2_bench.py" --batch 16 --seq 1024 --compile 1 > "$out/torch.log" 2>&1
  status=$?
  check "PyTorch peer (torch.compile, flash SDPA)" $status "$(tail -1 "$out/torch.log")"
  theirs=$(grep -oE '[0-9,]+ tokens/s' "$out/torch.log" | tail -1 | tr -d , | grep -oE '[0-9]+')
  [ -n "$ours" ] && [ -n "$theirs" ] && note "meshtrain / PyTorch: $(python3 -c "print(f'{$ours / $theirs:.3f}')") ($ours / $theirs tokens/s)"
fi
if [ -x "$peers/llmc/train_gpt2cu" ]; then
  python3 "$peers/llmc_data.py" "$work/llmc-train.bin" 8000000 > /dev/null 2>&1
  python3 "$peers/llmc_data.py" "$work/llmc-val.bin" 400000 > /dev/null 2>&1
  (cd "$peers/llmc" && timeout "$limit" ./train_gpt2cu -e d12 -b 16 -t 1024 -x 25 -v 1000 -s 1000 -i "$work/llmc-train.bin" \
    -j "$work/llmc-val.bin") > "$out/llmc.log" 2>&1
  status=$?
  # llm.c prints "step N/M | ... | (X ms | Y tok/s)"; the mean of the steps after the first five
  theirs=$(grep -oE '[0-9]+ tok/s' "$out/llmc.log" | tail -n 20 | grep -oE '[0-9]+' |
           awk '{s += $1; n++} END {if (n) printf "%d", s / n}')
  check "llm.c peer (cuDNN flash attention)" $status "${theirs:-?} tokens/s (mean of its last 20 steps)"
  [ -n "$ours" ] && [ -n "$theirs" ] && note "meshtrain / llm.c: $(python3 -c "print(f'{$ours / $theirs:.3f}')") ($ours / $theirs tokens/s)"
fi

fi

# Every gpu test (from its own directory: a carried build has only the gpu tests built).
timeout $((2 * limit)) ctest --test-dir "$build/tests/gpu" -L gpu --output-on-failure --timeout "$limit" > "$out/gpu-tests.log" 2>&1
status=$?
counts=$(grep -E '^[0-9]+% tests passed' "$out/gpu-tests.log" | tail -1)
skipped=$(grep -c 'Skipped' "$out/gpu-tests.log")
check "gpu tests" $status "${counts:-no ctest summary}; $skipped skipped (log: gpu-tests.log)"
grep -A200 'The following tests FAILED' "$out/gpu-tests.log" | tee -a "$summary" > /dev/null

# Ranks sharing the GPU (staged collectives) against the one-rank GPU curve.
tiny_job s2 bf16 2 1 2 0; s2_status=$?
detail=$(compare gpu s2 0.03); status=$?
check "tiny over 2 ranks sharing the GPU (S=2)" $(( s2_status | status )) "$detail"
tiny_job t2s2 bf16 4 2 2 1; t2s2_status=$?
detail=$(compare gpu t2s2 0.03); status=$?
check "tiny over 4 ranks sharing the GPU (T=2, S=2, offload horizon 1)" $(( t2s2_status | status )) "$detail"
grep -h '^note:' "$out"/tiny-*.log | sort -u | sed 's/^/  /' | tee -a "$summary" > /dev/null


if [ "$bench" = 1 ]; then
timeout "$limit" "$meshtrain" bench train --device cuda --model gpt2-124m --batch 16 --seq 1024 --steps "$bench_steps" \
  --compare replicated > "$out/bench-124m-replicated.log" 2>&1
status=$?
check "bench gpt2-124m world 1, sharded against replicated" $status \
  "$(grep -E ' / ' "$out/bench-124m-replicated.log" | tr '\n' ';')"
sed 's/^/  /' "$out/bench-124m-replicated.log" >> "$summary"

fi

note "gpu-check: $passed passed, $failed failed, in $(( $(date +%s) - start )) s"
[ "$failed" = 0 ]
