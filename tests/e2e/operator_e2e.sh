#!/usr/bin/env bash
# End-to-end scenarios for meshtrain-operator: the test API server with its kubelet
# simulator, the real operator as its own process, and the real kubectl.
# Usage: operator_e2e.sh BUILD_DIR TOOLS_DIR SCENARIO
set -euo pipefail
# Pipelines read to the end (no grep -q, no head): with pipefail, a reader that exits first
# fails the pipeline through SIGPIPE in the writer.
build=$1 tools=$2 scenario=$3
src=$(cd "$(dirname "$0")/../.." && pwd)
kubectl=$tools/bin/kubectl
work=$(mktemp -d /tmp/meshtrain-e2e.XXXXXX)
export KUBECONFIG=$work/kubeconfig
# kubectl caches discovery and OpenAPI per host:port under $HOME/.kube/cache; a server of
# an earlier run on the same port must not answer for this one.
export HOME=$work
pids=()
cleanup() {
  # A rank the hang scenario stopped takes no SIGTERM: one that failed the scenario goes here.
  if [ -n "${stopped_rank:-}" ]; then kill -9 "$stopped_rank" 2>/dev/null || true; fi
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  # What does not end within 20 s of SIGTERM is named and killed, so that a process stuck
  # on its way out shows in the log rather than holding the test to ctest's timeout.
  local deadline=$((SECONDS + 20)) p
  for p in "${pids[@]}"; do
    while kill -0 "$p" 2>/dev/null && [ "$SECONDS" -lt "$deadline" ]; do sleep 0.1; done
    if kill -0 "$p" 2>/dev/null; then
      echo "cleanup ($scenario): pid $p did not end within 20 s of SIGTERM, killed: $(tr '\0' ' ' <"/proc/$p/cmdline" 2>/dev/null)" >&2
      kill -9 "$p" 2>/dev/null || true
    fi
  done
  wait 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT
# set -e stops at a failed command without a word; say which one.
trap 'echo "FAIL ($scenario): line $LINENO: $BASH_COMMAND exited $?" >&2' ERR

fail() {
  echo "FAIL ($scenario): $*" >&2
  echo "--- operator log (tail)"; tail -n 30 "$work"/operator*.log >&2 || true
  echo "--- kubectl get tj,pods"; "$kubectl" get tj,pods -o wide >&2 || true
  exit 1
}

start_server() {  # start_server SCRIPT_SECONDS [SERVER_FLAGS...]
  local seconds=${1:-2}
  shift || true
  "$build/tests/support/kube/meshtrain-test-apiserver" --kubeconfig-out "$KUBECONFIG" --port-file "$work/port" \
    --cluster "${cluster:-$src/examples/clusters/eks-p5-124.yaml}" --workdir "$work/pods" --record-dir "$work/record" \
    --script-seconds "$seconds" --bookmark-ms 500 "$@" >"$work/server.log" 2>&1 &
  pids+=($!)
  mkdir -p "$work/record"
  for _ in $(seq 100); do [ -f "$work/port" ] && break; sleep 0.1; done
  [ -f "$work/port" ] || fail "the test API server did not start: $(cat "$work/server.log")"
  "$kubectl" apply -f "$src/crds/" >/dev/null
  operator_account
}

# The operator runs as the Helm chart's ServiceAccount, under the chart's RBAC rules, which
# the test API server enforces: $operator_kubeconfig authenticates with a token issued to it.
# A scenario that installs the chart with helm sets helm_installs=1 before start_server.
operator_kubeconfig=$work/operator-kubeconfig
helm_installs=
chart_set=()  # --set flags of the chart whose RBAC the operator runs under
operator_account() {
  [ -z "$helm_installs" ] || return 0
  post /api/v1/namespaces '{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "meshtrain"}}'
  "$tools/bin/helm" template meshtrain "$src/helm/meshtrain" --namespace meshtrain "${chart_set[@]}" \
    --show-only templates/serviceaccount.yaml --show-only templates/rbac.yaml >"$work/rbac.yaml"
  "$kubectl" apply -f "$work/rbac.yaml" >/dev/null
  account_kubeconfig
}
account_kubeconfig() {  # a token for the meshtrain ServiceAccount, in $operator_kubeconfig
  echo '{"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": {"audiences": []}}' >"$work/token.json"
  "$kubectl" create --raw /api/v1/namespaces/meshtrain/serviceaccounts/meshtrain/token -f "$work/token.json" |
    python3 -c 'import json, sys, yaml
token = json.load(sys.stdin)["status"]["token"]
config = yaml.safe_load(open(sys.argv[1]))
config["users"][0]["user"] = {"token": token}
yaml.safe_dump(config, open(sys.argv[2], "w"))' "$KUBECONFIG" "$operator_kubeconfig"
}

# The operator's key, from which it derives each pod's launcher token; the chart's
# scenarios put the chart's key here (chart_operator_args).
launcher_key=$work/launcher-key
head -c 32 /dev/urandom >"$launcher_key"

# chart_operator_args MANIFEST: the operator's arguments from a rendered chart's Deployment,
# with its worker defaults and its launcher key (the chart's Secret) written beside it,
# less the ports and workers start_operator sets.
chart_operator_args() {
  python3 - "$1" "$work" "$launcher_key" <<'PY'
import base64, sys, yaml
manifest, work, key_file = sys.argv[1:]
docs = [d for d in yaml.safe_load_all(open(manifest)) if d]
deployment = next(d for d in docs if d["kind"] == "Deployment")
config = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-worker-defaults"))
open(f"{work}/worker-defaults.yaml", "w").write(config["data"]["worker-defaults.yaml"])
pod = deployment["spec"]["template"]["spec"]
volume = next(v for v in pod["volumes"] if v["name"] == "launcher-key")
secret = next(d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"] == volume["secret"]["secretName"])
open(key_file, "wb").write(base64.b64decode(secret["data"]["key"]))
args = []
for a in pod["containers"][0]["args"]:
    if a.startswith(("--metrics-port=", "--health-port=", "--workers=")): continue
    if a.startswith("--worker-defaults="): a = f"--worker-defaults={work}/worker-defaults.yaml"
    if a.startswith("--launcher-key-file="): a = f"--launcher-key-file={key_file}"
    args.append(a)
print("\n".join(args))
PY
}

operator_pid=
start_operator() {  # start_operator [FLAGS...]: with $launcher_key, unless FLAGS name a key file
  local n=${#pids[@]} key=(--launcher-key-file "$launcher_key")
  [[ " $* " == *" --launcher-key-file="* ]] && key=()
  "$build/operator/meshtrain-operator" --kubeconfig "$operator_kubeconfig" --metrics-port "${operator_metrics_port:-0}" \
    --health-port 0 --workers 2 "${key[@]}" \
    "$@" >"$work/operator$n.log" 2>&1 &
  operator_pid=$!
  pids+=($operator_pid)
}

# wait_for JSONPATH EXPECTED SECONDS: polls the job until the field has the value.
wait_for() {
  local path=$1 want=$2 seconds=$3 got=
  for _ in $(seq $((seconds * 5))); do
    got=$("$kubectl" get tj tiny -o "jsonpath=$path" 2>/dev/null || true)
    [ "$got" = "$want" ] && return 0
    sleep 0.2
  done
  fail "timed out after ${seconds}s waiting for $path = $want (got '$got')"
}

post() { echo "$2" >"$work/body.json"; "$kubectl" create --raw "$1" -f "$work/body.json" >/dev/null; }
script() { post /_test/kubelet/script "{\"job\": \"tiny\", \"exitCode\": ${2:-0}, \"seconds\": $1}"; }
# A 2-node x 2-rank job of real workers on the bundled corpus.
worker_job() {  # worker_job STEPS [DATA_FILE [EXTRA_SPEC_YAML]]: checkpoints every 20 steps under $work/checkpoints
  apply_job 2 "{train: ${2:-$work/data/train.bin}, validation: $work/data/val.bin}" \
    "{steps: $1, globalBatchTokens: 2048, microBatchSize: 4, warmupSteps: 2, evalInterval: 25, evalBatches: 2}" \
    "    env: [{name: OMP_NUM_THREADS, value: \"1\"}]
  checkpoint: {path: $work/checkpoints, interval: 20}
${3:-}"
}

wait_checkpoint() {  # wait_checkpoint AFTER: until status.progress has a checkpoint step above AFTER (sets $checkpoint)
  checkpoint=
  for _ in $(seq 300); do
    checkpoint=$("$kubectl" get tj tiny -o 'jsonpath={.status.progress.checkpointStep}')
    [ -n "$checkpoint" ] && [ "$checkpoint" -gt "$1" ] && return 0
    sleep 0.2
  done
  fail "no checkpoint after step $1 in status.progress: $("$kubectl" get tj tiny -o yaml | tail -20)"
}

# A gang of real workers (2 pods x 2 ranks, `meshtrain-worker launch`) training until it is
# Running; the operator reads rank 0's progress every second and the launchers every 250 ms.
# The operator's metrics are served on $operator_metrics_port (operator_metric reads them).
run_worker_gang() {  # run_worker_gang [EXTRA_SPEC_YAML [OPERATOR_FLAGS...]]; cluster=FILE picks the cluster
  local extra=${1:-}
  shift || true
  prepare_data
  start_server 2 --kubelet run --worker-binary "$build/worker/meshtrain-worker"
  operator_metrics_port=$(free_ports 1)
  start_operator --progress-interval 1 --launcher-interval 250 "$@"
  worker_job 100000 "" "$extra"
  wait_for '{.status.phase}' Running 20
}

# operator_metric SERIES: the value of one series (name and labels, as exposed) from the
# operator of run_worker_gang; empty when it has none.
# An operator that does not answer prints a sentence, so that empty means "no such series".
operator_metric() {
  local text
  text=$(curl -sf --max-time 5 "http://127.0.0.1:$operator_metrics_port/metrics") || { echo "(no answer)"; return 0; }
  awk -v series="$1" '$1 == series { print $2 }' <<<"$text"
}
# metric_is SERIES VALUE: the operator's SERIES reads VALUE (empty: the series is absent).
metric_is() { [ "$(operator_metric "$1")" = "$2" ]; }
# wait_until SECONDS WHAT COMMAND...: COMMAND succeeds within SECONDS (polled every
# 0.2 s), or the scenario fails saying WHAT.
wait_until() {
  local seconds=$1 what=$2
  shift 2
  for _ in $(seq $((seconds * 5))); do
    "$@" && return 0
    sleep 0.2
  done
  fail "$what"
}
# expect_restarts KIND N: the operator counted N gang restarts of that kind.
expect_restarts() {
  local got
  got=$(operator_metric "meshtrain_operator_gang_restarts_total{kind=\"$1\"}")
  [ "$got" = "$2" ] || fail "meshtrain_operator_gang_restarts_total{kind=\"$1\"} is '$got', not $2"
}

# The job's pods, each as NAME=UID: the same pods after an in-place restart.
uids() { "$kubectl" get pods -l meshtrain.dev/job-name=tiny -o 'jsonpath={range .items[*]}{.metadata.name}={.metadata.uid} {end}'; }
# rank_pid RANK POD: the process of that rank in that pod (its environment says so).
rank_pid() {
  local pod_ip p env
  pod_ip=$("$kubectl" get pod "$2" -o 'jsonpath={.status.podIP}')
  for p in $(pgrep -f "meshtrain-worker train"); do
    env=$(tr '\0' '\n' <"/proc/$p/environ" 2>/dev/null || true)
    if grep -qx "RANK=$1" <<<"$env" && grep -qx "MESHTRAIN_POD_IP=$pod_ip" <<<"$env"; then echo "$p"; return 0; fi
  done
  fail "no process of rank $1 in pod $2 ($pod_ip)"
}

# job_token RANK: node rank RANK's launcher token, from the job's Secret.
job_token() {
  "$kubectl" get secret tiny-secret -o json |
    python3 -c 'import base64, json, sys; print(base64.b64decode(json.load(sys.stdin)["data"]["launcher-token-" + sys.argv[1]]).decode())' "$1"
}
# derived_token UID RANK: the token the operator's key derives for node rank RANK of the job with that uid.
derived_token() {
  python3 -c 'import hmac, sys
key = open(sys.argv[1], "rb").read()
print(hmac.new(key, b"meshtrain launcher token\0" + sys.argv[2].encode() + b"\0" + sys.argv[3].encode(), "sha256").hexdigest())' \
    "$launcher_key" "$1" "$2"
}
# no_token_in_pods: no launcher token of the job is in a pod's spec (its environment
# included), nor in the environment of a process of its pods ($checked_processes counts them).
no_token_in_pods() {
  local t0 t1 pod text p
  checked_processes=0
  t0=$(job_token 0) t1=$(job_token 1)
  [ ${#t0} = 64 ] && [ ${#t1} = 64 ] && [ "$t0" != "$t1" ] || fail "the job's Secret lacks two distinct tokens: '$t0' '$t1'"
  for pod in $("$kubectl" get pods -l meshtrain.dev/job-name=tiny -o name); do
    text=$("$kubectl" get "$pod" -o json)
    [[ $text != *"$t0"* && $text != *"$t1"* ]] || fail "$pod carries a launcher token in its spec"
  done
  for p in $(pgrep -f "meshtrain-worker (launch|train)" || true); do
    text=$(tr '\0' '\n' <"/proc/$p/environ" 2>/dev/null || true)
    grep -qx "MESHTRAIN_JOB_NAME=tiny" <<<"$text" || continue
    [[ $text != *"$t0"* && $text != *"$t1"* ]] || fail "process $p of the job has a launcher token in its environment"
    checked_processes=$((checked_processes + 1))
  done
}
# launcher_stop POD TOKEN: the HTTP status of a stop at attempt 1 sent to POD's launcher with TOKEN.
launcher_stop() {
  local ip
  ip=$("$kubectl" get pod "$1" -o 'jsonpath={.status.podIP}')
  curl -s --max-time 5 -o "$work/stop-answer" -w '%{http_code}' -X POST "http://$ip:9401/attempt/stop?attempt=1&token=$2"
}
launcher_state() {  # launcher_state POD: its launcher's GET /attempt
  curl -s --max-time 5 "http://$("$kubectl" get pod "$1" -o 'jsonpath={.status.podIP}'):9401/attempt"
}

# recovered N: the seconds the Nth Recovered Event gives, once there are N.
recovered() {
  local seconds=
  for _ in $(seq 300); do
    seconds=$("$kubectl" get events -o json | python3 -c 'import json, re, sys
events = sorted((e for e in json.load(sys.stdin)["items"] if e["reason"] == "Recovered"), key=lambda e: e["metadata"]["creationTimestamp"] + e["metadata"]["name"])
n = int(sys.argv[1])
if len(events) >= n: print(re.search(r" ([0-9.]+) s after", events[n - 1]["message"]).group(1))' "$1")
    [ -n "$seconds" ] && { echo "$seconds"; return 0; }
    sleep 0.2
  done
  fail "no Recovered event number $1: $("$kubectl" get events | tail -8)"
}

lose_node() {  # lose_node POD [deleted]: the node POD runs on goes NotReady, or is deleted (sets $lost)
  lost=$("$kubectl" get pod "$1" -o 'jsonpath={.spec.nodeName}')
  if [ "${2:-}" = deleted ]; then
    "$kubectl" get node "$lost" -o json >"$work/lost-node.json"
    "$kubectl" delete node "$lost" >/dev/null
  else
    post /_test/kubelet/node "{\"name\": \"$lost\", \"ready\": false}"
  fi
}
return_node() {  # return_node: the node lose_node took is Ready again; a deleted one joins the cluster anew
  if [ -f "$work/lost-node.json" ]; then
    python3 -c 'import json, sys
node = json.load(open(sys.argv[1]))
for key in ("resourceVersion", "uid", "creationTimestamp"): node["metadata"].pop(key, None)
print(json.dumps(node))' "$work/lost-node.json" >"$work/returning-node.json"
    "$kubectl" create -f "$work/returning-node.json" >/dev/null
    rm "$work/lost-node.json"
  else
    post /_test/kubelet/node "{\"name\": \"$lost\", \"ready\": true}"
  fi
}

prepare_data() {
  mkdir -p "$work/data"
  "$build/cli/meshtrain" prepare-data "$src/examples/data/pride-and-prejudice.txt" "$work/data/train.bin" \
    --validation "$work/data/val.bin" >/dev/null
}

free_ports() {  # N free TCP ports on 127.0.0.1, all different: sockets bound together, then closed
  node -e 'const net = require("net"); const n = Number(process.argv[1]); const servers = [];
    for (let i = 0; i < n; i++) servers.push(net.createServer().listen(0, "127.0.0.1", () => {
      if (servers.every(s => s.address())) { console.log(servers.map(s => s.address().port).join(" ")); servers.forEach(s => s.close()); }
    }));' "$1"
}

# prom_value QUERY: the first sample's value of an instant query, or empty.
prom_value() {
  curl -sf --max-time 5 "http://127.0.0.1:$prom_port/api/v1/query" --data-urlencode "query=$1" |
    node -e 'let s = ""; process.stdin.on("data", d => s += d).on("end", () => {
      const r = JSON.parse(s).data.result; console.log(r.length ? r[0].value[1] : ""); })'
}

# wait_prom QUERY SECONDS: waits until the query has a sample whose value is > 0.
wait_prom() {
  local got=
  for _ in $(seq $(($2 * 2))); do
    got=$(prom_value "$1" || true)
    [ -n "$got" ] && awk "BEGIN { exit !($got > 0) }" && return 0
    sleep 0.5
  done
  fail "Prometheus: '$1' never rose above 0 in ${2}s (last '$got'); targets: $(curl -s "http://127.0.0.1:$prom_port/api/v1/targets")"
}

# wait_progress: until the operator has read a step > 0 from rank 0 (sets $step).
wait_progress() {
  step=
  for _ in $(seq 150); do
    step=$("$kubectl" get tj tiny -o 'jsonpath={.status.progress.step}')
    [ -n "$step" ] && [ "$step" -gt 0 ] && return 0
    sleep 0.2
  done
  fail "no training progress in status: $(pod_log tiny-g0-0)"
}

pod_log() { cat "$work/pods/default_$1/log" 2>/dev/null || true; }

# losses FROM TO < LOG: "STEP LOSS" for each step from FROM to TO that the log prints
# (the last line of a step, should a restart print it twice).
losses() {
  awk -v from="$1" -v to="$2" '
    match($0, /step +[0-9]+\/[0-9]+ \| loss [0-9.]+/) {
      split(substr($0, RSTART, RLENGTH), f, /[ \/|]+/); loss[f[2] + 0] = f[5] }
    END { for (s = from; s <= to; s++) if (s in loss) print s, loss[s] }'
}

# operator_requests VERB: the API requests of that verb the operator has made so far.
operator_requests() {
  "$kubectl" get --raw /_test/stats | node -e 'let s = ""; process.stdin.on("data", d => s += d).on("end", () => {
    console.log(JSON.parse(s).requests["meshtrain-operator '"$1"'"] || 0); })'
}

pod_count() { "$kubectl" get pods -l meshtrain.dev/job-name=tiny -o name | wc -l; }

# apply_job GPUS_PER_NODE DATA TRAINING [EXTRA_YAML]: a 2-node job named tiny; EXTRA_YAML
# continues spec.template (indented 4) or, indented 2, adds to spec.
apply_job() {  # $job_labels, when set, are the job's labels ("key: value, ...")
  cat >"$work/job.yaml" <<YAML
apiVersion: meshtrain.dev/v1alpha1
kind: TrainingJob
metadata:
  name: tiny
  labels: {${job_labels:-}}
spec:
  image: meshtrain:e2e
  nodes: 2
  gpusPerNode: $1
  model: {preset: gpt2-tiny}
  data: $2
  training: $3
  template:
    tolerations: [{key: nvidia.com/gpu, operator: Exists, effect: NoSchedule}]
${4:-}
YAML
  "$kubectl" apply -f "$work/job.yaml" >/dev/null
}

job() {  # job [EXTRA_SPEC_YAML]: the scripted 2-node job
  apply_job 8 "{train: /data/train.bin}" "{steps: 10, globalBatchTokens: 16384, microBatchSize: 1, warmupSteps: 1}" "${1:-}"
}

no_pods() { [ "$(pod_count)" -eq 0 ]; }
# trained_step POD STEP: rank 0's log in POD prints STEP.
trained_step() { [ -n "$(pod_log "$1" | losses "$2" "$2")" ]; }
# event_message REASON: the message of the job's newest Event with that reason; empty without one.
event_message() {
  "$kubectl" get events -o json | python3 -c 'import json, sys
events = sorted((e for e in json.load(sys.stdin)["items"] if e["reason"] == sys.argv[1]), key=lambda e: e["metadata"]["creationTimestamp"] + e["metadata"]["name"])
print(events[-1]["message"] if events else "")' "$1"
}
# stopped_step LOG: the step the ranks stopped after, from rank 0's "rank 0: stopped after step N" in LOG.
stopped_step() { sed -n 's/^rank 0: stopped after step \([0-9]*\) .*/\1/p' "$1" | tail -1; }
# no_step_twice LOG: every step LOG prints, it prints once, and they run from 1 without a gap.
no_step_twice() {
  local twice gaps
  twice=$(grep -oE "step +[0-9]+/[0-9]+ \| loss" "$1" | awk '{ print $2 }' | cut -d/ -f1 | sort -n | uniq -d | tr '\n' ' ')
  [ -z "$twice" ] || fail "steps trained twice: $twice"
  gaps=$(grep -oE "step +[0-9]+/[0-9]+ \| loss" "$1" | awk '{ split($2, s, "/"); if (s[1] != NR) { print NR " is " s[1]; exit } }')
  [ -z "$gaps" ] || fail "the steps printed are not 1, 2, 3, ... ($gaps)"
}
# stop_checkpointed GANG_LOG: the gang stopped after step N with a checkpoint of it (sets $stopped):
# rank 0 says so, the Checkpointed Event quotes it, the step was the last it trained, and the
# checkpoint is on disk.
stop_checkpointed() {
  stopped=$(stopped_step "$1")
  [ -n "$stopped" ] || fail "rank 0 did not say where it stopped: $(tail -5 "$1")"
  # The ranks a launcher told first may be all that asked: any of them, but all stop at once.
  grep -E "^rank 0: stopped after step $stopped \(asked by ranks? [0-9, ]+\); checkpoint of step $stopped written under $work/checkpoints\$" "$1" >/dev/null ||
    fail "rank 0 did not checkpoint the step it stopped after: $(grep 'stopped after' "$1")"
  [[ "$(event_message Checkpointed)" == "the ranks stopped after step $stopped "*"; deleting the pods" ]] ||
    fail "no Checkpointed event for step $stopped: '$(event_message Checkpointed)'"
  [ "$(losses 1 1000000 <"$1" | tail -1 | cut -d' ' -f1)" = "$stopped" ] || fail "rank 0 trained past step $stopped"
  [ -d "$work/checkpoints/$(printf 'step-%08d' "$stopped")" ] || fail "no checkpoint of step $stopped: $(ls "$work/checkpoints")"
  [ "$("$kubectl" get tj tiny -o 'jsonpath={.status.conditions[?(@.type=="Checkpointing")].reason}')" = Checkpointed ] ||
    fail "the Checkpointing condition is not Checkpointed: $("$kubectl" get tj tiny -o 'jsonpath={.status.conditions}')"
}
# resumes_from STEP GANG_LOG_NOW: the new gang resumed from STEP and trained 10 steps past it.
resumes_from() {
  wait_until 60 "the new gang did not resume from step $1: $(pod_log tiny-g0-0 | tail -5)" \
    grep -q "^resumed from step $1 (" "$work/pods/default_tiny-g0-0/log"
  local through=$(($1 + 10))
  wait_until 120 "the resumed gang did not train step $through" trained_step tiny-g0-0 "$through"
}
# reference_losses TO: the losses of steps 1..TO of the same spec run by `meshtrain run` on 4
# ranks, never interrupted (in $reference).
reference_losses() {
  "$kubectl" delete tj tiny >/dev/null  # its pods go, and with them their ranks' CPU time
  sed -e "s#$work/checkpoints#$work/reference-checkpoints#" -e '/labels:/d' "$work/job.yaml" >"$work/reference.yaml"
  OMP_NUM_THREADS=1 "$build/cli/meshtrain" run "$work/reference.yaml" >"$work/reference.log" 2>&1 &
  local run=$!
  pids+=("$run")
  for _ in $(seq 900); do
    [ -n "$(losses "$1" "$1" <"$work/reference.log")" ] && break
    kill -0 "$run" 2>/dev/null || fail "the reference run ended: $(tail -5 "$work/reference.log")"
    sleep 0.2
  done
  kill "$run"
  reference=$(losses 1 "$1" <"$work/reference.log")
  [ "$(wc -l <<<"$reference")" = "$1" ] || fail "the reference run did not reach step $1: $(tail -5 "$work/reference.log")"
}

case $scenario in
  succeeded)
    start_server 4
    start_operator
    job ""
    wait_for '{.status.phase}' Running 20
    wait_for '{.status.readyWorkers}' 2 10
    wait_for '{.status.phase}' Succeeded 20
    header=$("$kubectl" get tj | sed -n 1p)
    for column in NAME PHASE NODES STEP TOKENS/S AGE; do
      [[ $header == *"$column"* ]] || fail "kubectl get tj lacks column $column: $header"
    done
    "$kubectl" get tj tiny | grep "Succeeded" >/dev/null || fail "kubectl get tj does not show the phase"
    [ "$("$kubectl" get tj tiny -o 'jsonpath={.status.placement.nodes[*].nodeRank}')" = "0 1" ] || fail "no placement in status"
    "$kubectl" get events | grep GangCreated >/dev/null || fail "no GangCreated event"
    [ "$("$kubectl" get svc tiny -o 'jsonpath={.spec.clusterIP}')" = None ] || fail "the Service is not headless"
    # The operator's account can do what it did, and no more: reading Secrets is refused.
    token=$(python3 -c 'import sys, yaml; print(yaml.safe_load(open(sys.argv[1]))["users"][0]["user"]["token"])' "$operator_kubeconfig")
    out=$(curl -s --max-time 5 -H "Authorization: Bearer $token" "http://127.0.0.1:$(cat "$work/port")/api/v1/namespaces/default/secrets")
    [[ $out == *'"code":403'* && $out == *'User \"system:serviceaccount:meshtrain:meshtrain\" cannot list resource \"secrets\"'* ]] ||
      fail "the operator's account was not refused Secrets: $out"
    # ... nor the one Secret it created: the job's Store key, 32 random bytes, and each node
    # rank's launcher token, each mounted read-only as a file by the pods that need it, in
    # no env var and not in the ConfigMap.
    out=$(curl -s --max-time 5 -H "Authorization: Bearer $token" "http://127.0.0.1:$(cat "$work/port")/api/v1/namespaces/default/secrets/tiny-secret")
    [[ $out == *'"code":403'* && $out == *'cannot get resource \"secrets\"'* ]] || fail "the operator's account could read its Secret: $out"
    key=$("$kubectl" get secret tiny-secret -o 'jsonpath={.data.key}' | base64 -d | wc -c)
    [ "$key" -eq 32 ] || fail "the Store key holds $key bytes, not 32"
    [ "$("$kubectl" get secret tiny-secret -o 'jsonpath={.metadata.ownerReferences[0].kind}')" = TrainingJob ] ||
      fail "the Secret is not owned by its job"
    for volume in store-key launcher-token; do
      [ "$("$kubectl" get pod tiny-g0-1 -o "jsonpath={.spec.volumes[?(@.name==\"$volume\")].secret.secretName}")" = tiny-secret ] ||
        fail "the pod does not mount the job's Secret as $volume"
      [ "$("$kubectl" get pod tiny-g0-1 -o "jsonpath={.spec.containers[0].volumeMounts[?(@.name==\"$volume\")].readOnly}")" = true ] ||
        fail "$volume is not mounted read-only"
    done
    items=$("$kubectl" get pod tiny-g0-1 -o 'jsonpath={.spec.volumes[?(@.name=="launcher-token")].secret.items[*].key}')
    [ "$items" = launcher-token-1 ] || fail "pod 1 mounts the tokens '$items', not its own alone"
    no_token_in_pods
    # The job's NetworkPolicy: the job's pods admit only each other (the operator ran
    # without the chart's worker defaults, so neither the operator nor scrapers).
    [ "$("$kubectl" get networkpolicy tiny -o 'jsonpath={.spec.ingress[0].from[0].podSelector.matchLabels.meshtrain\.dev/job-name}')" = tiny ] ||
      fail "no NetworkPolicy admitting the job's own pods: $("$kubectl" get networkpolicy -o yaml)"
    [ "$("$kubectl" get networkpolicy tiny -o 'jsonpath={.spec.ingress[*].ports}')" = "" ] ||
      fail "without the chart's worker defaults, the NetworkPolicy admits others on some port: $("$kubectl" get networkpolicy tiny -o yaml)"
    "$kubectl" get cm tiny-config -o 'jsonpath={.data.rank-table\.json}' | grep nodeRank >/dev/null || fail "no rank table"
    node "$src/tests/deploy/validate_manifests.js" "$tools/node_modules" "$work/record" \
      --require Pod,Service,ConfigMap,Secret,NetworkPolicy || fail "kubernetes-models rejected an object"
    # Deleting the job deletes what it owns.
    "$kubectl" delete tj tiny >/dev/null
    [ "$(pod_count)" -eq 0 ] || fail "pods outlived their job"
    "$kubectl" get cm tiny-config >/dev/null 2>&1 && fail "the ConfigMap outlived its job"
    "$kubectl" get secret tiny-secret >/dev/null 2>&1 && fail "the job's Secret outlived its job"
    "$kubectl" get networkpolicy tiny >/dev/null 2>&1 && fail "the NetworkPolicy outlived its job"
    ;;
  kill-pod)
    start_server 60
    start_operator
    job ""
    wait_for '{.status.phase}' Running 20
    script 2
    post /_test/kubelet/kill '{"namespace": "default", "name": "tiny-g0-1", "signal": 9}'
    wait_for '{.status.restarts}' 1 20
    wait_for '{.status.phase}' Succeeded 30
    [ "$("$kubectl" get pods -o name | grep -c tiny-g0-)" -eq 0 ] || fail "pods of the killed gang remain"
    [ "$("$kubectl" get pods -o name | grep -c tiny-g1-)" -eq 2 ] || fail "the restarted gang is not 2 pods"
    "$kubectl" get events | grep PodFailed >/dev/null || fail "no PodFailed event"
    ;;
  operator-restart)
    start_server 6
    start_operator
    job ""
    wait_for '{.status.phase}' Running 20
    kill -9 "$operator_pid"
    start_operator
    wait_for '{.status.phase}' Succeeded 30
    created=$(ls "$work/record" | grep -c '^Pod-' || true)
    [ "$created" -eq 2 ] || fail "the operators created $created pods, not 2"
    [ "$("$kubectl" get tj tiny -o 'jsonpath={.status.restarts}')" = 0 ] || fail "the job restarted"
    ;;
  watch-faults)
    start_server 60
    start_operator
    job ""
    wait_for '{.status.phase}' Running 20
    # Every watch drops, the next ones get 410 Gone, and requests fail for a while.
    post /_test/faults '{"dropWatches": 1, "goneWatches": 6, "serverErrors": 4, "conflicts": 3, "throttles": 2}'
    sleep 1
    script 2
    post /_test/kubelet/kill '{"namespace": "default", "name": "tiny-g0-0", "signal": 9}'
    wait_for '{.status.restarts}' 1 30
    wait_for '{.status.phase}' Succeeded 30
    grep -q "relisting" "$work"/operator*.log || fail "the operator never relisted after 410"
    ;;
  lagging-watch)
    # The pod watch lags 3 s behind the API server, as a watch cache does under load: the
    # gang starts with no restart and no pod deleted (the pods it created are awaited, not
    # taken for deleted ones), and a killed pod restarts it once, each pod deleted once.
    start_server 60
    post /_test/faults '{"watchDelayMs": 3000, "watchDelayResource": "pods"}'
    start_operator
    job ""
    wait_for '{.status.phase}' Running 30
    [ "$("$kubectl" get tj tiny -o 'jsonpath={.status.restarts}')" = 0 ] || fail "a healthy gang was restarted"
    [ "$(operator_requests DELETE)" = 0 ] || fail "the operator deleted pods of a healthy gang"
    script 2
    post /_test/kubelet/kill '{"namespace": "default", "name": "tiny-g0-1", "signal": 9}'
    wait_for '{.status.restarts}' 1 30
    wait_for '{.status.phase}' Succeeded 40
    [ "$("$kubectl" get tj tiny -o 'jsonpath={.status.restarts}')" = 1 ] || fail "one failure restarted the gang more than once"
    deletes=$(operator_requests DELETE)
    [ "$deletes" -eq 2 ] || fail "the operator sent $deletes pod deletes for one restart of a 2-pod gang, not 2"
    ;;
  status-conflict)
    # The status write that records a failed gang conflicts (409) three times: the retries
    # replay no pod delete and no Event.
    start_server 60
    start_operator
    job ""
    wait_for '{.status.phase}' Running 20
    script 2
    deletes_before=$(operator_requests DELETE)
    post /_test/faults '{"conflicts": 3, "conflictPath": "/trainingjobs/tiny/status"}'
    post /_test/kubelet/kill '{"namespace": "default", "name": "tiny-g0-1", "signal": 9}'
    wait_for '{.status.restarts}' 1 20
    wait_for '{.status.phase}' Succeeded 30
    left=$("$kubectl" get --raw /_test/stats | node -e 'let s = ""; process.stdin.on("data", d => s += d).on("end", () => console.log(JSON.parse(s).faultsLeft.conflicts))')
    [ "$left" = 0 ] || fail "$left injected conflicts were never hit: the status write did not conflict"
    deletes=$(( $(operator_requests DELETE) - deletes_before ))
    [ "$deletes" -eq 2 ] || fail "the operator sent $deletes pod deletes for one restart of a 2-pod gang, not 2"
    # One restart, told once, for the reason it happened (a replay would see the pods it
    # had deleted as gone, and tell of a PodDeleted restart too).
    warnings=$("$kubectl" get events -o 'jsonpath={range .items[?(@.type=="Warning")]}{.reason}{" "}{end}')
    [ "$warnings" = "PodFailed " ] || fail "Warning events '$warnings', not one PodFailed: $("$kubectl" get events)"
    n=$("$kubectl" get events -o 'jsonpath={range .items[*]}{.reason}{"\n"}{end}' | grep -c "^Restarting\$" || true)
    [ "$n" -eq 1 ] || fail "$n Restarting events, not 1: $("$kubectl" get events)"
    ;;
  hanging-metrics)
    # Rank-0 metrics endpoints that accept and never answer do not slow other jobs'
    # reconciles: the bench creates jobs before and while 8 such jobs run (4 workers).
    out=$("$build/cli/meshtrain" bench operator --apiserver "$build/tests/support/kube/meshtrain-test-apiserver" \
      --operator "$build/operator/meshtrain-operator" --crd "$src/crds/trainingjobs.meshtrain.dev.yaml" \
      --nodes 200 --jobs 20 --job-nodes 2 --gpus-per-node 8 --hanging-metrics 8 --timeout 60 2>&1) ||
      fail "the bench failed: $out"
    echo "$out"
    medians=$(echo "$out" | sed -n '/all pods created/s/.*median \([0-9.]*\) ms.*/\1/p' | tr '\n' ' ')
    read -r baseline hanging <<<"$medians"
    [ -n "$hanging" ] || fail "no medians in the bench's output"
    # Reading a hanging endpoint used to hold a reconcile worker for up to a second; allow
    # noise, not that.
    awk "BEGIN { exit !($hanging <= 2 * $baseline + 100) }" ||
      fail "with hanging metrics endpoints the median job took $hanging ms, against $baseline ms without"
    ;;
  scale-10k)
    # The 10,000-node bench (README, "meshtrain bench operator"): 1,000 jobs of 8 nodes, one
    # every 50 ms. No healthy gang is restarted (the bench fails otherwise) and every gang's
    # pods are created: the median job's within 250 ms and nine in ten within 1 s, in at
    # most 24 API requests a job and 256 MiB of operator memory (about 150 MiB with the
    # node and pod caches keeping only what their readers use; 460 MiB with whole objects).
    out=$("$build/cli/meshtrain" bench operator --apiserver "$build/tests/support/kube/meshtrain-test-apiserver" \
      --operator "$build/operator/meshtrain-operator" --crd "$src/crds/trainingjobs.meshtrain.dev.yaml" \
      --nodes 10000 --jobs 1000 --job-nodes 8 --timeout 120 2>&1) || fail "the bench failed: $out"
    echo "$out"
    read -r median p90 requests <<<"$(echo "$out" | sed -n \
      's/.*all pods created: median \([0-9.]*\) ms, p90 \([0-9.]*\) ms.*; \([0-9.]*\) API requests per job.*/\1 \2 \3/p')"
    peak=$(echo "$out" | sed -n 's/.*(VmHWM): \([0-9.]*\) MiB.*/\1/p')
    [ -n "$requests" ] && [ -n "$peak" ] || fail "the bench's output lacks its figures"
    awk "BEGIN { exit !($median <= 250 && $p90 <= 1000) }" || fail "median $median ms, p90 $p90 ms: over 250 ms or 1 s"
    awk "BEGIN { exit !($requests <= 24) }" || fail "$requests API requests per job, over 24"
    awk "BEGIN { exit !($peak <= 256) }" || fail "the operator peaked at $peak MiB, over 256 MiB"
    ;;
  chart-operator)
    # The operator as the Helm chart deploys it with examples/helm/eks-p5.yaml: the rendered
    # Deployment's arguments (leader election in the release namespace) and its worker
    # defaults. A job on p5.48xlarge nodes gets 32 EFA interfaces per pod, hugepages, a
    # bounded /dev/shm and the aws-ofi-nccl environment; status.defaults says why.
    start_server 60
    "$tools/bin/helm" template meshtrain "$src/helm/meshtrain" --namespace meshtrain -f "$src/examples/helm/eks-p5.yaml" \
      --api-versions monitoring.coreos.com/v1/ServiceMonitor --api-versions monitoring.coreos.com/v1/PodMonitor \
      --api-versions monitoring.coreos.com/v1/PrometheusRule >"$work/chart.yaml"
    chart_operator_args "$work/chart.yaml" >"$work/args"
    mapfile -t args <"$work/args"
    [[ " ${args[*]} " == *" --leader-elect "* ]] || fail "the rendered Deployment does not elect a leader: ${args[*]}"
    start_operator "${args[@]}"
    apply_job 8 "{train: /data/train.bin}" "{steps: 10, globalBatchTokens: 16384, microBatchSize: 1, warmupSteps: 1}" \
      "    nodeSelector: {node.kubernetes.io/instance-type: p5.48xlarge}"
    wait_for '{.status.phase}' Running 30
    "$kubectl" get lease -n meshtrain meshtrain-operator >/dev/null || fail "no leader Lease in the release namespace"
    limits=$("$kubectl" get pod tiny-g0-0 -o 'jsonpath={.spec.containers[0].resources.limits}')
    [[ $limits == *'"vpc.amazonaws.com/efa":"32"'* && $limits == *'"hugepages-2Mi":"5120Mi"'* ]] ||
      fail "the pod's limits lack the p5 defaults: $limits"
    env=$("$kubectl" get pod tiny-g0-0 -o 'jsonpath={.spec.containers[0].env[*].name}')
    [[ $env == *FI_PROVIDER* && $env == *NCCL_NET* ]] || fail "the pod lacks the aws-ofi-nccl environment: $env"
    [ "$("$kubectl" get pod tiny-g0-0 -o 'jsonpath={.spec.volumes[?(@.name=="dshm")].emptyDir.sizeLimit}')" = 256Gi ] ||
      fail "/dev/shm is not bounded by shmSizeLimit"
    wait_for '{.status.defaults[?(@.field=="spec.resources.efa")].value}' 32 5
    # The job's NetworkPolicy from the chart's values: the operator's pods and Prometheus may
    # reach the metrics port, and only the operator's pods the launcher port. (The test API
    # server enforces no NetworkPolicy: the rules are what is checked.)
    "$kubectl" get networkpolicy tiny -o json | python3 -c '
