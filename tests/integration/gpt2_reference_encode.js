// Encodes strings with the npm package gpt-3-encoder, the reference for our tokenizer.
// usage: node gpt2_reference_encode.js MODULE_DIR INPUT.json > OUTPUT.json
// INPUT is a JSON array of strings; OUTPUT the array of their token id arrays.
const path = require('path');
const fs = require('fs');
const encoder = require(path.resolve(process.argv[2]));
const inputs = JSON.parse(fs.readFileSync(process.argv[3], 'utf-8'));
process.stdout.write(JSON.stringify(inputs.map(text => encoder.encode(text))));
