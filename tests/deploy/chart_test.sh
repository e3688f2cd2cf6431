#!/usr/bin/env bash
# Tests of the Helm chart (helm/meshtrain) with the real helm, promtool and the
# kubernetes-models schemas. Usage: chart_test.sh BUILD_DIR TOOLS_DIR CASE
set -euo pipefail
build=$1 tools=$2 case=$3
src=$(cd "$(dirname "$0")/../.." && pwd)
chart=$src/helm/meshtrain
helm=$tools/bin/helm
work=$(mktemp -d /tmp/meshtrain-chart.XXXXXX)
export HOME=$work  # helm's caches and config
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT
trap 'echo "FAIL ($case): line $LINENO: $BASH_COMMAND exited $?" >&2' ERR
fail() { echo "FAIL ($case): $*" >&2; exit 1; }

monitoring_apis=(--api-versions monitoring.coreos.com/v1/ServiceMonitor --api-versions monitoring.coreos.com/v1/PodMonitor
                 --api-versions monitoring.coreos.com/v1/PrometheusRule)
# render NAME [HELM_ARGS...]: helm template into $work/NAME.yaml and, as a JSON array, NAME.json.
render() {
  local name=$1
  shift
  "$helm" template meshtrain "$chart" --namespace meshtrain "$@" >"$work/$name.yaml"
  python3 -c 'import json, sys, yaml
json.dump([d for d in yaml.safe_load_all(open(sys.argv[1])) if d], open(sys.argv[2], "w"))' "$work/$name.yaml" "$work/$name.json"
}
# expect_error SUBSTRING HELM_ARGS...: helm template fails and says SUBSTRING.
expect_error() {
  local want=$1 out
  shift
  out=$("$helm" template meshtrain "$chart" "$@" 2>&1) && fail "helm template $* succeeded"
  [[ $out == *"$want"* ]] || fail "helm template $* failed without saying '$want': $out"
}