import json, sys
ingress = json.load(sys.stdin)["spec"]["ingress"]
operator = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "meshtrain"}},
             "podSelector": {"matchLabels": {"app.kubernetes.io/component": "operator",
                                             "app.kubernetes.io/instance": "meshtrain", "app.kubernetes.io/name": "meshtrain"}}}]
prometheus = [{"namespaceSelector": {}, "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}]
def ports(rule): return sorted(p["port"] for p in rule.get("ports", []))
assert ingress[0] == {"from": [{"podSelector": {"matchLabels": {"meshtrain.dev/job-name": "tiny"}}}]}, ingress[0]
launcher = [r for r in ingress if 9401 in ports(r)]
assert [r["from"] for r in launcher] == [operator], f"the launcher port admits {launcher}, not the operator alone"
metrics = [r["from"] for r in ingress if 9400 in ports(r)]
assert metrics == [operator, prometheus], f"the metrics port admits {metrics}"
assert [ports(r) for r in ingress[1:]] == [[9400, 9401], [9400]], ingress
' || fail "the job's NetworkPolicy: $("$kubectl" get networkpolicy tiny -o yaml)"
    node "$src/tests/deploy/validate_manifests.js" "$tools/node_modules" "$work/record" --require NetworkPolicy,Secret ||
      fail "kubernetes-models rejected an object"
    ;;
  helm-install)
    # helm install into the test API server; the operator runs with the installed
    # Deployment's arguments, its launcher key and its ServiceAccount's token, under the
    # installed RBAC, and trains a job of real workers to the end; then helm upgrade, which
    # keeps the launcher key, and helm uninstall, which leaves nothing of the release but
    # the CRD.
    prepare_data
    helm_installs=1
    start_server 2 --kubelet run --worker-binary "$build/worker/meshtrain-worker"
    helm="$tools/bin/helm"
    "$kubectl" create namespace meshtrain >/dev/null
    "$helm" install meshtrain "$src/helm/meshtrain" --namespace meshtrain >"$work/helm.log" || fail "helm install: $(cat "$work/helm.log")"
    "$helm" get manifest meshtrain --namespace meshtrain >"$work/manifest.yaml"
    account_kubeconfig
    mapfile -t args < <(chart_operator_args "$work/manifest.yaml")
    # The operator's launcher key: the chart's Secret, 32 random bytes, which the operator
    # reads from its mount (here, the file chart_operator_args wrote from the release).
    chart_key() { "$kubectl" get secret meshtrain-launcher-key -n meshtrain -o 'jsonpath={.data.key}'; }
    installed_key=$(chart_key)
    [ "$(base64 -d <<<"$installed_key" | wc -c)" = 32 ] || fail "the chart's launcher key is not 32 bytes"
    [ "$(base64 -w0 <"$launcher_key")" = "$installed_key" ] || fail "the operator would not read the installed key"
    start_operator "${args[@]}"
    worker_job 40
    wait_for '{.status.phase}' Succeeded 120
    [ "$(job_token 1)" = "$(derived_token "$("$kubectl" get tj tiny -o 'jsonpath={.metadata.uid}')" 1)" ] ||
      fail "the job's launcher tokens do not derive from the chart's key"
    "$helm" upgrade meshtrain "$src/helm/meshtrain" --namespace meshtrain --set operator.workers=3 >"$work/helm.log" ||
      fail "helm upgrade: $(cat "$work/helm.log")"
    args=$("$kubectl" get deployment meshtrain -n meshtrain -o 'jsonpath={.spec.template.spec.containers[0].args}')
    [[ $args == *--workers=3* ]] || fail "helm upgrade did not change the Deployment: $args"
    # The upgrade keeps the key, and with it every running job's launcher tokens.
    [ "$(chart_key)" = "$installed_key" ] || fail "helm upgrade drew a new launcher key"
    [ "$("$helm" history meshtrain -n meshtrain -o json | python3 -c 'import json, sys; print(len(json.load(sys.stdin)))')" = 2 ] ||
      fail "helm history does not show 2 revisions"
    "$helm" uninstall meshtrain --namespace meshtrain >/dev/null
    left=
    for resource in deployments services configmaps secrets serviceaccounts roles rolebindings clusterroles \
                    clusterrolebindings poddisruptionbudgets; do
      left+=$("$kubectl" get "$resource" -A -l app.kubernetes.io/instance=meshtrain -o name)
      left+=$("$kubectl" get "$resource" -A -l owner=helm -o name)
    done
    [ -z "$left" ] || fail "helm uninstall left: $left"
    "$kubectl" get crd trainingjobs.meshtrain.dev >/dev/null || fail "the CRD went with the release"
    ;;
  kueue)
    # Kueue admission (docs/operator.md, "Kueue") against the test API server's Kueue
    # admission simulator (tests/support/kube/kueue_simulator.h: a ClusterQueue-like quota in
    # nodes, TAS assignments over the nodes in reverse name order), with the chart's RBAC
    # for kueue.enabled.
    chart_set=(--set kueue.enabled=true)
    start_server 60 --kueue --kueue-quota-nodes 0
    "$kubectl" apply -f "$src/tests/data/kueue/" >/dev/null
    # The simulator's flavor (no node labels: the TAS assignment alone says where).
    echo '{"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ResourceFlavor", "metadata": {"name": "default-flavor"}, "spec": {}}' |
      "$kubectl" apply -f - >/dev/null
    start_operator --kueue
    cat >"$work/job.yaml" <<YAML
