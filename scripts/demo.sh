#!/usr/bin/env bash
# The main job, as a service: builds odyssey, starts an odyssey-controller (its SQLite state in
# out/demo-state) and one odyssey-worker on loopback ports picked at run time, submits the
# default SFT job (the tiny byte-level model on the King James text) with the `odyssey` CLI,
# shows its live progress, and stops everything on completion or Ctrl-C.
# Each run writes its checkpoints to a folder of its own, out/demo/run-<UTC time> (out/demo/latest
# links to the newest), so a second run never touches the first's results; the final checkpoint
# (a Hugging Face folder that transformers loads) is printed at the end.
#
# Options: --steps N (default 300), --device cpu|cuda|cuda:N|auto (default cpu),
#          --threads N (torch CPU threads of the worker; default: the machine's cores),
#          --out DIR (instead of out/: DIR/demo-state, DIR/demo), --no-build (use build/ as is).
# Ctrl-C cancels the job and says so (its id and step), then stops the processes.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

steps=300
device=cpu
threads=$(nproc)
out="$root/out"
build=1
while (($#)); do
  case "$1" in
    --steps) steps="$2"; shift 2 ;;
    --device) device="$2"; shift 2 ;;
    --threads) threads="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    --no-build) build=0; shift ;;
    -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
    *) echo "demo.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done

((build)) && bash scripts/build.sh
bin="$root/build"
cli="$bin/client/odyssey"
state="$out/demo-state"
# A folder per run: checkpoint folders belong to one job (worker/README.md "Checkpoint
# folders"), and each demo's job is a new store's, so a shared folder would refuse the second run.
run="run-$(date -u +%Y%m%dT%H%M%SZ)"
[ -e "$out/demo/$run" ] && run="$run-$$"
ckpt="$out/demo/$run"
rm -rf "$state"  # each demo starts with an empty job store (its results stay in out/demo/run-*)
mkdir -p "$state" "$out/demo"

pids=()
watch_pid=""
job=""
interrupted=0
cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  [ -n "$watch_pid" ] && kill -TERM "$watch_pid" 2>/dev/null
  if ((interrupted)); then
    echo  # past the ^C on the progress line
    if [ -z "$job" ]; then
      echo "demo: interrupted before a job was submitted"
    elif reply=$("$cli" --controller "$controller" --timeout 5 cancel "$job" 2>&1); then
      local at
      at=$("$cli" --controller "$controller" --timeout 5 get "$job" 2>/dev/null | sed -n 's/^step: *//p' || true)
      echo "demo: interrupted: cancelled $job${at:+ at step $at} (${reply##*: })"
    else
      echo "demo: interrupted: could not cancel $job: $reply" >&2
    fi
  fi
  # Workers first (a running job stops between steps), then the controller.
  for ((i = ${#pids[@]} - 1; i >= 0; i--)); do kill -TERM "${pids[i]}" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
  echo "demo: stopped (logs in $state)"
  exit "$rc"
}
trap cleanup EXIT
trap 'interrupted=1; exit 130' INT TERM

# Waits up to 60 s for a port file and prints its port.
wait_port() {
  for _ in $(seq 600); do
    if [ -s "$1" ]; then cat "$1"; return 0; fi
    sleep 0.1
  done
  echo "demo: $2 did not start; see $state/$2.log" >&2
  return 1
}

# The daemons run in sessions of their own, so a Ctrl-C reaches only this script (and the CLI):
# the trap then cancels the job and stops them in order.
setsid "$bin/server/odyssey-controller" --listen 127.0.0.1:0 --port-file "$state/controller.port" \
  --metrics-listen 127.0.0.1:0 --metrics-port-file "$state/controller-metrics.port" \
  --state-dir "$state" >"$state/controller.log" 2>&1 &
pids+=($!)
port=$(wait_port "$state/controller.port" controller)
controller="127.0.0.1:$port"

setsid "$bin/worker/odyssey-worker" --controller "$controller" --device "$device" --threads "$threads" \
  --worker-id demo-worker --metrics-listen 127.0.0.1:0 --metrics-port-file "$state/worker-metrics.port" \
  >"$state/worker.log" 2>&1 &
pids+=($!)
worker_metrics=$(wait_port "$state/worker-metrics.port" worker)
controller_metrics=$(cat "$state/controller-metrics.port")

cat >"$state/job.json" <<EOF
{
  "kind": "SFT",
  "display_name": "demo: tiny model on the King James text",
  "model": {"name": "tiny"},
  "optimizer": {"lr": 0.003, "warmup_steps": 20, "grad_clip": 1.0},
  "data": {"format": "kjv", "seq_len": 256, "batch_size": 8, "seed": 1},
  "steps": $steps,
  "checkpoint": {"directory": "$ckpt", "every_steps": 100, "keep": 2}
}
EOF

echo "demo: controller at $controller (state: $state)"
echo "demo: metrics at http://127.0.0.1:$controller_metrics/metrics (controller)" \
     "and http://127.0.0.1:$worker_metrics/metrics (worker)"
job=$("$cli" --controller "$controller" submit "$state/job.json" | grep -o 'jobs/[0-9]*' | head -1)
echo "demo: submitted $job; watching (Ctrl-C cancels it and stops everything)"
# In the background so that a signal to this script runs the trap at once.
"$cli" --controller "$controller" watch "$job" &
watch_pid=$!
wait "$watch_pid" || true
watch_pid=""
"$cli" --controller "$controller" get "$job"
last=$(ls -d "$ckpt"/step-* 2>/dev/null | tail -1 || true)
if [ -n "$last" ]; then
  ln -sfn "$run" "$out/demo/latest"
  echo "demo: final checkpoint $last (earlier runs: out/demo/run-*; out/demo/latest is this one)"
  echo "demo: load it with: .venv/bin/python -c 'import transformers; transformers.AutoModelForCausalLM.from_pretrained(\"$last\")'"
fi
