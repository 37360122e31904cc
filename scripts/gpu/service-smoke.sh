#!/usr/bin/env bash
# On a GPU host after scripts/gpu/build.sh odyssey-controller odyssey-worker odyssey: runs the
# service end to end on one GPU: a controller and a worker on cuda:0 (loopback ports picked at
# run time), the tiny SFT job submitted with the CLI and watched to the end, then the worker's
# /metrics (GPU peak memory and MFU must be reported). Exit status 0 when the job succeeded.
#   STEPS=N (default 200); DEVICE=cpu BUILD_DIR=build: the same on a CPU worker (a dry run)
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
bin="$root/${BUILD_DIR:-build-gpu}"
work="$(mktemp -d)"
pids=()
trap 'for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done; wait || true' EXIT

"$bin/server/odyssey-controller" --listen 127.0.0.1:0 --port-file "$work/port" --state-dir "$work/state" \
  --metrics-listen 127.0.0.1:0 >"$work/controller.log" 2>&1 &
pids+=($!)
controller="127.0.0.1:$(wait_file "$work/port")"
"$bin/worker/odyssey-worker" --controller "$controller" --device "${DEVICE:-cuda:0}" --worker-id gpu0 \
  --metrics-listen 127.0.0.1:0 --metrics-port-file "$work/wport" >"$work/worker.log" 2>&1 &
pids+=($!)
wport=$(wait_file "$work/wport")
cat >"$work/job.yaml" <<YAML
kind: SFT
model: {name: tiny}
optimizer: {lr: 0.003, warmup_steps: 20, grad_clip: 1.0}
data: {format: kjv, seq_len: 1024, batch_size: 16, seed: 1}
steps: ${STEPS:-200}
checkpoint: {every_steps: 100, keep: 1}
YAML
rc=0
"$bin/client/odyssey" --controller "$controller" submit --watch "$work/job.yaml" || rc=$?
cat "$work/worker.log"
curl -s "http://127.0.0.1:$wport/metrics" | grep -E '^odyssey_(gpu|model|tokens|steps|step_duration_seconds_(sum|count))' || true
exit "$rc"
