#!/usr/bin/env bash
# meshtrain against llm.c on this machine's CPU, both in one run: GPT-2 124M, batch 4 x
# seq 64 (train_gpt2.c's own shape), every core.
#
#   bench/compare-llmc-cpu.sh TRAIN_GPT2 [--meshtrain BIN] [--steps N]
#
# TRAIN_GPT2 is llm.c's CPU trainer, built in a checkout of karpathy/llm.c by its own
# Makefile (`make train_gpt2`). It runs here on a random-weight checkpoint
# (llmc_checkpoint.py) and random tokens (llmc_data.py) in a scratch folder, since it reads
# gpt2_124M.bin and dev/data/tinyshakespeare/ from its working directory; it is stopped after
# N + 1 steps (its step 0 and its sampling are not counted). Its rate is B x T over the
# median of its steps 1..N ("took X ms"). Then `meshtrain bench train --model gpt2-124m
# --batch 4 --seq 64`, with no environment variable set by this script, and the ratio.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
llmc=${1:?usage: bench/compare-llmc-cpu.sh TRAIN_GPT2 [--meshtrain BIN] [--steps N]}
llmc=$(cd "$(dirname "$llmc")" && pwd)/$(basename "$llmc")
shift
meshtrain=$here/../build/default/cli/meshtrain steps=8
while [ $# -gt 0 ]; do
  case $1 in
    --meshtrain) meshtrain=$2; shift 2 ;;
    --steps) steps=$2; shift 2 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done
[ -x "$llmc" ] || { echo "$llmc: not an executable (build it with llm.c's 'make train_gpt2')" >&2; exit 2; }
[ -x "$meshtrain" ] || { echo "$meshtrain: not built (--meshtrain BIN)" >&2; exit 2; }
python=/usr/bin/python3; [ -x "$python" ] || python=python3
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
mkdir -p "$work/dev/data/tinyshakespeare"
"$python" "$here/llmc_checkpoint.py" "$work/gpt2_124M.bin"
"$python" "$here/llmc_data.py" "$work/dev/data/tinyshakespeare/tiny_shakespeare_train.bin" 400000
"$python" "$here/llmc_data.py" "$work/dev/data/tinyshakespeare/tiny_shakespeare_val.bin" 40000
cores=$(nproc)

echo "== meshtrain bench train --model gpt2-124m --batch 4 --seq 64"
"$meshtrain" bench train --model gpt2-124m --batch 4 --seq 64 | tee "$work/meshtrain.log"
ours=$(grep -oE '[0-9.]+ tokens/s' "$work/meshtrain.log" | head -n 1 | grep -oE '^[0-9.]+')

echo "== llm.c train_gpt2 ($cores threads), steps 1..$steps"
# Its step lines: "step N: train loss X (took Y ms)"; it is stopped after step N.
(cd "$work" && OMP_NUM_THREADS=$cores exec stdbuf -oL "$llmc" > "$work/llmc.log" 2>&1) &
pid=$!
for _ in $(seq 3600); do
  grep -q "^step $steps: train loss" "$work/llmc.log" 2>/dev/null && break
  kill -0 "$pid" 2>/dev/null || break
  sleep 0.5
done
kill "$pid" 2>/dev/null || true
wait "$pid" 2>/dev/null || true
grep -E '^step [0-9]+: train loss' "$work/llmc.log" || { cat "$work/llmc.log"; echo "llm.c gave no step line" >&2; exit 1; }
theirs=$(grep -E '^step [0-9]+: train loss' "$work/llmc.log" | tail -n +2 | grep -oE 'took [0-9.]+' | grep -oE '[0-9.]+' |
  sort -n | awk '{a[NR]=$1} END {m=(NR%2)?a[(NR+1)/2]:(a[NR/2]+a[NR/2+1])/2; printf "%.1f", 256000/m}')

echo "== on $(grep -m1 'model name' /proc/cpuinfo | sed 's/.*: //'), $cores cores"
echo "meshtrain: $ours tokens/s; llm.c train_gpt2: $theirs tokens/s (256 tokens over its median step)"
awk -v a="$ours" -v b="$theirs" 'BEGIN {printf "meshtrain / llm.c: %.2fx\n", a/b}'
