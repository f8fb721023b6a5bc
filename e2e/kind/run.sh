#!/usr/bin/env bash
# Run the e2e suite on a throwaway kind cluster (needs Docker, kind and kubectl):
#
#   e2e/kind/run.sh [pytest args...]          # what `make e2e-kind` runs
#   KEEP=1 e2e/kind/run.sh                    # keep the cluster (and reuse it next time)
#
# 1. creates kind cluster $KIND_CLUSTER (default sluice-e2e) from e2e/kind/kind-config.yaml,
#    unless it exists (then it is reused, and never deleted by this script);
# 2. builds the images sluice:$TAG (Dockerfile) and sluice-worker-cpu:$TAG
#    (docker/worker-cpu.Dockerfile, $MODEL baked in) and `kind load`s them;
# 3. `helm upgrade --install`s charts/sluice with those images (pullPolicy Never, model cache
#    "image") into $NAMESPACE and waits for the operator and the router;
# 4. runs `pytest e2e` with KUBECONFIG pointing at the cluster and SLUICE_E2E_* describing
#    the installation (below);
# 5. deletes the cluster it created, unless KEEP=1.
#
# Not run in CI (no Docker engine there); e2e/local runs the same suite on a local control
# plane. Environment for the suite:
#   KUBECONFIG                   this cluster's kubeconfig (a private file; ~/.kube is untouched)
#   SLUICE_E2E_RELEASE           helm release name            SLUICE_E2E_NAMESPACE  its namespace
#   SLUICE_E2E_HELM              the helm binary              SLUICE_E2E_VALUES     the values file used
#   SLUICE_E2E_CHART_INSTALLED=1 the chart is installed and ready (a suite may re-run
#                                `helm upgrade --install` with SLUICE_E2E_VALUES: a no-op)
#   SLUICE_E2E_MODEL             the model baked into the worker image
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"

CLUSTER="${KIND_CLUSTER:-sluice-e2e}"
TAG="${TAG:-e2e}"
NAMESPACE="${NAMESPACE:-sluice-e2e}"
RELEASE="${RELEASE:-sluice}"
MODEL="${MODEL:-SmolLM2-135M-Instruct}"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
KEEP="${KEEP:-0}"
STATE="${SLUICE_HOME:-$HOME/.cache/sluice}/kind/$CLUSTER"

say() { printf '\n== %s\n' "$*" >&2; }
need() { command -v "$1" > /dev/null || { echo "e2e/kind/run.sh: '$1' is required ($2)" >&2; exit 1; }; }
need docker "https://docs.docker.com/get-docker/"
need kind "https://kind.sigs.k8s.io/docs/user/quick-start/#installation"
need kubectl "https://kubernetes.io/docs/tasks/tools/"
[[ -x "$PYTHON" ]] || { echo "e2e/kind/run.sh: $PYTHON not found; run 'make install' first" >&2; exit 1; }
HELM="${HELM:-$(command -v helm || "$ROOT/scripts/get-helm.sh")}"

mkdir -p "$STATE"
export KUBECONFIG="$STATE/kubeconfig"
created=0

finish() {
  local rc=$?
  if [[ "$created" == 1 && "$KEEP" != 1 ]]; then
    say "deleting kind cluster $CLUSTER (KEEP=1 keeps it)"
    kind delete cluster --name "$CLUSTER" || true
    rm -f "$KUBECONFIG"
  elif kind get clusters 2> /dev/null | grep -qx "$CLUSTER"; then
    say "cluster $CLUSTER kept: export KUBECONFIG=$KUBECONFIG; delete with: kind delete cluster --name $CLUSTER"
  fi
  exit "$rc"
}
trap finish EXIT

if kind get clusters 2> /dev/null | grep -qx "$CLUSTER"; then
  say "reusing kind cluster $CLUSTER"
  kind export kubeconfig --name "$CLUSTER" --kubeconfig "$KUBECONFIG"
else
  say "creating kind cluster $CLUSTER"
  created=1
  kind create cluster --name "$CLUSTER" --config "$ROOT/e2e/kind/kind-config.yaml" \
    --kubeconfig "$KUBECONFIG" --wait 180s ${KIND_NODE_IMAGE:+--image "$KIND_NODE_IMAGE"}
fi
kubectl version

say "building images sluice:$TAG and sluice-worker-cpu:$TAG ($MODEL baked in)"
docker build -t "sluice:$TAG" "$ROOT"
docker build -t "sluice-worker-cpu:$TAG" --build-arg "BASE_IMAGE=sluice:$TAG" \
  --build-arg "MODEL=$MODEL" -f "$ROOT/docker/worker-cpu.Dockerfile" "$ROOT"
kind load docker-image --name "$CLUSTER" "sluice:$TAG" "sluice-worker-cpu:$TAG"

VALUES="$STATE/values.yaml"
cat > "$VALUES" << VALUES
operator:
  image: {repository: sluice, tag: "$TAG", pullPolicy: Never}
router:
  image: {repository: sluice, tag: "$TAG", pullPolicy: Never}
worker:
  image: {repository: sluice-worker-cpu, tag: "$TAG", pullPolicy: Never}
  modelCache: {type: image}
VALUES

say "installing charts/sluice as $RELEASE in namespace $NAMESPACE"
"$HELM" upgrade --install "$RELEASE" "$ROOT/charts/sluice" --namespace "$NAMESPACE" \
  --create-namespace --values "$VALUES" --wait --timeout 5m
kubectl get -n "$NAMESPACE" deployments,services,pods -o wide

say "running pytest e2e"
export SLUICE_E2E_RELEASE="$RELEASE" SLUICE_E2E_NAMESPACE="$NAMESPACE" SLUICE_E2E_HELM="$HELM" \
  SLUICE_E2E_VALUES="$VALUES" SLUICE_E2E_CHART_INSTALLED=1 SLUICE_E2E_MODEL="$MODEL"
"$PYTHON" -m pytest "$ROOT/e2e" -p no:cacheprovider "$@"
