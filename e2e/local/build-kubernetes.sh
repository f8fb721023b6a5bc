#!/usr/bin/env bash
# Build kube-apiserver, kube-controller-manager and kube-scheduler v1.20.2 offline from
# Debian bookworm's source package `kubernetes` (the full upstream tree with vendor/), and
# cache them outside the clone, keyed by version:
#
#     ${SLUICE_HOME:-$HOME/.cache/sluice}/kubernetes/v1.20.2/bin/
#
# Idempotent: when the three binaries are there, it only prints that directory. Otherwise
# it installs the build dependencies with apt-get (needs root), fetches the source through a
# private deb-src list (nothing under /etc/apt changes), applies debian/patches/series,
# generates the OpenAPI code, swaps the vendored reflect2 1.0.1 (crashes under Go >= 1.18)
# for Debian's 1.0.2 and runs `go build -tags providerless` in GOPATH mode.
# A cold build takes about 7-8 min on 2 cores. Output goes to build.log next to bin/; on
# failure the last lines are printed and the exit status is non-zero.
# The last line on stdout is always the bin directory, so callers can do
#     BIN=$(bash e2e/local/build-kubernetes.sh | tail -n1)
set -euo pipefail

K8S_VERSION=v1.20.2
DEB_VERSION=1.20.5+really1.20.2-1.1+deb12u1
DEB_MIRROR=${SLUICE_DEB_MIRROR:-http://deb.debian.org/debian}
ROOT=${SLUICE_HOME:-$HOME/.cache/sluice}/kubernetes/$K8S_VERSION
BIN=$ROOT/bin
BINARIES=(kube-apiserver kube-controller-manager kube-scheduler)

have_all() {
    local b
    for b in "${BINARIES[@]}"; do [[ -x $BIN/$b ]] || return 1; done
}

if have_all; then
    echo "$BIN"
    exit 0
fi

mkdir -p "$ROOT"
LOG=$ROOT/build.log
exec 9>"$ROOT/.lock"
if ! flock -w 1800 9; then
    echo "build-kubernetes: another build holds $ROOT/.lock for over 30 min" >&2
    exit 1
fi
if have_all; then  # another process finished the build while we waited for the lock
    echo "$BIN"
    exit 0
fi

: >"$LOG"
on_error() {
    local rc=$?
    echo "build-kubernetes: FAILED (exit $rc); last lines of $LOG:" >&2
    tail -n 40 "$LOG" >&2
    exit "$rc"
}
trap on_error ERR
step() { echo "== $(date +%T) $*" | tee -a "$LOG" >&2; }
START=$(date +%s)

step "build dependencies (apt-get)"
# Dependencies: the go toolchain (1.19), rsync for `make gen_openapi`, dpkg-dev for
# `apt-get source`, reflect2 sources, etcd for the control plane itself.
DEPS=(golang-go rsync make gcc libc6-dev patch xz-utils dpkg-dev etcd-server
      golang-github-modern-go-reflect2-dev openssl ca-certificates)
missing=()
for p in "${DEPS[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
    SUDO=; [[ $(id -u) == 0 ]] || SUDO=sudo
    { $SUDO apt-get update -q && \
      DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"; } >>"$LOG" 2>&1
fi

SRC_PARENT=$ROOT/build/gopath/src/k8s.io
SRC=$SRC_PARENT/kubernetes
if [[ ! -f $SRC/.sluice-patched ]]; then
    step "source package kubernetes=$DEB_VERSION (private deb-src list)"
    APT=$ROOT/build/apt
    rm -rf "$APT" "$SRC" "$ROOT/build/fetch"
    mkdir -p "$APT/lists/partial" "$APT/cache/archives/partial" "$ROOT/build/fetch" "$SRC_PARENT"
    echo "deb-src [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $DEB_MIRROR bookworm main" \
        >"$APT/sources.list"
    APT_OPTS=(-o "Dir::Etc::SourceList=$APT/sources.list" -o "Dir::Etc::SourceParts=/nonexistent"
              -o "Dir::State::Lists=$APT/lists" -o "Dir::Cache=$APT/cache"
              -o "APT::Sandbox::User=root" -q)
    apt-get "${APT_OPTS[@]}" update >>"$LOG" 2>&1
    # --download-only then dpkg-source --skip-patches: the patches are applied below from
    # debian/patches/series, so the tree is the same whatever dpkg-source's defaults are.
    (cd "$ROOT/build/fetch" && apt-get "${APT_OPTS[@]}" source --download-only "kubernetes=$DEB_VERSION") >>"$LOG" 2>&1
    (cd "$ROOT/build/fetch" && dpkg-source --skip-patches -x ./*.dsc tree) >>"$LOG" 2>&1
    mv "$ROOT/build/fetch/tree" "$SRC"
    rm -rf "$ROOT/build/fetch" "$APT"

    step "debian/patches/series"
    while read -r patch opts; do
        [[ -z $patch || $patch == \#* ]] && continue
        echo "patch $patch $opts" >>"$LOG"
        # shellcheck disable=SC2086
        patch -d "$SRC" -p1 --forward --batch ${opts:-} <"$SRC/debian/patches/$patch" >>"$LOG" 2>&1
    done <"$SRC/debian/patches/series"

    step "vendor: reflect2 1.0.1 -> Debian's golang-github-modern-go-reflect2-dev"
    rm -rf "$SRC/vendor/github.com/modern-go/reflect2"
    cp -a /usr/share/gocode/src/github.com/modern-go/reflect2 "$SRC/vendor/github.com/modern-go/reflect2"
    rm -rf "$SRC/vendor/github.com/modern-go/reflect2/.git"* "$SRC/vendor/github.com/modern-go/reflect2/go.mod"
    touch "$SRC/.sluice-patched"
fi

export GOPATH=$ROOT/build/gopath GO111MODULE=off GOFLAGS= CGO_ENABLED=0
export GOCACHE=$ROOT/build/gocache GOTOOLCHAIN=local
# hack/lib/version.sh reads these instead of git (the tree has no .git).
export KUBE_GIT_VERSION=$K8S_VERSION KUBE_GIT_MAJOR=1 KUBE_GIT_MINOR=20 KUBE_GIT_TREE_STATE=clean

if [[ ! -f $SRC/.sluice-openapi ]]; then
    step "make gen_openapi"
    make -C "$SRC" gen_openapi >>"$LOG" 2>&1
    touch "$SRC/.sluice-openapi"
fi

step "go build -tags providerless ${BINARIES[*]} ($(go version | cut -d' ' -f3))"
BUILD_DATE=$(date -u +%Y-%m-%dT%H:%M:%SZ)
LDFLAGS="-s -w"
for pkg in k8s.io/kubernetes/vendor/k8s.io/component-base/version k8s.io/kubernetes/vendor/k8s.io/client-go/pkg/version; do
    LDFLAGS+=" -X $pkg.gitVersion=$K8S_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=20"
    LDFLAGS+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=$BUILD_DATE"
done
rm -rf "$BIN.tmp"
mkdir -p "$BIN.tmp"
(cd "$SRC" && go build -tags providerless -ldflags "$LDFLAGS" -o "$BIN.tmp/" \
    ./cmd/kube-apiserver ./cmd/kube-controller-manager ./cmd/kube-scheduler) >>"$LOG" 2>&1
"$BIN.tmp/kube-apiserver" --version >>"$LOG" 2>&1
rm -rf "$BIN"
mv "$BIN.tmp" "$BIN"
step "done in $(( $(date +%s) - START )) s; the go build cache and tree stay in $ROOT/build (delete it to save ~2 GB)"
echo "$BIN"
