#!/usr/bin/env bash
# Schema check of the manifests (kubernetes-validate from PyPI, in its own venv under .cache/): every built-in
# kind strictly against Kubernetes 1.37's schemas; the ServiceMonitor (a prometheus-operator CRD) and the
# kustomization are not in those schemas and are only parsed. The adapter rules inside the ConfigMap are parsed
# as YAML too. Nothing here talks to a cluster.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
venv="$here/../../.cache/k8s-validate-venv"
[ -x "$venv/bin/kubernetes-validate" ] || {
  python3 -m venv "$venv" && "$venv/bin/pip" install --quiet --disable-pip-version-check kubernetes-validate==1.37.0
}
cd "$here"
"$venv/bin/kubernetes-validate" --strict --quiet namespace.yaml etcd.yaml replicas.yaml frontend.yaml hpa.yaml \
  prometheus-adapter-rules.yaml
"$venv/bin/python" - <<'PY'
import yaml
for name in ("kustomization.yaml", "servicemonitor.yaml"):
    list(yaml.safe_load_all(open(name)))
cm = yaml.safe_load(open("prometheus-adapter-rules.yaml"))
rules = yaml.safe_load(cm["data"]["config.yaml"])["rules"]
assert {r["name"]["as"] for r in rules} == {"vllm_num_requests_waiting", "vllm_gpu_cache_usage_perc"}
PY
echo "deploy/k8s: manifests valid"
