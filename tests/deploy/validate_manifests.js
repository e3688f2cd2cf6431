// Validates Kubernetes objects against the schemas of the npm packages kubernetes-models
// and @kubernetes-models/prometheus-operator: a JSON array (chart_test.sh's conversion of
// `helm template` output), or a directory of JSON files, one object each (what the test
// API server recorded of the operator's writes). Every object's kind must be known here,
// and each kind named by --require must occur.
// Usage: node validate_manifests.js MODELS_DIR OBJECTS_JSON|DIRECTORY [--require Kind,Kind...]
'use strict';
const fs = require('fs');
const path = require('path');

const [modelsDir, file, flag, required] = process.argv.slice(2);
const load = (module, kind) => require(path.resolve(modelsDir, module))[kind];
const models = {
  'v1/Pod': load('kubernetes-models/v1/Pod', 'Pod'),
  'v1/ServiceAccount': load('kubernetes-models/v1/ServiceAccount', 'ServiceAccount'),
  'v1/ConfigMap': load('kubernetes-models/v1/ConfigMap', 'ConfigMap'),
  'v1/Service': load('kubernetes-models/v1/Service', 'Service'),
  'v1/Secret': load('kubernetes-models/v1/Secret', 'Secret'),
  'networking.k8s.io/v1/NetworkPolicy': load('kubernetes-models/networking.k8s.io/v1/NetworkPolicy', 'NetworkPolicy'),
  'apps/v1/Deployment': load('kubernetes-models/apps/v1/Deployment', 'Deployment'),
  'policy/v1/PodDisruptionBudget': load('kubernetes-models/policy/v1/PodDisruptionBudget', 'PodDisruptionBudget'),
  'rbac.authorization.k8s.io/v1/ClusterRole': load('kubernetes-models/rbac.authorization.k8s.io/v1/ClusterRole', 'ClusterRole'),
  'rbac.authorization.k8s.io/v1/ClusterRoleBinding':
      load('kubernetes-models/rbac.authorization.k8s.io/v1/ClusterRoleBinding', 'ClusterRoleBinding'),
  'rbac.authorization.k8s.io/v1/Role': load('kubernetes-models/rbac.authorization.k8s.io/v1/Role', 'Role'),
  'rbac.authorization.k8s.io/v1/RoleBinding': load('kubernetes-models/rbac.authorization.k8s.io/v1/RoleBinding', 'RoleBinding'),
  'apiextensions.k8s.io/v1/CustomResourceDefinition':
      load('kubernetes-models/apiextensions.k8s.io/v1/CustomResourceDefinition', 'CustomResourceDefinition'),
  'monitoring.coreos.com/v1/ServiceMonitor': load('@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/ServiceMonitor', 'ServiceMonitor'),
  'monitoring.coreos.com/v1/PodMonitor': load('@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/PodMonitor', 'PodMonitor'),
  'monitoring.coreos.com/v1/PrometheusRule': load('@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/PrometheusRule', 'PrometheusRule'),
};
const counts = {};
let failures = 0;
const objects = fs.statSync(file).isDirectory()
  ? fs.readdirSync(file).sort().map(f => JSON.parse(fs.readFileSync(path.join(file, f), 'utf8')))
  : JSON.parse(fs.readFileSync(file, 'utf8'));
for (const object of objects) {
  const key = `${object.apiVersion}/${object.kind}`;
  const name = object.metadata && object.metadata.name;
  const Model = models[key];
  if (!Model) {
    console.error(`${key} ${name}: no model to validate it with`);
    failures++;
    continue;
  }
  try {
    new Model(object).validate();
    counts[object.kind] = (counts[object.kind] || 0) + 1;
  } catch (e) {
    console.error(`${key} ${name}: ${e.message}`);
    failures++;
  }
}
console.log(`valid: ${JSON.stringify(counts)}; invalid: ${failures}`);
for (const kind of flag === '--require' ? required.split(',') : []) {
  if (!counts[kind]) {
    console.error(`no ${kind} among the objects`);
    failures++;
  }
}
process.exit(failures ? 1 : 0);
