// Encodes strings with transformers.js's tokenizers (the npm package @lenml/tokenizers),
// the reference for our tokenizer.json implementation, from a model directory's
// tokenizer.json and tokenizer_config.json.
// usage: node hf_reference_encode.js NODE_MODULES MODEL_DIR INPUT.json > OUTPUT.json
// INPUT is a JSON array of strings; OUTPUT the array of their id arrays (no BOS or EOS).
// With --time instead of OUTPUT: INPUT is a text file, encoded whole; prints tokens and seconds.
const path = require('path');
const fs = require('fs');
const { TokenizerLoader } = require(path.resolve(process.argv[2], '@lenml/tokenizers'));
const dir = process.argv[3];
const read = (name) => JSON.parse(fs.readFileSync(path.join(dir, name), 'utf-8'));
const config = fs.existsSync(path.join(dir, 'tokenizer_config.json')) ? read('tokenizer_config.json') : {};
const tokenizer = TokenizerLoader.fromPreTrained({ tokenizerJSON: read('tokenizer.json'), tokenizerConfig: config });
const encode = (text) => tokenizer.encode(text, { add_special_tokens: false });
if (process.argv[5] === '--time') {
  const text = fs.readFileSync(process.argv[4], 'utf-8');
  encode(text.slice(0, 10000));  // warm up
  const start = process.hrtime.bigint();
  const ids = encode(text);
  const seconds = Number(process.hrtime.bigint() - start) / 1e9;
  process.stdout.write(JSON.stringify({ tokens: ids.length, seconds }));
} else {
  const inputs = JSON.parse(fs.readFileSync(process.argv[4], 'utf-8'));
  process.stdout.write(JSON.stringify(inputs.map(encode)));
}
