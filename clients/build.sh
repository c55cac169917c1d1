#!/usr/bin/env bash
# Builds the Go and Java clients offline from Debian bookworm packages (no module proxy, no Maven Central).
#
#   clients/build.sh               # apt-get install what is missing, then build and check both clients
#   clients/build.sh --no-install  # build only (the toolchains must already be there)
#
# Idempotent: a second run installs nothing and rebuilds incrementally. Outputs (all git-ignored):
#   clients/go/build/pagedserve-go, clients/go/build/pagedserve-conformance
#   clients/java/target/pagedserve-client-0.1.0.jar        the library, also installed into ~/.m2/debian-repository
#   clients/java/examples/target/pagedserve-client-examples.jar   (java -jar runs the example; built against
#                                                                 the installed library like any downstream)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
GOCODE=/usr/share/gocode/src

# golang-github-golang-protobuf-1-5-dev must be named: apt otherwise picks the 1-3 variant, which compiles
# but panics at run time. protoc-gen-go(-grpc) are Debian's so generated code matches Debian's runtimes.
# gcc and libc6-dev: `go test -race` needs cgo.
GO_PACKAGES=(golang-go gcc libc6-dev protobuf-compiler protoc-gen-go protoc-gen-go-grpc golang-google-grpc-dev
  golang-google-protobuf-dev golang-github-golang-protobuf-1-5-dev golang-google-genproto-dev)
JAVA_PACKAGES=(default-jdk-headless maven protobuf-compiler protobuf-compiler-grpc-java-plugin libgrpc-java
  libprotobuf-java libnetty-java libgoogle-gson-java libperfmark-java libanimal-sniffer-java
  libgoogle-common-protos-java libgeronimo-annotation-1.3-spec-java grpc-proto libguava-java libjsr305-java
  liberror-prone-java libmaven-compiler-plugin-java libmaven-resources-plugin-java libmaven-jar-plugin-java
  libexec-maven-plugin-java libbuild-helper-maven-plugin-java libmaven-install-plugin-java
  libmaven-clean-plugin-java junit5)
# tests/test_clients_go_java.py makes throwaway certificates for its mutual-TLS test with the openssl CLI.
TEST_PACKAGES=(openssl)

# Modules the Go client needs from /usr/share/gocode; go.mod lists the same set (with Debian's versions).
GO_MODULES=(google.golang.org/grpc google.golang.org/protobuf google.golang.org/genproto
  github.com/golang/protobuf golang.org/x/net golang.org/x/sys golang.org/x/text)

log() { printf '[clients/build] %s\n' "$*" >&2; }

install_packages() {
  local missing=()
  for pkg in "${GO_PACKAGES[@]}" "${JAVA_PACKAGES[@]}" "${TEST_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "ok installed" || missing+=("$pkg")
  done
  if [ ${#missing[@]} -eq 0 ]; then
    log "apt packages already installed"
    return
  fi
  local sudo=()
  [ "$(id -u)" -eq 0 ] || sudo=(sudo)
  log "installing ${#missing[@]} apt packages: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  # A fresh machine may have no package lists yet; only refresh them when the first attempt fails.
  if ! "${sudo[@]}" apt-get install -y --no-install-recommends "${missing[@]}"; then
    "${sudo[@]}" apt-get update
    "${sudo[@]}" apt-get install -y --no-install-recommends "${missing[@]}"
  fi
}

build_go() {
  cd "$ROOT/clients/go"
  # go.mod stays the file a Go developer uses online; the offline build swaps in a copy that replaces every
  # module with Debian's source tree (go.debian.mod is git-ignored).
  cp go.mod go.debian.mod
  for module in "${GO_MODULES[@]}"; do
    go mod edit -modfile=go.debian.mod -replace="$module=$GOCODE/$module"
  done
  export GOFLAGS=-modfile=go.debian.mod GOPROXY=off GOSUMDB=off
  log "go: checking committed stubs in clients/go/pagedservev1"
  python3 "$ROOT/proto/generate.py" --check --lang go
  log "go: vet, test, build"
  go vet ./...
  go test -race ./...
  go build -o build/ ./cmd/...
  unset GOFLAGS GOPROXY GOSUMDB
}

build_java() {
  # debian-settings.xml serves every repository from /usr/share/maven-repo (a file: repository, which offline
  # mode only uses when told file: is local) into ~/.m2/debian-repository.
  local mvn=(mvn -o -q -B -s "$ROOT/clients/java/debian-settings.xml" -Daether.offline.protocols=file)
  cd "$ROOT/clients/java"
  # clean first: stale generated stubs (a proto file renamed or removed) must not end up in the jar.
  log "java: mvn -o clean install (stubs generated from proto/ at build time)"
  "${mvn[@]}" clean install
  cd examples
  log "java: examples against the installed library"
  "${mvn[@]}" clean package
}

main() {
  local install=1
  for arg in "$@"; do
    case "$arg" in
      --no-install) install=0 ;;
      *) echo "usage: $0 [--no-install]" >&2; exit 2 ;;
    esac
  done
  [ "$install" -eq 0 ] || install_packages
  local start=$SECONDS
  build_go
  build_java
  log "built Go and Java clients in $((SECONDS - start)) s"
}

main "$@"