case $case in
  lint)
    "$helm" lint --strict "$chart"
    for values in "$src"/examples/helm/*.yaml; do "$helm" lint --strict "$chart" -f "$values"; done
    # What the chart ships is what the repository's sources say.
    cmp "$chart/crds/trainingjobs.meshtrain.dev.yaml" "$src/crds/trainingjobs.meshtrain.dev.yaml" ||
      fail "helm/meshtrain/crds differs from crds/"
    for d in "$src"/dashboards/*.json; do
      cmp "$d" "$chart/files/dashboards/$(basename "$d")" || fail "helm/meshtrain/files/dashboards differs from dashboards/"
    done
    ;;
  render)
    # Every rendered object of every values file passes the Kubernetes and Prometheus
    # Operator schemas; the validator itself rejects a broken object.
    render defaults
    render p5 -f "$src/examples/helm/eks-p5.yaml" "${monitoring_apis[@]}"
    render p4d -f "$src/examples/helm/eks-p4d.yaml"
    render everything --set podDisruptionBudget.enabled=true --set operator.watchNamespace=training \
      --set monitoring.serviceMonitor.enabled=true --set monitoring.podMonitor.enabled=true \
      --set monitoring.prometheusRule.enabled=true --set monitoring.dashboards.enabled=true "${monitoring_apis[@]}"
    for name in defaults p5 p4d everything; do
      node "$src/tests/deploy/validate_manifests.js" "$tools/node_modules" "$work/$name.json" || fail "$name: invalid objects"
    done
    python3 -c 'import json, sys
objects = json.load(open(sys.argv[1]))
for o in objects:
    if o["kind"] == "Deployment": o["spec"]["replicas"] = "two"
json.dump(objects, open(sys.argv[1], "w"))' "$work/defaults.json"
    node "$src/tests/deploy/validate_manifests.js" "$tools/node_modules" "$work/defaults.json" >/dev/null 2>&1 &&
      fail "the validator accepted a Deployment with replicas: two"
    # What the defaults promise: two replicas with leader election, probes, a locked-down container.
    python3 - "$work/everything.json" <<'PY'
import json, sys
objects = json.load(open(sys.argv[1]))
kinds = sorted(o["kind"] for o in objects)
for want in ["ClusterRole", "ClusterRoleBinding", "ConfigMap", "Deployment", "NetworkPolicy", "PodDisruptionBudget",
             "PodMonitor", "PrometheusRule", "Role", "RoleBinding", "Secret", "Service", "ServiceAccount", "ServiceMonitor"]:
    assert want in kinds, f"no {want} rendered: {kinds}"
deployment = next(o for o in objects if o["kind"] == "Deployment")
assert deployment["spec"]["replicas"] == 2, deployment["spec"]["replicas"]
pod = deployment["spec"]["template"]["spec"]
container = pod["containers"][0]
args = container["args"]
for want in ["--leader-elect", "--leader-election-namespace=meshtrain", "--namespace=training",
             "--worker-defaults=/etc/meshtrain-operator/worker-defaults.yaml",
             "--launcher-key-file=/etc/meshtrain-operator-key/key"]:
    assert want in args, f"{want} not in {args}"
# The launcher key: the chart's Secret, 32 random bytes, mounted read-only where the
# operator reads it, its file readable by the operator's group alone.
import base64
secret = next(o for o in objects if o["kind"] == "Secret")
assert secret["metadata"]["name"] == "meshtrain-launcher-key", secret["metadata"]
assert len(base64.b64decode(secret["data"]["key"])) == 32, secret["data"]
volume = next(v for v in pod["volumes"] if v["name"] == "launcher-key")
assert volume["secret"] == {"secretName": "meshtrain-launcher-key", "defaultMode": 0o440,
                            "items": [{"key": "key", "path": "key"}]}, volume
assert {"name": "launcher-key", "mountPath": "/etc/meshtrain-operator-key", "readOnly": True} in container["volumeMounts"]
assert pod["securityContext"]["fsGroup"] == 65532, pod["securityContext"]
assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
sc = container["securityContext"]
assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False, sc
assert sc["capabilities"]["drop"] == ["ALL"], sc
assert pod["securityContext"]["runAsNonRoot"] is True
dashboards = [o for o in objects if o["kind"] == "ConfigMap" and "dashboard" in o["metadata"]["name"]]
assert len(dashboards) == 2 and all(d["metadata"]["labels"].get("grafana_dashboard") == "1" for d in dashboards), dashboards
# Least privilege: Secrets and NetworkPolicies only created (never read), no wildcards,
# and nothing but reads on Nodes.
for role in (o for o in objects if o["kind"] in ("ClusterRole", "Role")):
    for rule in role["rules"]:
        assert "*" not in rule["resources"] and "*" not in rule["verbs"], rule
        if "secrets" in rule["resources"] or "networkpolicies" in rule["resources"]:
            assert rule["resources"] in (["secrets"], ["networkpolicies"]) and rule["verbs"] == ["create"], rule
        if "nodes" in rule["resources"]:
            assert set(rule["verbs"]) == {"get", "list", "watch"}, rule
print(f"ok: {len(objects)} objects: {', '.join(kinds)}")
PY
    ;;
  network-policy)
    # On by default: the operator's own NetworkPolicy, RBAC to create the jobs' ones, and
    # worker defaults that admit the operator's pods to the jobs' metrics and launchers,
    # and the scrapers to their metrics alone.
    render on
    render off --set networkPolicy.enabled=false
    cat >"$work/closed-values.yaml" <<'YAML'
networkPolicy:
  restrictEgress: true
  metricsFrom:
    - namespaceSelector: {matchLabels: {kubernetes.io/metadata.name: monitoring}}
    - ipBlock: {cidr: 10.0.0.0/8}
YAML
    render closed -f "$work/closed-values.yaml"
    for name in on off closed; do
      node "$src/tests/deploy/validate_manifests.js" "$tools/node_modules" "$work/$name.json" || fail "$name: invalid objects"
    done
    python3 - "$work" <<'PY'
import json, sys, yaml
work = sys.argv[1]
def load(name):
    objects = json.load(open(f"{work}/{name}.json"))
    policies = [o for o in objects if o["kind"] == "NetworkPolicy"]
    rules = [r for o in objects if o["kind"] == "ClusterRole" for r in o["rules"]]
    config = next(o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"].endswith("-worker-defaults"))
    return policies, rules, yaml.safe_load(config["data"]["worker-defaults.yaml"])["networkPolicy"]
policies, rules, defaults = load("on")
assert len(policies) == 1, policies
spec = policies[0]["spec"]
assert spec["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "operator", spec
assert spec["ingress"][0] == {"ports": [{"protocol": "TCP", "port": 8081}]}, spec  # health, for the kubelet
assert spec["ingress"][1]["ports"] == [{"protocol": "TCP", "port": 8080}], spec
assert spec["ingress"][1]["from"][0]["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "prometheus"}, spec
assert {"apiGroups": ["networking.k8s.io"], "resources": ["networkpolicies"], "verbs": ["create"]} in rules, rules
assert {"apiGroups": [""], "resources": ["secrets"], "verbs": ["create"]} in rules, rules
assert defaults["enabled"] is True and defaults["restrictEgress"] is False, defaults
# The operator's pods have a selector of their own (the jobs' launcher port admits them
# alone); the scrapers' is the values' metricsFrom, unchanged.
assert defaults["operatorFrom"] == [{
    "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "meshtrain"}},
    "podSelector": {"matchLabels": {"app.kubernetes.io/component": "operator", "app.kubernetes.io/instance": "meshtrain",
                                    "app.kubernetes.io/name": "meshtrain"}}}], defaults
assert defaults["operatorFrom"][0]["podSelector"] == spec["podSelector"], "operatorFrom selects other pods than the operator's"
assert defaults["metricsFrom"] == [{"namespaceSelector": {}, "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}], defaults

policies, rules, defaults = load("off")
assert policies == [], policies
assert not any("networkpolicies" in r["resources"] for r in rules), rules
assert {"apiGroups": [""], "resources": ["secrets"], "verbs": ["create"]} in rules, "the Store key needs its Secret"
assert defaults["enabled"] is False, defaults

policies, rules, defaults = load("closed")
assert defaults["restrictEgress"] is True, defaults
assert [p.get("ipBlock", {}).get("cidr") for p in defaults["metricsFrom"]] == [None, "10.0.0.0/8"], defaults
assert len(defaults["operatorFrom"]) == 1, defaults
assert policies[0]["spec"]["ingress"][1]["from"][1] == {"ipBlock": {"cidr": "10.0.0.0/8"}}, policies
print("ok: network policies on, off, closed")
PY
    # The operator reads what the chart wrote, and a job's policy passes kubernetes-models:
    # the e2e scenario chart-operator creates one from these worker defaults.
    ;;
  bad-values)
    # values.schema.json fails a wrong value with its path, before anything is rendered.
    expect_error "at '/replicaCount': minimum: got -1, want 0" --set replicaCount=-1
    expect_error "at '/operator/workers': got string, want integer" --set operator.workers=four
    expect_error "at '/operator': additional properties 'wrokers' not allowed" --set operator.wrokers=4
    expect_error "at '/monitoring/serviceMonitor/interval'" --set monitoring.serviceMonitor.interval=often
    expect_error "at '/workerDefaults/efaPerInstanceType/p5.48xlarge'" --set workerDefaults.efaPerInstanceType.p5\\.48xlarge=-2
    expect_error "at '/image/pullPolicy'" --set image.pullPolicy=Sometimes
    expect_error "at '/networkPolicy/enabled': got string, want boolean" --set-string networkPolicy.enabled=yes
    expect_error "at '/networkPolicy': additional properties 'egress' not allowed" --set networkPolicy.egress=closed
    expect_error "at '/networkPolicy/metricsFrom/0'" --set 'networkPolicy.metricsFrom[0].podSelecter.x=y'
    expect_error "at '/operator/launcherKey': additional properties 'secret' not allowed" --set operator.launcherKey.secret=mine
    expect_error "at '/operator/checkpointTimeoutSeconds': minimum: got 0, want 1" --set operator.checkpointTimeoutSeconds=0
    expect_error "at '/kueue/enabled': got string, want boolean" --set-string kueue.enabled=true
    expect_error "at '/kueue': additional properties 'queue' not allowed" --set kueue.queue=default
    ;;
  kueue)
    # Least privilege with Kueue: kueue.enabled=true gives the operator exactly read and
    # write on Workloads (namespaced: the ClusterRole's, or the watched namespace's Role),
    # writes to their status, reads of ResourceFlavors and Topologies, and only get on
    # WorkloadPriorityClasses (cluster-scoped: always the ClusterRole's); false gives no
    # Kueue rule at all. No render grants any
    # verb on ClusterQueues or LocalQueues. The resources named are those Kueue's CRDs
    # (tests/data/kueue) serve.
    render off
    render on --set kueue.enabled=true
    render on-watch --set kueue.enabled=true --set operator.watchNamespace=training
    render everything --set kueue.enabled=true --set podDisruptionBudget.enabled=true \
      --set monitoring.serviceMonitor.enabled=true --set monitoring.podMonitor.enabled=true \
      --set monitoring.prometheusRule.enabled=true --set monitoring.dashboards.enabled=true "${monitoring_apis[@]}"
    for name in on on-watch; do
      node "$src/tests/deploy/validate_manifests.js" "$tools/node_modules" "$work/$name.json" || fail "$name: invalid objects"
    done
    python3 - "$work" "$src/tests/data/kueue" <<'PY'
import copy, glob, json, sys, yaml
work, crds = sys.argv[1], sys.argv[2]
KUEUE = "kueue.x-k8s.io"
WANT = {"workloads": {"get", "list", "watch", "create", "update", "delete"},
        "workloads/status": {"get", "update", "patch"},
        "resourceflavors": {"get", "list", "watch"},
        "topologies": {"get", "list", "watch"},
        "workloadpriorityclasses": {"get"}}
CLUSTER_SCOPED = ("resourceflavors", "topologies", "workloadpriorityclasses")
def load(name): return json.load(open(f"{work}/{name}.json"))
def grants(objects, kinds=("ClusterRole", "Role")):
    # Resource -> verbs of the Kueue API group, over every rule of `kinds`.
    out = {}
    for role in (o for o in objects if o["kind"] in kinds):
        for rule in role["rules"]:
            groups = rule.get("apiGroups", [])
            assert "*" not in groups, f"{role['kind']} {role['metadata']['name']}: apiGroups '*': {rule}"
            if KUEUE in groups:
                for r in rule["resources"]: out.setdefault(r, set()).update(rule["verbs"])
    return out
def check(name, enabled):
    objects = load(name)
    granted = grants(objects)
    queues = {r: v for r, v in granted.items() if r.split("/")[0] in ("clusterqueues", "localqueues")}
    assert not queues, f"{name}: verbs on queues: {queues}"
    assert granted == (WANT if enabled else {}), f"{name}: Kueue grants {granted}, want {WANT if enabled else {}}"
    args = next(o for o in objects if o["kind"] == "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert ("--kueue" in args) == enabled, f"{name}: --kueue in {args}"
    assert "--checkpoint-timeout=130" in args, f"{name}: no --checkpoint-timeout=130 in {args}"
    return objects
check("off", False)
check("everything", True)
on = check("on", True)
assert grants(on, ("ClusterRole",)) == WANT, "kueue.enabled in every namespace: not all in the ClusterRole"
watched = check("on-watch", True)
cluster = grants(watched, ("ClusterRole",))
assert cluster == {r: WANT[r] for r in CLUSTER_SCOPED}, f"watchNamespace: ClusterRole grants {cluster}"
role = [o for o in watched if o["kind"] == "Role" and o["metadata"]["namespace"] == "training"]
assert grants(role) == {r: WANT[r] for r in ("workloads", "workloads/status")}, role
# The check itself fails a chart that reads ClusterQueues, writes ResourceFlavors, or lists
# WorkloadPriorityClasses.
for tamper in ({"apiGroups": [KUEUE], "resources": ["clusterqueues"], "verbs": ["get"]},
               {"apiGroups": [KUEUE], "resources": ["resourceflavors"], "verbs": ["update"]},
               {"apiGroups": [KUEUE], "resources": ["workloadpriorityclasses"], "verbs": ["list"]}):
    bad = copy.deepcopy(on)
    next(o for o in bad if o["kind"] == "ClusterRole")["rules"].append(tamper)
    json.dump(bad, open(f"{work}/tampered.json", "w"))
    try:
        check("tampered", True)
    except AssertionError:
        continue
    raise SystemExit(f"the check accepted a ClusterRole with {tamper}")
# Each resource is one that Kueue's CRDs serve at v1beta2, with the status subresource.
served = {}
for path in glob.glob(f"{crds}/*.yaml"):
    crd = yaml.safe_load(open(path))
    for version in crd["spec"]["versions"]:
        if version["name"] == "v1beta2" and version["served"]:
            plural = crd["spec"]["names"]["plural"]
            served[plural] = crd["spec"]["scope"]
            if "status" in version.get("subresources", {}): served[plural + "/status"] = crd["spec"]["scope"]
for resource in WANT:
    assert resource in served, f"{resource}: no CRD in {crds} serves it at {KUEUE}/v1beta2"
assert served["workloads"] == "Namespaced" and all(served[r] == "Cluster" for r in CLUSTER_SCOPED), served
print("ok: Kueue RBAC on (every namespace, one namespace) and off; none on queues")
PY
    ;;
  launcher-key)
    # The chart draws the operator's launcher key, 32 random bytes, at each render without
    # a cluster (helm template); an install keeps the one the cluster holds (e2e
    # helm-install). operator.launcherKey.existingSecret mounts a Secret of one's own, and
    # the chart creates none.
    render first
    render second
    render own --set operator.launcherKey.existingSecret=my-launcher-key
    node "$src/tests/deploy/validate_manifests.js" "$tools/node_modules" "$work/own.json" || fail "own: invalid objects"
    python3 - "$work" <<'PY'
import json, sys
work = sys.argv[1]
def load(name): return json.load(open(f"{work}/{name}.json"))
def key(name): return next(o for o in load(name) if o["kind"] == "Secret")["data"]["key"]
assert key("first") != key("second"), "two renders drew the same key"
own = load("own")
assert not [o for o in own if o["kind"] == "Secret"], "a Secret rendered with existingSecret set"
pod = next(o for o in own if o["kind"] == "Deployment")["spec"]["template"]["spec"]
volume = next(v for v in pod["volumes"] if v["name"] == "launcher-key")
assert volume["secret"]["secretName"] == "my-launcher-key", volume
print("ok: a drawn key per render; existingSecret mounted, none created")
PY
    ;;
  monitoring-crds)
    # A monitoring resource asked for on a cluster without the Prometheus Operator fails
    # the install with the value to change; off by default, nothing monitoring renders.
    for kind in serviceMonitor podMonitor prometheusRule; do
      expect_error "monitoring.$kind.enabled is true, but this cluster has no monitoring.coreos.com/v1" \
        --set "monitoring.$kind.enabled=true"
    done
    render defaults
    ! grep -q "monitoring.coreos.com" "$work/defaults.yaml" || fail "monitoring resources rendered while off"
    ;;
  alerts)
    # The rendered PrometheusRule's groups pass promtool's check and its unit tests.
    render rules --set monitoring.prometheusRule.enabled=true "${monitoring_apis[@]}" --show-only templates/prometheusrule.yaml
    python3 -c 'import json, sys, yaml
rule = json.load(open(sys.argv[1]))[0]
yaml.safe_dump(rule["spec"], open(sys.argv[2], "w"))' "$work/rules.json" "$work/alerts.yaml"
    promtool check rules "$work/alerts.yaml"
    cp "$src/tests/deploy/alerts_test.yaml" "$work/"
    (cd "$work" && promtool test rules alerts_test.yaml)
    node "$src/tests/deploy/dashboards.js" names "$src"/dashboards/*.json "$work/alerts.yaml" -- \
      "$src/worker/metrics/training_metrics.cc" "$src/operator/controller/metrics.cc" "$src/api/worker_contract.h"
    ;;
  *)
    fail "unknown case"
    ;;
esac
echo "ok: $case"
