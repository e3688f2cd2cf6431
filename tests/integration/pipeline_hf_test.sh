#!/usr/bin/env bash
# Pipeline stages with Hugging Face weights in and out: a Llama directory written by the
# PyTorch reference (tests/data/torch_llama_reference.py) trains with `meshtrain run` on
# two ranks as two 1F1B stages and on one rank, from spec.model.init.from; both runs'
# checkpoints export with `meshtrain export`, and the two directories hold the same
# tensors, names and shapes, and their values agree in fp32: all but 0.1% within 1e-6,
# and every one within 1e-4 (the same sums in another order; AdamW turns an ulp of a
# gradient near zero into a visible step, as it does for a few values here).
# Usage: pipeline_hf_test.sh PATH/TO/meshtrain   (run from the repository root)
set -euo pipefail
meshtrain=$1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail() { echo "FAIL (pipeline + Hugging Face): $*" >&2; exit 1; }

/usr/bin/python3 tests/data/torch_llama_reference.py init "$tmp/model" --family llama --dtype bf16 --shards 2
"$meshtrain" prepare-data examples/data/pride-and-prejudice.txt "$tmp/train.bin" >/dev/null

job() {  # job NAME RANKS STAGES
  cat > "$tmp/$1.yaml" <<EOF
apiVersion: meshtrain.dev/v1alpha1
kind: TrainingJob
metadata:
  name: $1
spec:
  image: meshtrain:test
  nodes: 1
  gpusPerNode: $2
  parallelism:
    pipelineParallelDegree: $3
  model:
    init: {from: $tmp/model}
    seqLen: 32
  data:
    train: $tmp/train.bin
  training:
    steps: 3
    globalBatchTokens: 256
    microBatchSize: 2
    learningRate: 0.003
    warmupSteps: 1
    gradClip: 1.0
    precision: fp32
    evalInterval: 0
  checkpoint:
    path: $tmp/$1-ckpt
    interval: 3
EOF
}
job one 1 1
job stages 2 2

out=$(timeout 120 "$meshtrain" run "$tmp/stages.yaml" --no-resume --sample-tokens 0 2>&1) || fail "the P=2 run failed: $out"
echo "$out" | grep -v '^\[20'
[[ $out == *"stage 0 of 2"* ]] || fail "the run does not describe its stages"
[[ $out =~ "step "+"3/3 | loss "[0-9.]+ ]] || fail "no step 3 line"
out=$(timeout 120 "$meshtrain" run "$tmp/one.yaml" --no-resume --sample-tokens 0 2>&1) || fail "the one-rank run failed: $out"
for run in one stages; do
  "$meshtrain" export "$tmp/$run-ckpt/step-00000003" "$tmp/$run-out" >/dev/null || fail "export of the $run run"
done
grep -q LlamaForCausalLM "$tmp/stages-out/config.json" || fail "the P=2 export's config.json names no LlamaForCausalLM"

/usr/bin/python3 - "$tmp/one-out" "$tmp/stages-out" "$tmp/model" <<'EOF'
import importlib.util, sys
spec = importlib.util.spec_from_file_location("ref", "tests/data/torch_llama_reference.py")
ref = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ref)
one, stages, start = (ref.read_directory(d)[1] for d in sys.argv[1:4])
assert one.keys() == stages.keys(), f"tensor names differ: {sorted(one.keys() ^ stages.keys())}"
worst, moved, off, total = 0.0, 0.0, 0, 0
for name in one:
    a, b = one[name], stages[name]
    assert a.shape == b.shape, f"{name}: shape {tuple(a.shape)} against {tuple(b.shape)}"
    worst = max(worst, (a - b).abs().max().item())
    off += ((a - b).abs() > 1e-6).sum().item()
    total += a.numel()
    moved = max(moved, (a - start[name].to(a.dtype)).abs().max().item())
print(f"{len(one)} tensors; P=2 against one rank: largest difference {worst:.2e}, {off} of {total} values over 1e-6; "
      f"training moved weights up to {moved:.2e}")
assert moved > 1e-3, "training did not move the weights"
assert off <= total // 1000, f"{off} of {total} values differ by more than 1e-6"
assert worst <= 1e-4, f"P=2 differs from one rank by {worst:.2e} (bound 1e-4)"
EOF
echo "ok: pipeline stages from and to Hugging Face"