apiVersion: meshtrain.dev/v1alpha1
kind: TrainingJob
metadata:
  name: tiny
  labels: {kueue.x-k8s.io/queue-name: training}
spec:
  image: meshtrain:e2e
  nodes: 2
  gpusPerNode: 8
  model: {preset: gpt2-tiny}
  data: {train: /data/train.bin}
  training: {steps: 10, globalBatchTokens: 16384, microBatchSize: 1, warmupSteps: 1}
  template:
    tolerations: [{key: nvidia.com/gpu, operator: Exists, effect: NoSchedule}]
YAML
    "$kubectl" apply -f "$work/job.yaml" >/dev/null
    # No quota: the job waits Queued behind its Workload, with no pod.
    wait_for '{.status.phase}' Queued 20
    wl() { "$kubectl" get workloads.kueue.x-k8s.io -o "jsonpath={.items[0]$1}"; }
    [ "$(wl .metadata.ownerReferences[0].kind)" = TrainingJob ] || fail "the Workload is not owned by the job"
    [ "$(wl .metadata.ownerReferences[0].controller)" = true ] || fail "the job is not the Workload's controller"
    [ "$(wl .spec.queueName)" = training ] || fail "the Workload's queue is '$(wl .spec.queueName)'"
    [ "$(wl .spec.podSets[0].count)" = 2 ] || fail "the Workload's PodSet is not 2 pods"
    [ "$(wl .spec.podSets[0].topologyRequest.podIndexLabel)" = meshtrain.dev/node-rank ] ||
      fail "the Workload's PodSet has no podIndexLabel: $(wl .spec.podSets[0])"
    sleep 2
    [ "$(pod_count)" -eq 0 ] || fail "a job without quota has pods"
    [ "$("$kubectl" get tj tiny -o 'jsonpath={.status.phase}')" = Queued ] || fail "the job left Queued without quota"
    # Quota for 2 nodes: admitted, and placed by the TAS assignment in pod-index order.
    post /_test/kueue/quota '{"nodes": 2}'
    wait_for '{.status.phase}' Running 20
    assigned=$(wl '.status.admission.podSetAssignments[0].topologyAssignment.slices[0].valuesPerLevel[0].individual.roots[*]')
    placed=$("$kubectl" get tj tiny -o 'jsonpath={.status.placement.nodes[*].name}')
    bound="$("$kubectl" get pod tiny-g0-0 -o 'jsonpath={.spec.nodeName}') $("$kubectl" get pod tiny-g0-1 -o 'jsonpath={.spec.nodeName}')"
    [ -n "$assigned" ] && [ "$placed" = "$assigned" ] && [ "$bound" = "$assigned" ] ||
      fail "pods are not on the TAS assignment in pod-index order: assigned '$assigned', placed '$placed', bound '$bound'"
    [ "$("$kubectl" get pod tiny-g0-1 -o 'jsonpath={.metadata.labels.kueue\.x-k8s\.io/tas}')" = true ] ||
      fail "the pods lack the TAS label"
    # Evicted (as by a preemption that takes the quota): Queued again, the pods go, and the
    # admission is given back (QuotaReserved=False, Admitted=False, Requeued=True).
    post /_test/kueue/quota '{"nodes": 0}'
    post /_test/kueue/evict '{"namespace": "default", "job": "tiny"}'
    wait_for '{.status.phase}' Queued 20
    [ "$("$kubectl" get tj tiny -o 'jsonpath={.status.conditions[?(@.type=="Queued")].reason}')" = Evicted ] ||
      fail "the Queued condition does not say Evicted: $("$kubectl" get tj tiny -o 'jsonpath={.status.conditions}')"
    for _ in $(seq 50); do [ "$(pod_count)" -eq 0 ] && break; sleep 0.2; done
    [ "$(pod_count)" -eq 0 ] || fail "an evicted job kept its pods"
    for _ in $(seq 50); do [ "$(wl '.status.conditions[?(@.type=="Requeued")].status')" = True ] && break; sleep 0.2; done
    [ "$(wl '.status.conditions[?(@.type=="Requeued")].status')" = True ] || fail "the Workload was not requeued"
    [ "$(wl '.status.conditions[?(@.type=="QuotaReserved")].status')" = False ] || fail "the Workload kept its quota"
    [ "$(wl '.status.conditions[?(@.type=="Admitted")].status')" = False ] || fail "the Workload is still Admitted"
    [ -z "$(wl .status.admission)" ] || fail "the Workload kept its admission: $(wl .status.admission)"
    # Admitted again, it runs to the end, and its Workload is Finished.
    script 2
    post /_test/kueue/quota '{"nodes": 2}'
    wait_for '{.status.phase}' Succeeded 30
    for _ in $(seq 50); do [ "$(wl '.status.conditions[?(@.type=="Finished")].status')" = True ] && break; sleep 0.2; done
    [ "$(wl '.status.conditions[?(@.type=="Finished")].reason')" = Succeeded ] ||
      fail "the Workload is not Finished=True/Succeeded: $(wl .status.conditions)"
    ;;
  invalid)
    start_server 2
    start_operator
    job "  runPolicy: {backoffLimit: 0}"
    sed -i 's/warmupSteps: 1/warmupSteps: 50/' "$work/job.yaml"
    "$kubectl" apply -f "$work/job.yaml" >/dev/null
    wait_for '{.status.phase}' Failed 20
    wait_for '{.status.conditions[?(@.type=="Failed")].reason}' InvalidSpec 5
    msg=$("$kubectl" get tj tiny -o 'jsonpath={.status.conditions[?(@.type=="Failed")].message}')
    [[ $msg == *spec.training.warmupSteps* ]] || fail "the message does not name the field: $msg"
    [ "$(pod_count)" -eq 0 ] || fail "an invalid job got pods"
    # The CRD schema rejects wrong types before the operator sees them.
    sed -i 's/nodes: 2/nodes: two/' "$work/job.yaml"
    out=$("$kubectl" apply -f "$work/job.yaml" 2>&1) && fail "a string for spec.nodes was accepted"
    [[ $out == *spec.nodes* ]] || fail "the schema error does not name spec.nodes: $out"
    ;;
  spec-warnings)
    # Fields the job leaves out get values that fit it, kept in status; fields it sets that
    # have no effect yet get a SpecWarnings condition and one Warning Event.
    start_server 60
    start_operator
    apply_job 8 "{train: /data/train.bin}" "{steps: 10}" \
      "  parallelism: {tensorParallelSeed: 3}
  checkpoint: {path: /checkpoints/tiny}"
    wait_for '{.status.phase}' Running 20
    wait_for '{.status.defaults[?(@.field=="spec.training.warmupSteps")].value}' 1 5
    # 2 nodes x 8 ranks x 8 sequences of 128 tokens is 16384 per micro-step; 32 of them make 524288.
    wait_for '{.status.defaults[?(@.field=="spec.training.globalBatchTokens")].value}' 524288 5
    wait_for '{.status.conditions[?(@.type=="SpecWarnings")].reason}' FieldsWithoutEffect 5
    msg=$("$kubectl" get tj tiny -o 'jsonpath={.status.conditions[?(@.type=="SpecWarnings")].message}')
    [[ $msg == *"spec.parallelism.tensorParallelSeed: has no effect yet"* && $msg != *"spec.checkpoint"* ]] ||
      fail "the SpecWarnings condition should name tensorParallelSeed and only it: $msg"
    generation=$("$kubectl" get tj tiny -o 'jsonpath={.metadata.generation}')
    [ "$("$kubectl" get tj tiny -o 'jsonpath={.status.conditions[?(@.type=="SpecWarnings")].observedGeneration}')" = "$generation" ] ||
      fail "the SpecWarnings condition lacks observedGeneration $generation"
    # The workers get the spec as written, and derive the same values.
    config=$("$kubectl" get cm tiny-config -o 'jsonpath={.data.job\.json}')
    [[ $config == *tensorParallelSeed* && $config != *warmupSteps* ]] || fail "the ConfigMap's spec is not the written one: $config"
    sleep 2  # more reconciles (pods becoming ready, progress polls) must not repeat the Event
    events=$("$kubectl" get events | grep -c FieldsWithoutEffect || true)
    [ "$events" -eq 1 ] || fail "$events FieldsWithoutEffect events, not 1: $("$kubectl" get events)"
    "$kubectl" get events | grep "Warning.*FieldsWithoutEffect" >/dev/null || fail "the event is not a Warning"
    # Without the fields, the condition turns False.
    "$kubectl" patch tj tiny --type merge -p '{"spec": {"parallelism": null, "checkpoint": null}}' >/dev/null
    wait_for '{.status.conditions[?(@.type=="SpecWarnings")].status}' False 20
    ;;
  suspend)
    start_server 60
    start_operator
    job ""
    wait_for '{.status.phase}' Running 20
    "$kubectl" patch tj tiny --type merge -p '{"spec": {"runPolicy": {"suspend": true}}}' >/dev/null
    wait_for '{.status.phase}' Suspended 20
    for _ in $(seq 50); do [ "$(pod_count)" -eq 0 ] && break; sleep 0.2; done
    [ "$(pod_count)" -eq 0 ] || fail "a suspended job kept its pods"
    script 2
    "$kubectl" patch tj tiny --type merge -p '{"spec": {"runPolicy": {"suspend": false}}}' >/dev/null
    wait_for '{.status.phase}' Succeeded 30
    ;;
  suspend-checkpoint)
    # spec.runPolicy.suspend by kubectl patch, mid-run, between two checkpoints: the ranks
    # stop together after one step and checkpoint it (through their launchers), then the
    # pods go; unsuspended, a new gang resumes from that step. The whole loss curve is that
    # of a run never interrupted, and no step is trained twice.
    run_worker_gang
    wait_checkpoint 0
    wait_progress
    until [ "$("$kubectl" get tj tiny -o 'jsonpath={.status.progress.step}')" -gt $((checkpoint + 2)) ]; do sleep 0.2; done
    "$kubectl" patch tj tiny --type merge -p '{"spec": {"runPolicy": {"suspend": true}}}' >/dev/null
    wait_for '{.status.phase}' Suspended 20
    wait_until 60 "a suspended job kept its pods" no_pods
    cp "$work/pods/default_tiny-g0-0/log" "$work/first-gang.log"
    stop_checkpointed "$work/first-gang.log"
    [ "$stopped" -gt "$checkpoint" ] || fail "stopped after step $stopped, not after the checkpoint of step $checkpoint"
    pod_log tiny-g0-1 | grep "attempt 0: suspended; every rank stopped" >/dev/null ||
      fail "pod 1's launcher did not report its ranks stopped: $(pod_log tiny-g0-1 | tail -5)"
    "$kubectl" patch tj tiny --type merge -p '{"spec": {"runPolicy": {"suspend": false}}}' >/dev/null
    wait_for '{.status.phase}' Running 30
    resumes_from "$stopped"
    [ "$("$kubectl" get tj tiny -o 'jsonpath={.status.restarts}')" = 0 ] || fail "a suspension counted as a restart"
    through=$((stopped + 10))
    pod_log tiny-g0-0 >"$work/both-gangs.log"
    no_step_twice "$work/both-gangs.log"
    ours=$(losses 1 "$through" <"$work/both-gangs.log")
    reference_losses "$through"
    [ "$ours" = "$reference" ] ||
      fail "the suspended run's losses differ from an uninterrupted run's: $(diff <(echo "$ours") <(echo "$reference") | head -8)"
    echo "suspended after step $stopped (checkpoint interval 20, last interval checkpoint $checkpoint), resumed from it;" \
      "steps 1..$through: losses equal to an uninterrupted run's, none trained twice"
    ;;
  kueue-preempt)
    # A Workload of higher priority preempts the job's (the Kueue simulator's preemption):
    # the job's ranks checkpoint the step they stop after, it is Queued, its admission is
    # given back, and once the other Workload is gone it is admitted again and resumes from
    # that step: no step is lost, none is trained twice. The job's own priority comes from
    # its kueue.x-k8s.io/priority-class label, the WorkloadPriorityClass "batch" (10).
    chart_set=(--set kueue.enabled=true)
    prepare_data
    start_server 2 --kubelet run --worker-binary "$build/worker/meshtrain-worker" --kueue --kueue-quota-nodes 2
    "$kubectl" apply -f "$src/tests/data/kueue/" >/dev/null
    echo '{"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ResourceFlavor", "metadata": {"name": "default-flavor"}, "spec": {}}' |
      "$kubectl" apply -f - >/dev/null
    echo '{"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "WorkloadPriorityClass", "metadata": {"name": "batch"}, "value": 10}' |
      "$kubectl" apply -f - >/dev/null
    operator_metrics_port=$(free_ports 1)
    start_operator --kueue --progress-interval 1 --launcher-interval 250
    job_labels="kueue.x-k8s.io/queue-name: training, kueue.x-k8s.io/priority-class: batch" worker_job 100000
    wait_for '{.status.phase}' Running 30
    workload=$("$kubectl" get workloads.kueue.x-k8s.io -l meshtrain.dev/job-name=tiny -o 'jsonpath={.items[0].spec.priority}/{.items[0].spec.priorityClassRef.name}')
    [ "$workload" = "10/batch" ] || fail "the job's Workload has priority/class '$workload', not 10/batch"
    wait_checkpoint 0
    until [ "$("$kubectl" get tj tiny -o 'jsonpath={.status.progress.step}')" -gt $((checkpoint + 2)) ]; do sleep 0.2; done
    seen=$("$kubectl" get tj tiny -o 'jsonpath={.status.progress.step}')
    cat >"$work/urgent.yaml" <<YAML
