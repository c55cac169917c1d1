#!/usr/bin/env bash
# Builds deploy/Containerfile from a local base (no registry needed) and checks the image as a pod would use it:
# starts as non-root with the model cache on a volume, answers a chat call, drains on SIGTERM and exits 0.
# Needs root podman + debootstrap and network access to deb.debian.org and PyPI; not part of CI (minutes, network).
#   bash deploy/container_check.sh
# Host quirks seen in the sandboxes (set through the environment):
#   PODMAN="podman --runtime runc"   crun refuses hosts with hybrid cgroups ("drop all controllers from cgroupv2")
#   RUN_LIMITS="--ulimit nofile=20000:20000 --ulimit nproc=1024:1024"   when raising rlimits is not permitted
#   WHEELS=/opt/wheels   a folder with torch's CPU wheel, so pip does not fetch PyPI's CUDA build
#   CA_BUNDLE=/etc/ssl/certs/ca-certificates.crt   when TLS to PyPI is intercepted by a local proxy
set -euo pipefail
cd "$(dirname "$0")/.."
PODMAN=${PODMAN:-podman}
RUN_LIMITS=${RUN_LIMITS:-}
WORK=${WORK:-/tmp/pagedserve-container}
BASE=localhost/debian-python:bookworm
IMAGE=localhost/pagedserve:0.1.0
PORT=${PORT:-50071}
METRICS=${METRICS:-9471}

mkdir -p "$WORK"
if ! $PODMAN image exists "$BASE"; then
  rm -rf "$WORK/rootfs"
  debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates \
    bookworm "$WORK/rootfs" http://deb.debian.org/debian
  tar -C "$WORK/rootfs" -c . | $PODMAN import - "$BASE"
fi

build=(--network host --build-arg "BASE=$BASE")
if [ -n "${WHEELS:-}" ]; then build+=(-v "$WHEELS:/wheels:ro" --build-arg PIP_FIND_LINKS=/wheels); fi
if [ -n "${CA_BUNDLE:-}" ]; then build+=(-v "$CA_BUNDLE:/host-ca.crt:ro" --build-arg PIP_CERT=/host-ca.crt); fi
# shellcheck disable=SC2086
$PODMAN build $RUN_LIMITS "${build[@]}" -f deploy/Containerfile -t "$IMAGE" .

$PODMAN rm -f pagedserve-check >/dev/null 2>&1 || true
$PODMAN volume create pagedserve-check-cache >/dev/null 2>&1 || true
# shellcheck disable=SC2086
$PODMAN run -d --name pagedserve-check --network host $RUN_LIMITS -v pagedserve-check-cache:/cache "$IMAGE" \
  serve --host=127.0.0.1 --port="$PORT" --metrics-port="$METRICS" --drain-delay=2 --shutdown-grace=30 >/dev/null
trap '$PODMAN rm -f pagedserve-check >/dev/null 2>&1 || true' EXIT

for _ in $(seq 1 300); do  # first start converts the model into the volume and compiles the native kernels
  [ "$(curl -s "127.0.0.1:$METRICS/ready" || true)" = "ready" ] && break
  sleep 1
done
[ "$($PODMAN exec pagedserve-check id -u)" = "10001" ] || { echo "FAIL: not running as uid 10001"; exit 1; }
answer=$($PODMAN exec pagedserve-check pagedserve-client --target "127.0.0.1:$PORT" \
  chat "What is the capital of France?" --max-new-tokens 12 --temperature 0)
echo "chat answer: $answer"
grep -qi paris <<<"$answer" || { echo "FAIL: unexpected chat answer"; exit 1; }
$PODMAN stop -t 40 pagedserve-check >/dev/null
code=$($PODMAN inspect pagedserve-check --format '{{.State.ExitCode}}')
logs=$($PODMAN logs pagedserve-check 2>&1)
grep -q "shutting down: NOT_SERVING" <<<"$logs" || { echo "FAIL: no drain in the log"; exit 1; }
[ "$code" = "0" ] || { echo "FAIL: exit code $code after SIGTERM"; exit 1; }
echo "OK: image $IMAGE built, served a chat as uid 10001 with the cache on a volume, drained and exited 0"
