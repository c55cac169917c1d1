#!/usr/bin/env bash
# The whole CUDA check in one command, for a bare GPU machine with no network (docs/gpu.md):
#   bash tests/gpu/device_check.sh OUT_DIR             # on the GPU machine, with .whl/ carried (fetch_wheels.sh)
#   bash tests/gpu/device_check.sh --dry-run OUT_DIR   # here, on CPU: TRITON_INTERPRET=1, tiny shapes
# Stages, each under its own time limit so one hang cannot eat the others' time:
#   install  the carried wheels + pagedserve from this tree into a scratch folder (tests/gpu/install.sh)
#   kernels  pytest -m gpu tests/gpu: every Triton kernel against the torch reference
#   e2e      tests/gpu/e2e_check.py: tiny Llama / Gemma 3 / GPTQ / AWQ engines against transformers
#   server   tests/gpu/server_check.py: pagedserve serve over gRPC and OpenAI HTTP, 64 streams, cancel
#   bench    tests/gpu/bench_check.py: copy and decode-attention bandwidth, dequant-GEMM, W4A16 candidates, tokens/s
#   decode   tests/gpu/decode_bench.py: a 1B-shaped Llama built here, fp16 / GPTQ / AWQ decode tokens/s, graphs on/off
# OUT_DIR gets report.json (always, also when stages fail) and one log per stage. Exit status 0 only when every
# stage passed. DEVICE_CHECK_STAGES="kernels e2e" runs a subset (install always runs first); DEVICE_CHECK_DEADLINE_S=N
# caps the whole run (stages that would not fit are not run, and the report is still written).
set -uo pipefail

# Everything in one function: bash parses it whole before running, so editing this file mid-run is harmless.
main() {
  dry=0
  if [ "${1:-}" = "--dry-run" ]; then dry=1; shift; fi
  [ $# -eq 1 ] || { echo "usage: $0 [--dry-run] OUT_DIR" >&2; exit 2; }
  mkdir -p "$1"
  out="$(cd "$1" && pwd)"
  root="$(cd "$(dirname "$0")/../.." && pwd)"
  cd "$root"
  py="${PYTHON:-python3}"
  work="$(mktemp -d "${TMPDIR:-/tmp}/device-check.XXXXXX")"
  site="$work/site"
  export PYTHONUNBUFFERED=1
  flag=()
  slack=1
  if [ "$dry" = 1 ]; then
    # The budgets are sized for the GPU machine's 16 cores; a shared CPU host interprets the kernels far slower.
    slack=3
    # Triton decides at its first import whether to compile or interpret: set before any stage starts Python.
    export TRITON_INTERPRET=1 OMP_WAIT_POLICY=PASSIVE
    flag=(--dry-run)
  fi
  "$py" -c "import json, time; print(json.dumps({'epoch': time.time()}))" > "$work/started.json"
  started_s=$(date +%s)

  # stage NAME BUDGET_S COMMAND...: runs COMMAND under `timeout`, logs to OUT/NAME.log, records exit code and time.
  stage() {
    local name="$1" budget="$2"; shift 2
    local start end code
    budget=$((budget * slack))
    # DEVICE_CHECK_DEADLINE_S: the whole command's limit (a device call's). A stage gets at most what is left of it
    # less 20 s for the report, and none when under 20 s are left (not_run), so report.json is always written.
    if [ -n "${DEVICE_CHECK_DEADLINE_S:-}" ]; then
      local left=$(( DEVICE_CHECK_DEADLINE_S - 20 - ($(date +%s) - started_s) ))
      if [ "$left" -lt 20 ]; then echo "== $name: not run, ${left}s left of DEVICE_CHECK_DEADLINE_S"; return 125; fi
      [ "$left" -lt "$budget" ] && budget=$left
    fi
    start=$(date +%s.%N)
    echo "== $name (budget ${budget}s): $*"
    # INT, not timeout's default TERM: on KeyboardInterrupt pytest still writes its junit XML (the kernels that ran
    # keep their results; a TERM left no XML at all) and the Python stages unwind (servers stopped, partial JSON kept).
    # default_sigint.py: the INT must reach a command that did not inherit it ignored from a background launch.
    timeout -s INT -k 10 "$budget" "$py" "$root/tests/gpu/default_sigint.py" "$@" > "$out/$name.log" 2>&1
    code=$?
    end=$(date +%s.%N)
    "$py" -c "import json, sys; print(json.dumps({'exit_code': int(sys.argv[1]), 'budget_s': int(sys.argv[2]),
      'duration_s': round(float(sys.argv[4]) - float(sys.argv[3]), 1)}))" "$code" "$budget" "$start" "$end" \
      > "$work/$name.status.json"
    echo "   exit $code"
    return $code
  }

  wanted() { [ -z "${DEVICE_CHECK_STAGES:-}" ] || [[ " $DEVICE_CHECK_STAGES " == *" $1 "* ]]; }

  install_args=("$site" "${WHEEL_DIR:-$root/.whl}")
  # A dry run leaves the cp312 wheels alone unless told the wheel folder matches its interpreter (install_check.sh).
  [ "$dry" = 1 ] && [ "${DEVICE_CHECK_INSTALL_WHEELS:-0}" != 1 ] && install_args+=(--skip-wheels)
  if stage install 60 bash tests/gpu/install.sh "${install_args[@]}"; then
    export PYTHONPATH="$site"
    xdist=()
    if [ "$dry" = 0 ] && "$py" -c "import xdist" 2>/dev/null; then xdist=(-n 8); fi
    wanted kernels && stage kernels 180 "$py" -m pytest -m gpu tests/gpu -q -p no:cacheprovider -rfE \
      --junitxml "$work/kernels.xml" "${xdist[@]}"
    wanted e2e && stage e2e 120 "$py" tests/gpu/e2e_check.py --out "$work/e2e.json" "${flag[@]}"
    wanted bench && stage bench 180 "$py" tests/gpu/bench_check.py --out "$work/bench.json" "${flag[@]}"
    wanted decode && stage decode 150 "$py" tests/gpu/decode_bench.py --out "$work/decode.json" "${flag[@]}"
    wanted server && stage server 75 "$py" tests/gpu/server_check.py --out "$work/server.json" \
      --pagedserve "$site/bin/pagedserve" --workdir "$work/server" "${flag[@]}"
  fi
  report_flag=()
  [ "$dry" = 1 ] && report_flag=(--dry-run)
  PYTHONPATH="${PYTHONPATH:-}" "$py" tests/gpu/report.py assemble "$work" "$out" "${report_flag[@]}"
  code=$?
  [ -f "$work/server/server.log" ] && cp "$work/server/server.log" "$out/server-process.log"
  rm -rf "$work"
  return $code
}

main "$@"
