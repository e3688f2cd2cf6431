// Encodes strings with encoders of their own (no tokenizer.json): llama3-tokenizer-js for
// Llama 3, mistral-tokenizer-js for Mistral 7B's vocabulary; second opinions beside
// transformers.js (hf_reference_encode.js).
// usage: node second_opinion_encode.mjs NODE_MODULES llama3|mistral INPUT.json > OUTPUT.json
import fs from 'fs';
import path from 'path';
const [modules, which, input] = process.argv.slice(2);
const texts = JSON.parse(fs.readFileSync(input, 'utf-8'));
let encode;
if (which === 'llama3') {
  const m = await import(path.resolve(modules, 'llama3-tokenizer-js/bundle/llama3-tokenizer-with-baked-data.js'));
  encode = (t) => m.default.encode(t, { bos: false, eos: false });
} else {
  const m = await import(path.resolve(modules, 'mistral-tokenizer-js/mistral-tokenizer.js'));
  encode = (t) => m.default.encode(t, false, true);
}
process.stdout.write(JSON.stringify(texts.map(encode)));