apiVersion: kueue.x-k8s.io/v1beta2
kind: Workload
metadata: {name: urgent, namespace: default}
spec:
  queueName: training
  priority: 100
  podSets:
    - name: main
      count: 2
      template:
        spec:
          containers: [{name: main, image: urgent:1, resources: {requests: {nvidia.com/gpu: "8"}}}]
YAML
    "$kubectl" apply -f "$work/urgent.yaml" >/dev/null
    wait_for '{.status.phase}' Queued 20
    [ "$("$kubectl" get tj tiny -o 'jsonpath={.status.conditions[?(@.type=="Queued")].reason}')" = Evicted ] ||
      fail "the Queued condition does not say Evicted: $("$kubectl" get tj tiny -o 'jsonpath={.status.conditions}')"
    [[ "$("$kubectl" get tj tiny -o 'jsonpath={.status.conditions[?(@.type=="Queued")].message}')" == *"default/urgent, priority 100"* ]] ||
      fail "the eviction does not name the Workload that preempted it"
    wait_until 60 "an evicted job kept its pods" no_pods
    cp "$work/pods/default_tiny-g0-0/log" "$work/first-gang.log"
    stop_checkpointed "$work/first-gang.log"
    [ "$stopped" -ge "$seen" ] || fail "stopped after step $stopped, before step $seen that it had trained"
    urgent() { "$kubectl" get workloads.kueue.x-k8s.io urgent -o "jsonpath={.status.conditions[?(@.type==\"$1\")].status}"; }
    urgent_admitted() { [ "$(urgent Admitted)" = True ]; }
    wait_until 20 "the urgent Workload was not admitted once the job gave its quota back" urgent_admitted
    sleep 2
    [ "$("$kubectl" get tj tiny -o 'jsonpath={.status.phase}')" = Queued ] || fail "the job left Queued while preempted"
    "$kubectl" delete workloads.kueue.x-k8s.io urgent >/dev/null
    wait_for '{.status.phase}' Running 30
    resumes_from "$stopped"
    pod_log tiny-g0-0 >"$work/both-gangs.log"
    no_step_twice "$work/both-gangs.log"
    echo "preempted after step $seen was read, stopped after step $stopped with a checkpoint of it, resumed from it"
    ;;
  deadline)
    start_server 60
    start_operator
    job "  runPolicy: {activeDeadlineSeconds: 3}"
    wait_for '{.status.phase}' Running 20
    wait_for '{.status.phase}' Failed 20
    wait_for '{.status.conditions[?(@.type=="Failed")].reason}' DeadlineExceeded 5
    for _ in $(seq 50); do [ "$(pod_count)" -eq 0 ] && break; sleep 0.2; done
    [ "$(pod_count)" -eq 0 ] || fail "pods outlived the deadline (cleanPodPolicy Running)"
    ;;
  node-not-ready)
    start_server 60
    start_operator
    job ""
    wait_for '{.status.phase}' Running 20
    node=$("$kubectl" get pod tiny-g0-1 -o 'jsonpath={.spec.nodeName}')
    script 2
    post /_test/kubelet/node "{\"name\": \"$node\", \"ready\": false}"
    wait_for '{.status.restarts}' 1 20
    wait_for '{.status.phase}' Succeeded 30
    for n in $("$kubectl" get tj tiny -o 'jsonpath={.status.placement.nodes[*].name}'); do
      [ "$n" != "$node" ] || fail "the restarted gang was placed on NotReady node $node"
    done
    ;;
  store-strangers)
    # Real workers whose Store key comes from the job's Secret. While the first job trains,
    # strangers try rank 0's Store: each is refused and logged, and the job ends with the
    # losses of a second, identical job that saw none of them.
    prepare_data
    start_server 2 --kubelet run --worker-binary "$build/worker/meshtrain-worker"
    start_operator
    losses() { grep -o 'step *[0-9]*/[0-9]* | loss [0-9.]* | lr [^|]*| norm [0-9.]*' "$1"; }
    worker_job 16
    rank0=$work/pods/default_tiny-g0-0
    for _ in $(seq 600); do grep 'step *1/' "$rank0/log" >/dev/null 2>&1 && break; sleep 0.1; done
    grep 'step *1/' "$rank0/log" >/dev/null || fail "the first job did not train: $(tail -5 "$rank0/log")"
    address=$("$kubectl" get pod tiny-g0-0 -o 'jsonpath={.status.podIP}'):29500
    # The key, from the pod's mount, serves only to record a handshake to replay.
    "$build/tests/support/meshtrain-store-intruder" "$address" "$rank0/etc/meshtrain-store/key" >"$work/intruder.log" ||
      fail "a stranger was not refused: $(cat "$work/intruder.log")"
    cat "$work/intruder.log"
    wait_for '{.status.phase}' Succeeded 120
    refusals=$(grep -c "meshtrain store: refused " "$rank0/log" || true)
    [ "$refusals" -eq 5 ] || fail "rank 0 logged $refusals refusals, not 5: $(grep store "$rank0/log")"
    grep "admits any client" "$rank0/log" >/dev/null && fail "rank 0 ran its Store without the job's key"
    losses "$rank0/log" >"$work/intruded.losses"
    "$kubectl" delete tj tiny >/dev/null
    for _ in $(seq 100); do [ "$(pod_count)" -eq 0 ] && break; sleep 0.2; done
    mv "$rank0" "$work/intruded-rank0"
    rm -rf "$work/checkpoints"
    worker_job 16
    wait_for '{.status.phase}' Succeeded 120
    losses "$rank0/log" >"$work/quiet.losses"
    [ "$(wc -l <"$work/quiet.losses")" -eq 16 ] || fail "the quiet job printed $(wc -l <"$work/quiet.losses") steps, not 16"
    diff "$work/quiet.losses" "$work/intruded.losses" || fail "the job with strangers trained differently"
    ;;
  real-workers)
    # The pods run meshtrain-worker launch: 2 ranks each, rendezvous at pod 0 through the
    # simulated DNS name, shm inside a pod and tcp between pods, metrics read by the operator.
    prepare_data
    start_server 2 --kubelet run --worker-binary "$build/worker/meshtrain-worker"
    start_operator --progress-interval 1
    worker_job 200
    wait_for '{.status.phase}' Running 20
    wait_progress
    row=$("$kubectl" get tj tiny --no-headers)
    [[ $row =~ Running\ +2\ +[0-9]+\ +[0-9] ]] || fail "kubectl get tj shows no step and tokens/s: $row"
    loss=$("$kubectl" get tj tiny -o 'jsonpath={.status.progress.loss}')
    [ -n "$loss" ] || fail "no loss in status.progress"
    pod_log tiny-g0-0 | grep "launching ranks 0..1" >/dev/null || fail "pod 0 did not launch ranks 0..1"
    pod_log tiny-g0-1 | grep "launching ranks 2..3" >/dev/null || fail "pod 1 did not launch ranks 2..3"
    # Once a checkpoint is written, a dead pod restarts the whole gang, which resumes
    # from it and trains to the end; status and an Event say where it resumed.
    checkpoint=
    for _ in $(seq 300); do
      checkpoint=$("$kubectl" get tj tiny -o 'jsonpath={.status.progress.checkpointStep}')
      [ -n "$checkpoint" ] && break
      sleep 0.2
    done
    [ -n "$checkpoint" ] || fail "no checkpoint step in status.progress: $(pod_log tiny-g0-0 | tail -3)"
    post /_test/kubelet/kill '{"namespace": "default", "name": "tiny-g0-1", "signal": 9}'
    # The new gang's number: pod 0's launcher may report its ranks' failure before the
    # dead pod is seen, which first restarts in place and then recreates.
    gang=
    for _ in $(seq 100); do
      gang=$("$kubectl" get tj tiny -o 'jsonpath={.status.gang}')
      [ -n "$gang" ] && [ "$gang" -ge 1 ] && break
      sleep 0.2
    done
    [ -n "$gang" ] && [ "$gang" -ge 1 ] || fail "the gang was not recreated (status.gang '$gang')"
    for _ in $(seq 300); do
      resumed=$("$kubectl" get tj tiny -o 'jsonpath={.status.progress.resumedFromStep}')
      [ -n "$resumed" ] && break
      sleep 0.2
    done
    [ -n "$resumed" ] && [ "$resumed" -ge "$checkpoint" ] ||
      fail "status.progress.resumedFromStep is '$resumed' after a checkpoint of step $checkpoint"
    pod_log tiny-g$gang-0 | grep "resumed from step $resumed (" >/dev/null || fail "rank 0 does not say it resumed"
    "$kubectl" get events | grep -E "Resumed.*resumed from the checkpoint of step $resumed" >/dev/null ||
      fail "no Resumed event: $("$kubectl" get events | tail -5)"
    wait_for '{.status.phase}' Succeeded 120
    pod_log tiny-g$gang-0 | grep "step   200/200" >/dev/null || fail "the restarted gang did not train to the end: $(pod_log tiny-g$gang-0 | tail -5)"
    val=$(pod_log tiny-g$gang-0 | sed -n 's/.*step   200.*val loss \([0-9.]*\).*/\1/p')
    awk "BEGIN { exit !($val < 3.0) }" || fail "validation loss $val after 200 steps: the workers did not learn"
    echo "progress seen: step $step, loss $loss; resumed from step $resumed; final validation loss $val"
    ;;
  in-place)
    # kill -9 of one rank mid-run: the pods stay (same UIDs), every launcher stops its ranks
    # and starts the next attempt together, and the gang resumes from its checkpoint. Then
    # a killed pod takes today's path, a recreated gang, in the same run: the seconds from
    # failure to the first step after it, for both, and their ratio.
    run_worker_gang
    wait_checkpoint 0
    before=$(uids)
    # Each pod's token reaches it only as a file of the job's Secret: its own, and no other.
    no_token_in_pods
    [ "$checked_processes" -ge 6 ] || fail "only $checked_processes processes of the job were checked, not its 2 launchers and 4 ranks"
    for rank in 0 1; do
      mounted=$work/pods/default_tiny-g0-$rank/etc/meshtrain-launcher
      [ "$(ls "$mounted")" = token ] || fail "pod $rank's token volume holds '$(ls "$mounted")', not its token alone"
      [ "$(cat "$mounted/token")" = "$(job_token $rank)" ] || fail "pod $rank mounts another token than its node rank's"
      [ "$(ls "$work/pods/default_tiny-g0-$rank/etc/meshtrain-store")" = key ] || fail "pod $rank's Store key volume holds more than the key"
    done
    # A stop with another pod's token, or with another job's (the token the operator's key
    # derives for another uid), is refused and changes nothing.
    uid=$("$kubectl" get tj tiny -o 'jsonpath={.metadata.uid}')
    [ "$(derived_token "$uid" 1)" = "$(job_token 1)" ] || fail "the Secret does not hold the token the operator's key derives"
    running=$(launcher_state tiny-g0-1)
    [ "$running" = '{"attempt":0,"state":"running"}' ] || fail "pod 1's launcher is not running attempt 0: $running"
    for token in "$(job_token 0)" "$(derived_token "other-$uid" 1)"; do
      code=$(launcher_stop tiny-g0-1 "$token")
      [ "$code" = 403 ] || fail "a stop with another pod's or job's token was answered $code: $(cat "$work/stop-answer")"
    done
    [ "$(launcher_state tiny-g0-1)" = "$running" ] || fail "a refused stop changed the launcher: $(launcher_state tiny-g0-1)"
    pod_log tiny-g0-1 | grep "stopping ranks" >/dev/null && fail "a refused stop stopped pod 1's ranks"
    [ "$("$kubectl" get tj tiny -o 'jsonpath={.status.restarts}')" = 0 ] || fail "a refused stop restarted the job"
    kill -9 "$(rank_pid 3 tiny-g0-1)"
    wait_for '{.status.restarts}' 1 20
    in_place=$(recovered 1)
    expect_restarts in_place 1
    [ "$(uids)" = "$before" ] || fail "the pods changed in an in-place restart: '$before' -> '$(uids)'"
    "$kubectl" get events | grep -E "Restarted.*rank 3 in pod tiny-g0-1 .* failed with exit code 137; restarting the gang in place: attempt 1" >/dev/null ||
      fail "no Restarted event that says in place: $("$kubectl" get events | tail -8)"
    resumed=$("$kubectl" get tj tiny -o 'jsonpath={.status.progress.resumedFromStep}')
    [ -n "$resumed" ] && [ "$resumed" -ge "$checkpoint" ] || fail "resumed from '$resumed', not the checkpoint of step $checkpoint"
    pod_log tiny-g0-1 | grep "attempt 1: starting ranks 2..3" >/dev/null || fail "pod 1's launcher did not start attempt 1: $(pod_log tiny-g0-1 | tail -5)"
    pod_log tiny-g0-0 | grep "resumed from step $resumed (" >/dev/null || fail "rank 0 does not say it resumed"

    # Today's path: the whole pod dies, and the gang is recreated.
    wait_checkpoint "$resumed"
    post /_test/kubelet/kill '{"namespace": "default", "name": "tiny-g0-1", "signal": 9}'
    recreated=$(recovered 2)
    [ "$(uids)" != "$before" ] || fail "a killed pod did not recreate the gang"
    "$kubectl" get events | grep -E "PodFailed.*tiny-g0-1.*restarting the gang" >/dev/null ||
      fail "no PodFailed restart: $("$kubectl" get events | tail -8)"
    expect_restarts recreated 1
    expect_restarts in_place 1
    [ "$(operator_metric meshtrain_operator_recovery_seconds_count)" = 2 ] ||
      fail "the recovery histogram holds '$(operator_metric meshtrain_operator_recovery_seconds_count)' recoveries, not 2"
    ratio=$(awk "BEGIN { printf \"%.3f\", $in_place / $recreated }")
    echo "recovery: in place $in_place s, recreated $recreated s, ratio $ratio (from the Recovered events)"
    # The simulator starts a pod at once (no scheduling, sandbox or image pull), so the two
    # differ here only by the launchers' stop and start; that must stay small.
    awk "BEGIN { exit !($in_place <= 1.5 * $recreated + 1) }" ||
      fail "an in-place restart ($in_place s) took much longer than recreating the gang ($recreated s)"

    # A restarted operator derives the same tokens from its key: it still restarts the new
    # gang in place.
    kill -9 "$operator_pid"
    operator_metrics_port=$(free_ports 1)
    start_operator --progress-interval 1 --launcher-interval 250
    wait_for '{.status.phase}' Running 30
    gang=$("$kubectl" get tj tiny -o 'jsonpath={.status.gang}')
    restarts=$("$kubectl" get tj tiny -o 'jsonpath={.status.restarts}')
    before=$(uids)
    kill -9 "$(rank_pid 3 "tiny-g$gang-1")"
    wait_for '{.status.restarts}' $((restarts + 1)) 20
    "$kubectl" get events | grep -E "Restarted.*rank 3 in pod tiny-g$gang-1 .* restarting the gang in place: attempt $((restarts + 1))" >/dev/null ||
      fail "the restarted operator did not restart the gang in place: $("$kubectl" get events | tail -8)"
    wait_for '{.status.phase}' Running 30
    [ "$(uids)" = "$before" ] || fail "the pods changed in an in-place restart by the restarted operator: '$before' -> '$(uids)'"
    pod_log "tiny-g$gang-1" | grep "attempt $((restarts + 1)): starting ranks 2..3" >/dev/null ||
      fail "pod 1's launcher did not start attempt $((restarts + 1)): $(pod_log "tiny-g$gang-1" | tail -5)"
    expect_restarts in_place 1
    ;;
  hang)
    # SIGSTOP of one rank under the operator: it neither dies nor answers. Rank 0's watchdog
    # sees its heartbeat stop within spec.runPolicy.hangTimeoutSeconds, names it and ends
    # the attempt (exit 75); the Restarted Event quotes rank 0's words, so it names the
    # stuck rank, and the gang restarts in place (the launcher wakes the stopped rank to
    # take its SIGTERM) and trains on from its checkpoint.
    run_worker_gang "  runPolicy: {hangTimeoutSeconds: 3}"
    wait_checkpoint 0
    before=$(uids)
    victim=$(rank_pid 2 tiny-g0-1)
    stopped_at=$(date +%s.%N)
    kill -STOP "$victim"
    stopped_rank=$victim
    wait_for '{.status.restarts}' 1 20
    restarted_at=$(date +%s.%N)
    detected=$(awk "BEGIN { printf \"%.1f\", $restarted_at - $stopped_at }")
    # The timeout, a heartbeat interval, and the operator's reading of the launchers (250 ms),
    # with room for a busy machine.
    awk "BEGIN { exit !($detected <= 3 + 4) }" || fail "the stopped rank was found after $detected s; the timeout is 3 s"
    "$kubectl" get events | grep -E "Restarted.*rank 0 in pod tiny-g0-0 on node [^ ]+ failed with exit code 75: rank 2 made no progress for [0-9.]+ s \(its heartbeat stopped: stopped or hung\); restarting the gang in place: attempt 1" >/dev/null ||
      fail "no Restarted event that names the stuck rank 2: $("$kubectl" get events | grep Restarted)"
    [ "$(uids)" = "$before" ] || fail "the pods changed in an in-place restart"
    recovery=$(recovered 1)
    kill -0 "$victim" 2>/dev/null && fail "the stopped rank $victim outlived its attempt"
    stopped_rank=
    resumed=$("$kubectl" get tj tiny -o 'jsonpath={.status.progress.resumedFromStep}')
    [ -n "$resumed" ] && [ "$resumed" -ge "$checkpoint" ] || fail "resumed from '$resumed', not the checkpoint of step $checkpoint"
    expect_restarts in_place 1
    echo "rank 2 stopped: named and the gang restarted $detected s later (timeout 3 s); it trained again $recovery s after the failure"
    ;;
  restart-budget)
    # The budget of restarts is status alone: an operator restarted with no memory, in a
    # cluster that has since lost the failed pods and every Event about them (Events expire
    # after an hour; terminated pods are collected), counts on from status.failures, and
    # the failure past backoffLimit fails the job.
    start_server 60
    start_operator
    job "  runPolicy: {backoffLimit: 1}"
    wait_for '{.status.phase}' Running 20
    post /_test/kubelet/kill '{"namespace": "default", "name": "tiny-g0-1", "signal": 9}'
    wait_for '{.status.failures}' 1 20
    wait_for '{.status.gang}' 1 20
    for _ in $(seq 100); do
      [ -z "$("$kubectl" get pods -o name | grep tiny-g0- || true)" ] && break
      sleep 0.2
    done
    kill -9 "$operator_pid"
    # What is left of the failure is status: no pod of the failed gang, and no Event.
    [ -z "$("$kubectl" get pods -o name | grep tiny-g0- || true)" ] || fail "pods of the failed gang remain"
    "$kubectl" delete events --all >/dev/null
    [ -z "$("$kubectl" get events -o name)" ] || fail "Events remain: $("$kubectl" get events)"
    start_operator
    wait_for '{.status.phase}' Running 30
    [ "$("$kubectl" get tj tiny -o 'jsonpath={.status.failures}')" = 1 ] || fail "the new operator changed status.failures"
    gang=$("$kubectl" get tj tiny -o 'jsonpath={.status.gang}')
    post /_test/kubelet/kill "{\"namespace\": \"default\", \"name\": \"tiny-g$gang-0\", \"signal\": 9}"
    wait_for '{.status.phase}' Failed 20
    reason=$("$kubectl" get tj tiny -o 'jsonpath={.status.conditions[?(@.type=="Failed")].reason}')
    [ "$reason" = BackoffLimitExceeded ] || fail "the job failed for '$reason', not BackoffLimitExceeded"
    message=$("$kubectl" get tj tiny -o 'jsonpath={.status.conditions[?(@.type=="Failed")].message}')
    [[ $message == *"the gang already failed and restarted 1 times (backoffLimit 1)"* ]] ||
      fail "the Failed condition does not count from status: $message"
    "$kubectl" get events | grep -E "Failed.*the gang already failed and restarted 1 times \(backoffLimit 1\)" >/dev/null ||
      fail "no Event says the job failed past its backoffLimit: $("$kubectl" get events)"
    [ "$("$kubectl" get tj tiny -o 'jsonpath={.status.failures}')" = 1 ] || fail "status.failures changed past the limit"
    [ "$("$kubectl" get tj tiny -o 'jsonpath={.status.restarts}')" = 1 ] || fail "the job restarted past its backoffLimit"
    ;;
  replace-node)
    # A node of a running gang is deleted and the cluster has spare nodes: its pod moves to the
    # free node nearest it, held at the next attempt, the other pod stays (same UID) and
    # restarts in place, and together they resume from the checkpoint.
    run_worker_gang
    wait_checkpoint 0
    uid() { "$kubectl" get pod "$1" -o 'jsonpath={.metadata.uid}'; }
    stayed=$(uid tiny-g0-0)
    lost_at=$checkpoint
    lose_node tiny-g0-1 deleted
    wait_for '{.status.restarts}' 1 20
    "$kubectl" get events | grep -E "Restarted.*node $lost of pod tiny-g0-1 is gone; its node rank 1 moves to node [^ ]+ \(in [^)]+\) and the other pods restart in place: attempt 1" >/dev/null ||
      fail "no Restarted event that says the pod moves: $("$kubectl" get events | tail -8)"
    wait_for '{.status.phase}' Running 40
    wait_checkpoint "$checkpoint"  # the gang trains on and checkpoints again
    [ "$(uid tiny-g0-0)" = "$stayed" ] || fail "pod tiny-g0-0 was recreated; it should have restarted in place"
    [ "$("$kubectl" get pods -l meshtrain.dev/job-name=tiny -o name | sort | tr '\n' ' ')" = "pod/tiny-g0-0 pod/tiny-g0-1-a1 " ] ||
      fail "the gang's pods are $("$kubectl" get pods -o name | tr '\n' ' ')"
    moved_to=$("$kubectl" get pod tiny-g0-1-a1 -o 'jsonpath={.spec.nodeName}')
    [ -n "$moved_to" ] && [ "$moved_to" != "$lost" ] || fail "the replacement pod is on '$moved_to'"
    [ "$("$kubectl" get tj tiny -o 'jsonpath={.status.placement.nodes[1].name}')" = "$moved_to" ] ||
      fail "status.placement does not name the replacement node $moved_to"
    [ "$("$kubectl" get tj tiny -o 'jsonpath={.status.gang}')" = 0 ] || fail "the gang was renumbered"
    # No kubelet confirms the end of a pod on a lost node: it is deleted at once.
    [ "$(operator_requests DELETE-force)" -ge 1 ] || fail "the lost pod was not deleted with gracePeriodSeconds 0"
    "$kubectl" get cm tiny-config -o 'jsonpath={.data.rank-table\.json}' | grep "\"$moved_to\"" >/dev/null ||
      fail "the ConfigMap's rank table does not name $moved_to"
    pod_log tiny-g0-1-a1 | grep "attempt 1: ready; waiting for the operator's start" >/dev/null ||
      fail "the replacement's launcher did not start held: $(pod_log tiny-g0-1-a1 | tail -5)"
    pod_log tiny-g0-0 | grep "attempt 1: starting ranks 0..1" >/dev/null || fail "pod 0's launcher did not start attempt 1"
    resumed=$("$kubectl" get tj tiny -o 'jsonpath={.status.progress.resumedFromStep}')
    [ -n "$resumed" ] && [ "$resumed" -ge "$lost_at" ] || fail "resumed from '$resumed', not the checkpoint of step $lost_at"
    pod_log tiny-g0-0 | grep "resumed from step $resumed (" >/dev/null || fail "rank 0 does not say it resumed"
    recovery=$("$kubectl" get events | grep -oE "Recovered .* ([0-9.]+) s after" | grep -oE "[0-9.]+ s after" | head -1)
    [ -n "$recovery" ] || fail "no Recovered event: $("$kubectl" get events | tail -8)"
    expect_restarts replaced 1
    expect_restarts recreated 0
    echo "node $lost lost: pod 1 moved to $moved_to, pod 0 restarted in place, resumed from step $resumed, trained ${recovery% after} after the loss"
    ;;
  elastic)
    # spec.elastic.minNodes 1 on a cluster of exactly two nodes: one is deleted and, with
    # no spare, the gang shrinks to the other, resumes from its checkpoint resharded for 2
    # ranks with the same global batch, and trains on; once the node joins again, the gang
    # grows back at its next checkpoint and trains on at its full size.
    python3 - "$src/examples/clusters/eks-p5-124.yaml" "$work/two-nodes.yaml" <<'PY'
