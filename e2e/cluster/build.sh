#!/usr/bin/env bash
# Builds the local control plane's binaries from Go modules, once per pinned version.
#
#   e2e/cluster/build.sh            build what is missing, link it into .cluster/bin/
#   e2e/cluster/build.sh --check    exit 0 when everything is cached, 1 otherwise (builds nothing)
#
# Binaries live in ~/.cache/kvfleet/bin/<component>-<version>/ (KVFLEET_CACHE overrides ~/.cache/kvfleet), with the
# Go module and build caches beside them, so a fresh clone on the same machine (as CI makes) reuses them. A component
# is built into <dir>.tmp and renamed when complete, so an interrupted build is never mistaken for a cached one.
set -euo pipefail

HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
# shellcheck source=versions.env
source "$HERE/versions.env"

CACHE="${KVFLEET_CACHE:-$HOME/.cache/kvfleet}"
BIN_CACHE="$CACHE/bin"
LOGS="$CACHE/logs"
LINKS="$ROOT/.cluster/bin"
mkdir -p "$BIN_CACHE" "$LOGS" "$LINKS"

export GOMODCACHE="$CACHE/go/mod" GOCACHE="$CACHE/go/build"
export GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS="-p=2 -trimpath"
# Two cores shared with everyone else: build politely.
NICE=(nice -n 10)

say() { printf '[cluster-build] %s\n' "$*"; }

check_only=false
[[ "${1:-}" == "--check" ]] && check_only=true

# One build at a time per cache (two checkouts running `make test` at once share ~/.cache/kvfleet).
if ! $check_only; then
    exec 9>"$CACHE/build.lock"
    if ! flock -n 9; then
        say "another build holds $CACHE/build.lock; waiting for it ..."
        flock 9
    fi
fi

# progress NAME LOG: prints a line every 100 packages compiled (go build -v prints one per package).
progress() {
    local name="$1" log="$2" n=0 line
    while IFS= read -r line; do
        printf '%s\n' "$line" >>"$log"
        n=$((n + 1))
        if ((n % 100 == 0)); then say "$name: $n packages compiled (last: $line)"; fi
    done
    say "$name: $n packages compiled"
}

require_go() {
    if ! command -v go >/dev/null; then
        say "the Go toolchain is needed (1.26+: etcd 3.6.16, kwok 0.8.0 and helm 3.22 say go 1.26.0); none on PATH"
        exit 1
    fi
    local have
    have="$(go env GOVERSION)"
    if [[ "$(printf '%s\n' go1.26 "$have" | sort -V | head -1)" != go1.26 ]]; then
        say "Go 1.26+ is needed (GOTOOLCHAIN=local never downloads another); this machine has $have"
        exit 1
    fi
}

# build_component NAME VERSION FUNCTION: runs FUNCTION OUTDIR unless $BIN_CACHE/NAME-VERSION exists.
missing=()
build_component() {
    local name="$1" version="$2" fn="$3"
    local dir="$BIN_CACHE/$name-$version"
    if [[ -d "$dir" ]]; then
        say "$name $version: cached in $dir"
        return 0
    fi
    if $check_only; then
        missing+=("$name-$version")
        return 0
    fi
    require_go
    local log="$LOGS/build-$name-$version.log" start=$SECONDS
    say "$name $version: building (log: $log) ..."
    rm -rf "$dir.tmp" && mkdir -p "$dir.tmp"
    : >"$log"
    if ! "$fn" "$dir.tmp" 2>&1 | progress "$name" "$log"; then
        say "$name $version: FAILED, last lines of $log:"
        tail -n 30 "$log" >&2
        exit 1
    fi
    mv "$dir.tmp" "$dir"
    say "$name $version: built in $((SECONDS - start)) s"
}

gomod_version() { # gomod_version GOMOD MODULE: the version a wrapper go.mod requires.
    awk -v m="$2" '$1 == m && $2 ~ /^v/ {print $2; exit} $1 == "require" && $2 == m {print $3; exit}' "$1"
}

