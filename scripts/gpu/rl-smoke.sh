#!/usr/bin/env bash
# On a GPU host after scripts/gpu/build.sh odyssey-controller odyssey-worker: an RL session end to
# end on GPUs. A controller and WORLD_SIZE workers (worker i on cuda:i; loopback ports picked at
# run time), then client/python/examples/rl_target_string.py drives a session of WORLD_SIZE ranks
# (data parallel) through the Python client: export weights, sample with transformers on the CPU,
# PPO forward_backward + optim_step on the GPUs. Exit status 0 when the example finished and the
# mean reward of its last steps is at least MIN_GAIN above that of its first steps.
#   WORLD_SIZE=N   workers and ranks (default 1; needs N GPUs)
#   DTYPE=...      the session's dtype: float32 (default) or bfloat16
#   STEPS=N        RL iterations (default 30); SEED=N (default 1); MIN_GAIN=x (default 0.5 bytes)
#   OUT=dir        where the example's report (rl-<world>-<dtype>.json) and the logs are kept
#   DEVICE=cpu BUILD_DIR=build   the same on CPU workers with the CPU build (a dry run of the script)
# Needs python3 with torch, transformers, grpcio, grpcio-tools and protobuf (the client's stubs
# are generated from proto/ into client/python/odyssey_client/_pb, as the package build does).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
bin="$root/${BUILD_DIR:-build-gpu}"
device="${DEVICE:-cuda}"
world="${WORLD_SIZE:-1}"
dtype="${DTYPE:-float32}"
out="${OUT:-$(mktemp -d)}"
mkdir -p "$out"
work="$(mktemp -d)"
tag="rl-$world-$dtype"
pids=()
cleanup() {
  local rc=$?
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  wait || true
  cp "$work"/*.log "$out/" 2>/dev/null || true
  if [ "$rc" -ne 0 ]; then
    for f in "$work"/*.log; do echo "----- $(basename "$f") (last 30 lines)"; tail -n 30 "$f"; done
  fi
}
trap cleanup EXIT

gpus=$(python3 -c 'import torch; print(torch.cuda.device_count())')
if [ "$device" = cuda ] && [ "$gpus" -lt "$world" ]; then
  echo "rl-smoke: WORLD_SIZE=$world needs $world GPUs, this host has $gpus" >&2
  exit 2
fi
python3 "$root/client/python/_build_stubs.py" >/dev/null

"$bin/server/odyssey-controller" --listen 127.0.0.1:0 --port-file "$work/port" --state-dir "$work/state" \
  --metrics-listen 127.0.0.1:0 --metrics-port-file "$work/cport" >"$work/$tag-controller.log" 2>&1 &
pids+=($!)
controller="127.0.0.1:$(wait_file "$work/port")"
for ((i = 0; i < world; i++)); do
  "$bin/worker/odyssey-worker" --controller "$controller" --device "$([ "$device" = cuda ] && echo "cuda:$i" || echo "$device")" --worker-id "gpu$i" \
    --metrics-listen 127.0.0.1:0 --metrics-port-file "$work/wport$i" >"$work/$tag-worker$i.log" 2>&1 &
  pids+=($!)
  wait_file "$work/wport$i" >/dev/null
done

rc=0
PYTHONPATH="$root/client/python${PYTHONPATH:+:$PYTHONPATH}" python3 "$root/client/python/examples/rl_target_string.py" \
  --controller "$controller" --world-size "$world" --dtype "$dtype" --steps "${STEPS:-30}" --seed "${SEED:-1}" \
  --workdir "$work" --report "$out/$tag.json" || rc=$?
for ((i = 0; i < world; i++)); do
  echo "--- worker gpu$i, last lines of its log and its GPU metrics"
  tail -n 5 "$work/$tag-worker$i.log"
  curl -s "http://127.0.0.1:$(cat "$work/wport$i")/metrics" | grep -E '^odyssey_(gpu|tokens_total|model)' || true
done
curl -s "http://127.0.0.1:$(cat "$work/cport")/metrics" | grep -E '^odyssey_(training_calls_total|rl_)' || true
[ "$rc" -eq 0 ] || { echo "rl-smoke: the example failed ($rc)" >&2; exit "$rc"; }
python3 - "$out/$tag.json" "${MIN_GAIN:-0.5}" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
gain = r["last"] - r["first"]
print(f"rl-smoke: mean reward {r['first']:.3f} -> {r['last']:.3f} of {len(r['target'])} bytes "
      f"(gain {gain:+.3f}, need >= {sys.argv[2]}); greedy {r['greedy']!r}")
sys.exit(0 if gain >= float(sys.argv[2]) else 1)
PY