import sys, yaml
nodes = yaml.safe_load(open(sys.argv[1]))["nodes"][:2]
yaml.safe_dump({"nodes": nodes}, open(sys.argv[2], "w"))
PY
    # A node that failed the job is left out of its placements for a while (600 s by
    # default); here, for 5 s, so that the test sees it come back.
    cluster=$work/two-nodes.yaml run_worker_gang "  elastic: {minNodes: 1}" --avoid-failed-node 5
    wait_for '{.status.layout.nodes}' 2 5
    wait_checkpoint 0
    lose_node tiny-g0-1 deleted
    wait_for '{.status.layout.nodes}' 1 30
    "$kubectl" get events | grep -E "Shrunk.*the gang runs on 1 of spec.nodes 2 \(was 2\)" >/dev/null ||
      fail "no Shrunk event: $("$kubectl" get events | tail -8)"
    wait_for '{.status.phase}' Running 30
    [ "$(pod_count)" = 1 ] || fail "the shrunk gang has $(pod_count) pods"
    gang=$("$kubectl" get tj tiny -o 'jsonpath={.status.gang}')
    grep -x "  nodes: 1" <<<"$("$kubectl" get cm tiny-config -o 'jsonpath={.data.job\.json}' | python3 -c 'import json, sys, yaml; print(yaml.safe_dump({"spec": {"nodes": json.load(sys.stdin)["spec"]["nodes"]}}))')" >/dev/null ||
      fail "the workers' spec does not say 1 node"
    shrunk_from=$checkpoint
    wait_checkpoint "$shrunk_from"  # the shrunk gang trains and checkpoints
    resumed=$("$kubectl" get tj tiny -o 'jsonpath={.status.progress.resumedFromStep}')
    [ -n "$resumed" ] && [ "$resumed" -ge "$shrunk_from" ] || fail "the shrunk gang resumed from '$resumed', not step $shrunk_from"
    pod_log "tiny-g$gang-0" | grep "resumed from step $resumed (" >/dev/null || fail "the shrunk gang's rank 0 does not say it resumed"
    pod_log "tiny-g$gang-0" | grep "job tiny: 2 rank(s) on 1 node(s)" >/dev/null || fail "the shrunk gang does not run 2 ranks on 1 node"
    expect_restarts shrunk 1
    missing='meshtrain_operator_job_missing_nodes{job_name="tiny",job_namespace="default"}'
    wait_until 10 "$missing did not read 1 while the gang is shrunk" metric_is "$missing" 1
    # Ten steps of the shrunk gang, to compare with an uninterrupted run once it has grown.
    compared=$((resumed + 10))
    for _ in $(seq 300); do
      [ -n "$(pod_log "tiny-g$gang-0" | losses "$compared" "$compared")" ] && break
      sleep 0.2
    done
    shrunk_losses=$(pod_log "tiny-g$gang-0" | losses $((resumed + 1)) "$compared")
    [ "$(wc -l <<<"$shrunk_losses")" = 10 ] || fail "the shrunk gang's log lacks steps $((resumed + 1))..$compared: $(pod_log "tiny-g$gang-0" | tail -5)"
    return_node
    wait_for '{.status.layout.nodes}' 2 60
    wait_for '{.status.phase}' Running 30
    "$kubectl" get events | grep -E "Grown.*the gang runs on 2 of spec.nodes 2 \(was 1\)" >/dev/null ||
      fail "no Grown event: $("$kubectl" get events | tail -8)"
    [ "$(pod_count)" = 2 ] || fail "the grown gang has $(pod_count) pods"
    expect_restarts grown 1
    # The gauge is refreshed apart from the reconcile that grew the gang.
    wait_until 10 "$missing is still there at the full size" metric_is "$missing" ""
    grown_gang=$("$kubectl" get tj tiny -o 'jsonpath={.status.gang}')
    grown_resumed=
    for _ in $(seq 300); do
      grown_resumed=$(pod_log "tiny-g$grown_gang-0" | sed -n 's/^resumed from step \([0-9]*\) (.*/\1/p' | tail -1)
      [ -n "$grown_resumed" ] && break
      sleep 0.2
    done
    [ -n "$grown_resumed" ] || fail "the grown gang did not resume: $(pod_log "tiny-g$grown_gang-0" | tail -5)"
    # It trains on at its full size: rank 0 prints a step after the one it resumed from.
    trained_step() { [ -n "$(pod_log "$1" | losses "$2" "$2")" ]; }
    wait_until 60 "the grown gang did not train step $((grown_resumed + 1))" \
      trained_step "tiny-g$grown_gang-0" $((grown_resumed + 1))
    pod_log "tiny-g$grown_gang-0" | grep "job tiny: 4 rank(s) on 2 node(s)" >/dev/null ||
      fail "the grown gang does not run 4 ranks on 2 nodes: $(pod_log "tiny-g$grown_gang-0" | head -5)"

    # The loss curve continues: the same spec, run by `meshtrain run` on 4 ranks without an
    # interruption, gives the shrunk gang's losses within what the order of the gradient
    # sums and the printed digits allow.
    "$kubectl" delete tj tiny >/dev/null  # its pods go, and with them their ranks' CPU time
    sed -e "s#$work/checkpoints#$work/reference-checkpoints#" -e '/elastic:/d' "$work/job.yaml" >"$work/reference.yaml"
    OMP_NUM_THREADS=1 "$build/cli/meshtrain" run "$work/reference.yaml" >"$work/reference.log" 2>&1 &
    reference=$!
    pids+=("$reference")
    for _ in $(seq 600); do
      [ -n "$(losses "$compared" "$compared" <"$work/reference.log")" ] && break
      kill -0 "$reference" 2>/dev/null || fail "the reference run ended: $(tail -5 "$work/reference.log")"
      sleep 0.2
    done
    kill "$reference"
    reference_losses=$(losses $((resumed + 1)) "$compared" <"$work/reference.log")
    [ "$(wc -l <<<"$reference_losses")" = 10 ] || fail "the reference run did not reach step $compared: $(tail -5 "$work/reference.log")"
    worst=$(paste -d ' ' <(echo "$shrunk_losses") <(echo "$reference_losses") | awk '
      $1 != $3 { print "steps out of line: " $0; exit 1 }
      { d = $2 - $4; if (d < 0) d = -d; if (NR == 1 || d > worst) { worst = d; at = $1 } }
      END { printf "%.4f at step %d", worst, at }') || fail "$worst"
    awk "BEGIN { exit !(${worst%% *} <= 0.002) }" ||
      fail "the shrunk gang's losses differ from the uninterrupted run's by $worst: shrunk '$shrunk_losses', uninterrupted '$reference_losses'"
    echo "shrunk to 1 node at checkpoint $shrunk_from, resumed from $resumed, grew back to 2;" \
      "steps $((resumed + 1))..$compared: losses within ${worst} of an uninterrupted 4-rank run"
    ;;
  auto-layout)
    # spec.parallelism.mode auto: the operator plans the layout at placement, writes it and
    # its prediction into status.layout, and the real workers train the resolved spec.
    prepare_data
    start_server 2 --kubelet run --worker-binary "$build/worker/meshtrain-worker"
    start_operator
    # The simulated nodes say p5.48xlarge, but the workers train on this CPU in fp32 within
    # memoryLimitMiB: the planner takes both from the spec.
    apply_job 2 "{train: $work/data/train.bin}" "{steps: 6, globalBatchTokens: 4096, warmupSteps: 1, evalInterval: 0, precision: fp32}" \
      "    env: [{name: OMP_NUM_THREADS, value: \"1\"}]
  resources: {memoryLimitMiB: 32}
  parallelism: {mode: auto}"
    wait_for '{.status.phase}' Succeeded 120
    tp=$("$kubectl" get tj tiny -o 'jsonpath={.status.layout.tensorParallelDegree}')
    shard=$("$kubectl" get tj tiny -o 'jsonpath={.status.layout.hybridShardDegree}')
    micro=$("$kubectl" get tj tiny -o 'jsonpath={.status.layout.microBatchSize}')
    memory=$("$kubectl" get tj tiny -o 'jsonpath={.status.layout.predictedMemoryBytes}')
    [ -n "$tp" ] && [ -n "$shard" ] && [ -n "$micro" ] || fail "no layout in status: $("$kubectl" get tj tiny -o yaml)"
    [ "$memory" -gt 0 ] && [ "$memory" -le $((32 * 1024 * 1024 * 9 / 10)) ] || fail "predicted memory $memory is not within 90% of 32 MiB"
    "$kubectl" get events | grep -E "LayoutPlanned.*T=$tp, S=$shard, micro-batch $micro" >/dev/null ||
      fail "no LayoutPlanned event for T=$tp, S=$shard: $("$kubectl" get events | tail -5)"
    spec=$("$kubectl" get cm tiny-config -o 'jsonpath={.data.job\.json}')
    [[ $spec == *'"mode": "manual"'* && $spec == *"\"hybridShardDegree\": $shard"* && $spec == *"\"microBatchSize\": $micro"* ]] ||
      fail "the workers' spec is not the planned layout: $spec"
    # The ranks trained that layout within the memory limit the plan was made for.
    pod_log tiny-g0-0 | grep -E "tp $tp" >/dev/null || fail "rank 0 did not train with tp $tp: $(pod_log tiny-g0-0 | grep 'model:')"
    pod_log tiny-g0-0 | grep "step     6/6" >/dev/null || fail "the workers did not train to the end: $(pod_log tiny-g0-0 | tail -3)"
    echo "planned: T=$tp, S=$shard, micro-batch $micro, predicted $memory bytes per rank"
    ;;
  worker-config-error)
    # A worker that finds a configuration error exits 78: the job fails at once, no restart.
    prepare_data
    start_server 2 --kubelet run --worker-binary "$build/worker/meshtrain-worker"
    start_operator
    worker_job 10 "$work/data/missing.bin"
    wait_for '{.status.phase}' Failed 60
    [ "$("$kubectl" get tj tiny -o 'jsonpath={.status.restarts}')" = 0 ] || fail "a configuration error was retried"
    msg=$("$kubectl" get tj tiny -o 'jsonpath={.status.conditions[?(@.type=="Failed")].message}')
    [[ $msg == *78* ]] || fail "the Failed condition does not give the exit code: $msg"
    # The pod the condition names failed first; the other may have been deleted before its
    # rank got as far.
    [[ $msg =~ pod\ (tiny-g0-[0-9]+) ]] || fail "the Failed condition does not name the pod: $msg"
    failed_pod=${BASH_REMATCH[1]}
    pod_log "$failed_pod" | grep "missing.bin" >/dev/null || fail "the log of pod $failed_pod does not name the missing file"
    ;;
  metrics)
    # A real Prometheus scrapes the operator and rank 0's pod; the metrics pass promtool's lint.
    prepare_data
    start_server 2 --kubelet run --worker-binary "$build/worker/meshtrain-worker"
    read -r operator_port health_port prom_port < <(free_ports 3)
    "$build/operator/meshtrain-operator" --kubeconfig "$operator_kubeconfig" --metrics-port "$operator_port" \
      --health-port "$health_port" --progress-interval 1 >"$work/operator.log" 2>&1 &
    pids+=($!)
    worker_job 100000
    wait_for '{.status.phase}' Running 20
    wait_progress
    pod_ip=$("$kubectl" get pod tiny-g0-0 -o 'jsonpath={.status.podIP}')
    [[ $pod_ip == 127.* && $pod_ip != 127.0.0.1 ]] || fail "pod tiny-g0-0 has no loopback podIP: '$pod_ip'"
    cat >"$work/prometheus.yml" <<YAML
