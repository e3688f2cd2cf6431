// Validates every Pod, Service and ConfigMap the operator wrote (as recorded by the test
// API server's --record-dir) against the Kubernetes schemas of the npm package
// kubernetes-models. Usage: node validate_objects.js MODELS_DIR RECORD_DIR
"use strict";
const fs = require("fs");
const path = require("path");

const [modelsDir, recordDir] = process.argv.slice(2);
const kinds = {
  Pod: require(path.resolve(modelsDir, "kubernetes-models/v1/Pod")).Pod,
  Service: require(path.resolve(modelsDir, "kubernetes-models/v1/Service")).Service,
  ConfigMap: require(path.resolve(modelsDir, "kubernetes-models/v1/ConfigMap")).ConfigMap,
};
const counts = {};
let failures = 0;
for (const file of fs.readdirSync(recordDir).sort()) {
  const object = JSON.parse(fs.readFileSync(path.join(recordDir, file), "utf8"));
  const Model = kinds[object.kind];
  if (!Model) {
    console.error(`${file}: unexpected kind ${object.kind}`);
    failures++;
    continue;
  }
  try {
    new Model(object).validate();
    counts[object.kind] = (counts[object.kind] || 0) + 1;
  } catch (e) {
    console.error(`${file}: ${object.kind} ${object.metadata && object.metadata.name}: ${e.message}`);
    failures++;
  }
}
console.log(`valid: ${JSON.stringify(counts)}; invalid: ${failures}`);
for (const kind of Object.keys(kinds)) {
  if (!counts[kind]) {
    console.error(`no ${kind} was recorded`);
    failures++;
  }
}
process.exit(failures ? 1 : 0);