build_kubernetes() {
    local out="$1" major minor p ldflags=""
    local pinned
    pinned="$(gomod_version "$HERE/k8sbins/go.mod" k8s.io/kubernetes)"
    if [[ "$pinned" != "$K8S_VERSION" ]]; then
        echo "k8sbins/go.mod requires k8s.io/kubernetes $pinned but versions.env says K8S_VERSION=$K8S_VERSION" >&2
        return 1
    fi
    IFS=. read -r major minor _ <<<"${K8S_VERSION#v}"
    # Without the stamp /version says v0.0.0 and clients' version checks misread the server.
    for p in k8s.io/client-go/pkg/version k8s.io/component-base/version; do
        ldflags+=" -X $p.gitVersion=$K8S_VERSION -X $p.gitMajor=$major -X $p.gitMinor=$minor -X $p.gitTreeState=clean"
    done
    (cd "$HERE/k8sbins" && "${NICE[@]}" go build -v -ldflags "-s -w$ldflags" -o "$out/" \
        ./kube-apiserver ./kube-controller-manager ./kube-scheduler ./kubectl)
}

build_etcd() {
    local pinned
    pinned="$(gomod_version "$HERE/etcdbin/go.mod" go.etcd.io/etcd/server/v3)"
    if [[ "$pinned" != "$ETCD_VERSION" ]]; then
        echo "etcdbin/go.mod requires etcd server $pinned but versions.env says ETCD_VERSION=$ETCD_VERSION" >&2
        return 1
    fi
    (cd "$HERE/etcdbin" && "${NICE[@]}" go build -v -ldflags "-s -w" -o "$1/etcd" go.etcd.io/etcd/server/v3)
}

build_kwok() {
    GOBIN="$1" "${NICE[@]}" go install -v -ldflags "-s -w" \
        "sigs.k8s.io/kwok/cmd/kwok@$KWOK_VERSION"
    # v0.8.0 ships no built-in stages: keep the module's stage YAMLs next to the binary (cluster.py assembles them).
    cp -r "$GOMODCACHE/sigs.k8s.io/kwok@$KWOK_VERSION/kustomize/stage" "$1/stage"
    chmod -R u+w "$1/stage"
}

build_kueue() {
    GOBIN="$1" "${NICE[@]}" go install -v -ldflags "-s -w -X sigs.k8s.io/kueue/pkg/version.GitVersion=$KUEUE_VERSION" \
        "sigs.k8s.io/kueue/cmd/kueue@$KUEUE_VERSION"
    # The CRDs of the same release, applied by cluster.py with server-side apply.
    cp -r "$GOMODCACHE/sigs.k8s.io/kueue@$KUEUE_VERSION/config/components/crd/bases" "$1/crds"
    chmod -R u+w "$1/crds"
}

build_helm() {
    GOBIN="$1" "${NICE[@]}" go install -v -ldflags "-s -w -X helm.sh/helm/v3/internal/version.version=$HELM_VERSION" \
        "helm.sh/helm/v3/cmd/helm@$HELM_VERSION"
}

total_start=$SECONDS
build_component kubernetes "$K8S_VERSION" build_kubernetes
build_component etcd "$ETCD_VERSION" build_etcd
build_component kwok "$KWOK_VERSION" build_kwok
build_component kueue "$KUEUE_VERSION" build_kueue
build_component helm "$HELM_VERSION" build_helm

if $check_only; then
    if ((${#missing[@]})); then
        say "not built yet: ${missing[*]}"
        exit 1
    fi
    exit 0
fi

# Links in the checkout, replaced every time so a version change points them at the new build.
link() { ln -sfn "$BIN_CACHE/$1" "$LINKS/$2"; }
for b in kube-apiserver kube-controller-manager kube-scheduler kubectl; do link "kubernetes-$K8S_VERSION/$b" "$b"; done
link "etcd-$ETCD_VERSION/etcd" etcd
link "kwok-$KWOK_VERSION/kwok" kwok
link "kwok-$KWOK_VERSION/stage" kwok-stage
link "kueue-$KUEUE_VERSION/kueue" kueue
link "kueue-$KUEUE_VERSION/crds" kueue-crds
link "helm-$HELM_VERSION/helm" helm
say "all binaries ready in $LINKS ($((SECONDS - total_start)) s)"
