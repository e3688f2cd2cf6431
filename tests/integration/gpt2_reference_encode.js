// Encodes strings with the npm package gpt-3-encoder, the reference for our tokenizer.
// usage: node gpt2_reference_encode.js MODULE_DIR INPUT.json > OUTPUT.json
// INPUT is a JSON array of strings; OUTPUT the array of their token id arrays.
// With --time: INPUT is a text file, encoded line by line (the encoder's concat is
// quadratic in a text's length); prints the tokens and seconds as JSON.
const path = require('path');
const fs = require('fs');
const encoder = require(path.resolve(process.argv[2]));
if (process.argv[4] === '--time') {
  const lines = fs.readFileSync(process.argv[3], 'utf-8').split(/(?<=\n)/);
  encoder.encode(lines.slice(0, 100).join(''));  // warm up
  const start = process.hrtime.bigint();
  let tokens = 0;
  for (const line of lines) tokens += encoder.encode(line).length;
  process.stdout.write(JSON.stringify({ tokens, seconds: Number(process.hrtime.bigint() - start) / 1e9 }));
} else {
  const inputs = JSON.parse(fs.readFileSync(process.argv[3], 'utf-8'));
  process.stdout.write(JSON.stringify(inputs.map(text => encoder.encode(text))));
}