global: {scrape_interval: 1s, evaluation_interval: 1s}
scrape_configs:
  - job_name: meshtrain-operator
    static_configs: [{targets: ["127.0.0.1:$operator_port"]}]
  - job_name: meshtrain-worker
    static_configs: [{targets: ["$pod_ip:9400"]}]
YAML
    promtool check config "$work/prometheus.yml" >/dev/null || fail "promtool rejects the scrape config"
    prometheus --config.file="$work/prometheus.yml" --storage.tsdb.path="$work/tsdb" \
      --web.listen-address="127.0.0.1:$prom_port" >"$work/prometheus.log" 2>&1 &
    pids+=($!)
    for url in "127.0.0.1:$health_port/healthz" "127.0.0.1:$health_port/readyz"; do
      [ "$(curl -s --max-time 5 "http://$url")" = ok ] || fail "$url does not answer ok"
    done
    for target in "127.0.0.1:$operator_port" "$pod_ip:9400"; do
      curl -sf --max-time 5 "http://$target/metrics" >"$work/scrape.txt" || fail "cannot read http://$target/metrics"
      lint=$(promtool check metrics <"$work/scrape.txt" 2>&1) || fail "promtool check metrics on $target: $lint"
    done
    wait_prom 'sum(meshtrain_operator_reconcile_total{result="success"})' 30
    wait_prom 'meshtrain_operator_jobs{phase="Running"}' 30
    wait_prom 'sum(meshtrain_operator_api_requests_total{verb="create",code="201"})' 30
    wait_prom 'meshtrain_operator_placement_duration_seconds_count' 30
    wait_prom 'meshtrain_operator_reconcile_duration_seconds_count' 30
    wait_prom 'meshtrain_train_step{job_name="tiny",rank="0"}' 30
    wait_prom 'rate(meshtrain_train_tokens_total{job_name="tiny"}[5s])' 30
    wait_prom 'meshtrain_train_tokens_per_second{job_name="tiny"}' 30
    wait_prom 'meshtrain_memory_peak_bytes{job_name="tiny",category="activations"}' 30
    wait_prom 'meshtrain_train_step_duration_seconds_count{job_name="tiny"}' 30
    wait_prom 'meshtrain_train_steps{job_name="tiny"} == 100000' 30  # the job's steps
    wait_prom 'meshtrain_checkpoint_last_step{job_name="tiny"}' 60
    # Every dashboard panel's every query returns data from this run.
    node "$src/tests/deploy/dashboards.js" query "http://127.0.0.1:$prom_port" tiny "$src"/dashboards/*.json ||
      fail "a dashboard panel shows nothing"
    # A gang restart shows in the counter.
    post /_test/kubelet/kill '{"namespace": "default", "name": "tiny-g0-1", "signal": 9}'
    wait_for '{.status.restarts}' 1 20
    wait_prom 'meshtrain_operator_gang_restarts_total{kind="recreated"}' 30
    ;;
  tls)
    # HTTPS with a private CA and client-certificate users: kubectl (Go's TLS) and the
    # operator (cpprestsdk/OpenSSL) both verify the server and authenticate by certificate.
    bash "$src/tests/support/kube/make-test-certs.sh" "$work/pki"
    start_server 2 --tls-cert-file "$work/pki/server.crt" --tls-key-file "$work/pki/server.key" \
      --client-ca-file "$work/pki/ca.crt" --ca-file "$work/pki/ca.crt" \
      --kubeconfig-client-cert "$work/pki/client.crt" --kubeconfig-client-key "$work/pki/client.key"
    grep "server: https://127.0.0.1" "$KUBECONFIG" >/dev/null || fail "the kubeconfig does not point at HTTPS"
    start_operator
    job ""
    wait_for '{.status.phase}' Succeeded 30
    # The same server refuses a kubectl that does not trust its CA, and one with a wrong token.
    sed "s#$work/pki/ca.crt#$work/pki/other-ca.crt#" "$KUBECONFIG" >"$work/untrusting"
    out=$("$kubectl" --kubeconfig "$work/untrusting" get tj 2>&1) && fail "a kubectl with another CA was served"
    [[ $out == *certificate* ]] || fail "the untrusting kubectl failed for another reason: $out"
    sed -e '/client-certificate/d' -e 's/client-key: .*/token: wrong/' "$KUBECONFIG" >"$work/wrong-token"
    out=$("$kubectl" --kubeconfig "$work/wrong-token" get tj 2>&1 </dev/null) && fail "a kubectl with a wrong token was served"
    [[ $out == *"must be logged in"* ]] || fail "the kubectl with a wrong token failed for another reason: $out"
    ;;
  *)
    fail "unknown scenario"
    ;;
esac
echo "ok: $scenario"
