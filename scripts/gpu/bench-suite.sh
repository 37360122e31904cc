#!/usr/bin/env bash
# On a GPU host: build (engine side), run the GPU tests, then the benchmark runs that
# docs/benchmarks.md records, writing JSON lines to ${OUT:-out}/bench.jsonl. One argument picks a
# subset, or several joined by commas: tests | 64k | 256k | 1m | hf | 1b | 512k | rl | kernels |
# peer | planner | fidelity | long1b | long1b-wait | paralleltests | gputests | hybrid | hybridstep | dsagroups | gqa | cp | kdachunk | all (= tests, 64k, 256k, 1m; about 9 minutes). 512k (one full-depth step, ~7 minutes), 1b,
# hf, rl (an SFT step and a PPO step of 16 x 2048 tokens, ~1 minute), kernels (the fused-kernel
# tests and odyssey-kernel-bench) and peer run only when named.
#   peer: odyssey-bench (flags in PEER_FLAGS) and transformers + Liger kernels at each length of
#   PEER_LENS (default 65536), one after the other in this run, then bench/compare.py's table of
#   the ratios; with PEER_ALST=1 also transformers + Liger + ALST's single-GPU recipe
#   (bench/hf_bench.py --alst). Liger is a benchmark peer: its wheel (liger-kernel 0.8.5, no registry on a GPU
#   host) is installed from .whl/ into a private folder, never into the project.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"
out="${OUT:-$root/out}"
mkdir -p "$out"
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
what=",${1:-all},"
has() { case "$what" in *",$1,"*|*",all,"*) return 0 ;; esac; return 1; }
only() { case "$what" in *",$1,"*) return 0 ;; esac; return 1; }
targets="memory_test rl_loss_test fused_ops_test optimizer_test odyssey-bench odyssey-plan odyssey-kernel-bench"
only paralleltests && targets="$targets attention_test communicator_test context_parallel_test"
# gputests: every GPU test ctest knows (the *_gpu entries: each binary's CUDA cases) but the
# worker's, which need the service build; one summary line a test, the failures' output in
# $OUT/gputests.log. A regression in a GPU-only path shows here and nowhere else.
gpu_bins="attention_test fused_ops_test kda_test dsa_test optimizer_test trainer_test memory_test communicator_test context_parallel_test rl_loss_test"
only gputests && targets="$targets $gpu_bins"
only hybrid && targets="$targets odyssey-hybrid-bench kda_test dsa_test"
only kdachunk && targets="$targets odyssey-hybrid-bench kda_test"
ODYSSEY_SERVICE=OFF bash scripts/gpu/build.sh $targets >"$out/build.log" 2>&1 \
  || { tail -30 "$out/build.log"; exit 1; }
source "$root/scripts/gpu/env.sh"
B="build-gpu/bench/odyssey-bench --model llama-3.2-3b --mlp-tile 8192 --loss-tile 2048 --json $out/bench.jsonl"
run() { echo "+ $*" >&2; "$@" 2>&1 | grep -E '^\||error|what\(\)|kernel' | tail -2; }
# fla_peer MODE LENS JSON: fla's chunk_kda (bench/fla_kda_bench.py) at LENS (comma-separated), its
# rows appended to JSON; fla-core and einops installed from .whl/ into a private folder (a
# benchmark peer, never a dependency).
fla_peer() {
  local site="${TMPDIR:-/tmp}/odyssey-peer-site"
  if ! ls .whl/fla_core-*.whl >/dev/null 2>&1; then
    echo "$1: no .whl/fla_core-*.whl: the fla peer was not run"
    return
  fi
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl
  PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" python3 bench/fla_kda_bench.py --tokens ${2//,/ } --json "$3" 2>&1 \
    | tail -6
}
# The full-depth hybrid-3b step's flags of hybridstep and kdachunk.
hybstep_flags="${HYBSTEP_FLAGS:---recompute layer --offload --device-resident 8 --mlp-tile 16384 --loss-tile 4096 --optimizer-on-host}"
# hybrid_step LEN JSON LOG [FLAGS...]: one such step at LEN (no warm-up, --phase-times) under
# HYBSTEP_TIMEOUT seconds (default 400: the process's start takes ~50 s before its first step),
# its JSON line appended to JSON, its output in LOG; then bench/peak_report.py's line for it. A
# run that fails or is killed prints its log's tail (stderr included: an out-of-memory kill
# leaves only the shell's "Killed") and returns non-zero.
hybrid_step() {
  local s="$1" json="$2" log="$3"
  shift 3
  timeout "${HYBSTEP_TIMEOUT:-400}" build-gpu/bench/odyssey-bench --model hybrid-3b --seq-len "$s" $hybstep_flags "$@" \
    --warmup 0 --steps 1 --phase-times --json "$json" >"$log" 2>&1
  local rc=$?
  if [ "$rc" -ne 0 ]; then
    echo "hybrid-3b step at $s $*: exit $rc"
    tail -5 "$log"
    return 1
  fi
  grep -E '^\| hybrid' "$log"
  python3 bench/peak_report.py "$json" --last --label seq_len kda_chunk_size --sum "kda " "dsa "
}
has tests && { build-gpu/engine/memory_test 2>&1 | tail -4; build-gpu/engine/rl_loss_test --gtest_filter="*Gpu*" 2>&1 | tail -4; }
if only gputests; then
  (cd build-gpu && ctest -R '_gpu$' -E 'job_runner|device_probe' --output-on-failure >"$out/gputests.log" 2>&1)
  echo "gputests: ctest exit $?"
  grep -E 'Test +#|tests passed|FAILED|Failed' "$out/gputests.log" | tail -16
fi
if has 64k; then
  run $B --seq-len 65536 --recompute layer --keep-attention --steps 2
  run $B --seq-len 65536 --recompute layer --keep-attention --offload --steps 2
fi
has 256k && run $B --seq-len 262144 --recompute layer --keep-attention --offload --steps 1
has 1m && run $B --seq-len 1048576 --layers 2 --recompute layer --offload --head-groups 4 --warmup 0 --steps 1
if only 1b; then
  B1="${B/llama-3.2-3b/llama-3.2-1b}"
  run $B1 --seq-len 65536 --recompute layer --keep-attention --steps 2
  run $B1 --seq-len 262144 --recompute layer --keep-attention --offload --steps 1
fi
if only rl; then
  R="build-gpu/bench/odyssey-bench --model llama-3.2-3b --seq-len 2048 --batch-size 16 --recompute layer --mlp-tile 8192 --loss-tile 4096 --steps 2 --json $out/bench.jsonl"
  run $R
  run $R --rl-loss ppo
fi
if only kernels; then
  build-gpu/kernels/fused_ops_test 2>&1 | grep -E '^\[ *(OK|FAILED|SKIPPED|PASSED) ' | tail -12
  build-gpu/kernels/odyssey-kernel-bench --json "$out/kernels.jsonl"
fi
if only peer; then
  site="${TMPDIR:-/tmp}/odyssey-peer-site"
  if ls .whl/liger_kernel-*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
  fi
  flags="${PEER_FLAGS:---recompute layer --keep-attention --offload --mlp-tile 16384 --loss-tile 4096}"
  for s in ${PEER_LENS:-65536}; do
    steps=2; [ "$s" -gt 131072 ] && steps=1
    run build-gpu/bench/odyssey-bench --model llama-3.2-3b --seq-len "$s" $flags --steps "$steps" --json "$out/peer-odyssey.jsonl"
    python3 bench/hf_bench.py --liger --model llama-3.2-3b --seq-len "$s" --steps "$steps" --json "$out/peer-liger.jsonl" \
      2>&1 | grep -E '^\||Error' | tail -2
    # PEER_ALST=1: the ALST-style peer too (hf_bench.py --alst: layer inputs on the host, tiled
    # MLP, AdamW state on the host).
    [ -n "${PEER_ALST:-}" ] && python3 bench/hf_bench.py --liger --alst --model llama-3.2-3b --seq-len "$s" \
      --steps "$steps" --json "$out/peer-alst.jsonl" 2>&1 | grep -E '^\||Error' | tail -2
  done
  python3 bench/compare.py "$out/peer-odyssey.jsonl" "$out/peer-liger.jsonl"
  [ -n "${PEER_ALST:-}" ] && python3 bench/compare.py "$out/peer-odyssey.jsonl" "$out/peer-alst.jsonl"
fi
only hf && python3 bench/hf_bench.py --model llama-3.2-3b --seq-len 65536 --steps 2 --json "$out/hf.jsonl"
# planner: one profiled step per measured row of planner_test (the peak of every phase: what
# the planner's phase model is checked against); JSON lines in $out/planner-rows.jsonl, reports
# in $out/plan/<row>/profile.json. About 6 minutes.
if only planner; then
  P="build-gpu/bench/odyssey-bench --warmup 1 --steps 0 --json $out/planner-rows.jsonl"
  row() {
    local name="$1"; shift
    echo "+ row $name: $*" >&2
    $P --profile "$out/plan/$name" "$@" 2>&1 | grep -E 'error|what\(\)' | tail -2
    python3 bench/profile_report.py "$out/plan/$name/trace.json" 2>&1 | grep -E '^memory|^\| (layers|loss|optimizer|outside)' | head -8
    rm -f "$out/plan/$name/trace.json"
  }
  K="--recompute layer --keep-attention"
  row 3b-64k-keep --model llama-3.2-3b --seq-len 65536 $K --mlp-tile 8192 --loss-tile 2048
  row 3b-64k-keep-off --model llama-3.2-3b --seq-len 65536 $K --offload --mlp-tile 8192 --loss-tile 2048
  row 3b-64k-keep-off-16k --model llama-3.2-3b --seq-len 65536 $K --offload --mlp-tile 16384 --loss-tile 4096
  row 3b-64k-keep-off-16k-host --model llama-3.2-3b --seq-len 65536 $K --offload --mlp-tile 16384 --loss-tile 4096 --optimizer-on-host
  row 3b-16k-none --model llama-3.2-3b --seq-len 16384 --recompute none
  row 3b-16k-layer --model llama-3.2-3b --seq-len 16384 --recompute layer
  row 3b-16k-none-mlp --model llama-3.2-3b --seq-len 16384 --recompute none --mlp-tile 4096
  row 3b-16k-none-loss --model llama-3.2-3b --seq-len 16384 --recompute none --loss-tile 2048
  row 3b-16k-none-host --model llama-3.2-3b --seq-len 16384 --recompute none --optimizer-on-host
  row 3b-2l-1m --model llama-3.2-3b --layers 2 --seq-len 1048576 --recompute layer --offload --mlp-tile 8192 --loss-tile 2048 --head-groups 4
  row 1b-64k-keep-off --model llama-3.2-1b --seq-len 65536 $K --offload --mlp-tile 16384 --loss-tile 4096
  row 1b-256k-keep-off --model llama-3.2-1b --seq-len 262144 $K --offload --mlp-tile 16384 --loss-tile 4096
  row 3b-rl-16x2k --model llama-3.2-3b --seq-len 2048 --batch-size 16 --recompute layer --mlp-tile 8192 --loss-tile 4096
fi
# fidelity: bf16 training-forward logprobs against a float32 forward of the same weights, at each
# length of FID_LENS (default 65536 131072), 3B shape, the flags of FID_FLAGS; then the same
# measure for transformers + Liger (bench/hf_bench.py --fidelity --liger, Liger from .whl/ when its
# wheel is there, else plain transformers) at the same lengths: the peer's own bf16 gap.
if only fidelity; then
  for s in ${FID_LENS:-65536 131072}; do
    run build-gpu/bench/odyssey-bench --model llama-3.2-3b --seq-len "$s" \
      ${FID_FLAGS:---recompute layer --keep-attention --offload --mlp-tile 16384 --loss-tile 4096} --fidelity \
      --json "$out/fidelity.jsonl"
  done
  site="${TMPDIR:-/tmp}/odyssey-peer-site" liger=
  if ls .whl/liger_kernel-*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl
    liger=--liger
  fi
  PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" python3 bench/hf_bench.py --fidelity $liger --model llama-3.2-3b \
    --seq-len ${FID_LENS:-65536 131072} --json "$out/fidelity.jsonl" 2>&1 | grep -E '^\||Error' | tail -4
fi
# long1b: one full-depth step of LONG_MODEL (default llama-3.2-1b) at LONG_LEN (default 1M) started in the background
# (it outlasts one command on a GPU host): the log goes to ${LONG_LOG:-/tmp/odyssey-long1b.log},
# the JSON line to ${LONG_LOG%.log}.jsonl and the pid to ${LONG_LOG%.log}.pid; the step carries
# --phase-times (where its time went, by phase, at no measurable cost) unless LONG_PROFILE is set. The step runs in a
# session of its own (setsid), but a command killed at its time limit can still take it down with
# the machine's process tree: end every command before its limit (this mode returns at once;
# poll with `long1b-wait`, which returns after at most LONG_WAIT seconds, default 500).
# long1b-wait: waits for that pid (kill -0, never pgrep -f: the polling shell's own command line
# names the binary), then prints the log's tail and copies log and JSON line into $OUT.
# LONG_PROFILE=DIR (both modes): the one step is the profiler's (odyssey-bench --steps 0 --profile
# DIR, DIR a folder on the GPU host, e.g. /tmp/odyssey-long-profile; its time, in the log, includes
# the profiler's overhead, ~8%), and long1b-wait, once the step has ended, writes
# bench/profile_report.py's report of it (phases, kernels, the memory peak's phase) and its
# memory plot into $OUT (the trace itself is too large to bring back at 1M).
if only long1b-wait; then
  log="${LONG_LOG:-/tmp/odyssey-long1b.log}"
  pid="$(cat "${log%.log}.pid" 2>/dev/null || true)"
  [ -n "$pid" ] || { echo "long1b-wait: no ${log%.log}.pid (start it with long1b)"; exit 1; }
  waited=0
  while kill -0 "$pid" 2>/dev/null && [ "$waited" -lt "${LONG_WAIT:-500}" ]; do sleep 5; waited=$((waited + 5)); done
  if kill -0 "$pid" 2>/dev/null; then echo "long1b-wait: pid $pid still running after ${waited} s"; else echo "long1b-wait: pid $pid has exited"; fi
  grep -v '^| ' "$log" | tail -5
  grep '^| ' "$log" | head -40  # the step's row, then its phase times (without LONG_PROFILE)
  cp "$log" "${log%.log}.jsonl" "$out/" 2>/dev/null || true
  if [ -n "${LONG_PROFILE:-}" ] && ! kill -0 "$pid" 2>/dev/null && [ -f "$LONG_PROFILE/trace.json" ]; then
    python3 bench/profile_report.py "$LONG_PROFILE/trace.json" >"$out/long-profile.txt" 2>&1
    cp "$LONG_PROFILE"/*.png "$out/" 2>/dev/null || true
    head -40 "$out/long-profile.txt"
  fi
fi
# paralleltests: the GPU cases of the attention, communicator and context-parallel binaries:
# cuDNN's kept-attention kernels with native grouped-query K/V and with K/V expanded, ranks
# sharing one GPU keeping the TCP star, and two process-ranks of one context-parallel group in
# bf16 on the one GPU against one rank (ContextParallelGpuTest).
if only paralleltests; then
  build-gpu/kernels/attention_test --gtest_filter='*_cuda' 2>&1 | grep -E '^\[ *(OK|FAILED|SKIPPED|PASSED) |Failure|error' | tail -16
  build-gpu/engine/communicator_test --gtest_filter='NcclCommunicatorTest.*:ConnectRanks*' 2>&1 \
    | grep -E '^\[ *(OK|FAILED|SKIPPED|PASSED) |Failure|error' | tail -10
  build-gpu/engine/context_parallel_test --gtest_filter='ContextParallelGpuTest.*' 2>&1 \
    | grep -E '^\[ *(OK|FAILED|SKIPPED|PASSED) |Failure|error|bf16|loss:|rank' | tail -12
fi
# cp: one sequence over the host's GPUs (a host of 2 or more; issue 18's runs): the Llama-3.2-3B
# shape at CP_LEN (default 262144) on one GPU and over CP_RANKS (default 2) rank processes (NCCL),
# then sharded; hybrid-3b at 2 x CP_LEN over the same ranks. Each line: the slowest rank's step,
# the sequence's tok/s, the largest rank's GPU peak (odyssey-bench --context-parallel).
if only cp; then
  gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
  ranks="${CP_RANKS:-2}"
  if [ "$gpus" -lt "$ranks" ]; then
    echo "cp: $gpus GPU(s) here, $ranks ranks asked: skipped"
  else
    len="${CP_LEN:-262144}"
    run $B --seq-len "$len" --recompute layer --keep-attention --offload --warmup 0 --steps 1
    run $B --seq-len "$len" --recompute layer --keep-attention --offload --warmup 0 --steps 1 --context-parallel "$ranks"
    run $B --seq-len "$len" --recompute layer --keep-attention --offload --warmup 0 --steps 1 --context-parallel "$ranks" --shard
    run build-gpu/bench/odyssey-bench --model hybrid-3b --seq-len $((2 * len)) --recompute layer --offload \
      --device-resident 8 --mlp-tile 16384 --loss-tile 4096 --optimizer-on-host --warmup 0 --steps 1 \
      --context-parallel "$ranks" --json "$out/bench.jsonl"
  fi
fi
# hybrid: odyssey-hybrid-bench (KDA chunked, sparse attention, dense SDPA on as many keys) at
# HYB_LENS (default 65536,262144), then fla's chunk_kda on the same shapes (fla-core and einops
# wheels from .whl/, installed into a private folder: a benchmark peer, never a dependency).
if only hybrid; then
  # The hybrid kernels' GPU tests first (fused_ops_test: the short conv).
  for t in kda_test dsa_test fused_ops_test; do
    build-gpu/kernels/$t 2>&1 | grep -E '^\[ *(FAILED|PASSED|SKIPPED) |Failure' | tail -6
  done
  build-gpu/kernels/odyssey-hybrid-bench --ops kda,sparse,dense,kl --tokens "${HYB_LENS:-65536,262144}" --json "$out/hybrid.jsonl" 2>&1 | tail -12
  fla_peer hybrid "${HYB_LENS:-65536,262144}" "$out/hybrid.jsonl"
fi
# hybridstep: one full-depth hybrid-3b step (hybrid_step above) at each length of HYBSTEP_LENS
# (default 65536 262144), flags HYBSTEP_FLAGS: its row, then the GPU peak against the planner, the
# scope it was reached in, KDA's and DSA's phases summed. These are planner_test's hybrid-3b rows
# at 64K-256K: re-measure them with HYBSTEP_LENS="65536 131072 262144" after a change to the hybrid
# layers' memory (the 12-04 rows had gone 29-40% stale by 12-06).
if only hybridstep; then
  for s in ${HYBSTEP_LENS:-65536 262144}; do
    echo "+ hybrid-3b $s" >&2
    hybrid_step "$s" "$out/hybridstep.jsonl" "$out/hybridstep-$s.log"
  done
fi
# dsagroups: the DSA layer's backward in KV-head groups: hybrid-3b cut to 4 layers (KKKD: the
# peak in the DSA layer's backward) at DSAG_LEN (default 786432) with each head-group count of
# DSAG_GROUPS (default "1 8"), one step each under DSAG_TIMEOUT seconds (default 150); a line a
# run: groups, s/step, the GPU peak, the planner's prediction and its ratio to the peak, the
# sparse attention's backward time, the scope the peak was reached in.
if only dsagroups; then
  for g in ${DSAG_GROUPS:-1 8}; do
    echo "+ hybrid-3b x4 ${DSAG_LEN:-786432} head groups $g" >&2
    timeout "${DSAG_TIMEOUT:-150}" build-gpu/bench/odyssey-bench --model hybrid-3b --layers 4 --seq-len "${DSAG_LEN:-786432}" \
      --recompute layer --offload --device-resident 2 --mlp-tile 10922 --loss-tile 1046 --optimizer-on-host \
      --keep-selection --warmup 0 --steps 1 --phase-times --head-groups "$g" --json "$out/dsagroups.jsonl" \
      >"$out/dsagroups-$g.log" 2>&1 || { echo "dsagroups $g: exit $?"; tail -5 "$out/dsagroups-$g.log"; continue; }
    python3 bench/peak_report.py "$out/dsagroups.jsonl" --last --label head_groups --sum "dsa sparse attention backward"
  done
fi
# kdachunk: KDA's chunk size, C = 64 (the models' default) against C = 32, in one run: kda_test's
# CUDA cases; fla's chunk_kda alone on the GPU first (its wheel from .whl/, a benchmark peer);
# then the KDA op at KDAC_LENS (default 65536,262144) with the two sizes alternately, KDAC_ROUNDS
# times (default 3: one machine's figures move by a few % from run to run); then a full-depth
# hybrid-3b step at KDAC_STEP_LEN (default 65536, hybridstep's flags, HYBSTEP_FLAGS) at each size,
# with its GPU peak against the planner's prediction for that size (--kda-chunk-size) and the
# summed time of its KDA op scopes (kernels/kda.cc's "kda forward: ...", "kda backward: ...").
if only kdachunk; then
  build-gpu/kernels/kda_test --gtest_filter='*_cuda*' 2>&1 | grep -E '^\[ *(FAILED|PASSED|SKIPPED) |Failure' | tail -6
  lens="${KDAC_LENS:-65536,262144}"
  fla_peer kdachunk "$lens" "$out/kdachunk.jsonl"
  for round in $(seq "${KDAC_ROUNDS:-3}"); do
    for c in 64 32; do
      build-gpu/kernels/odyssey-hybrid-bench --ops kda --variants 0 --tokens "$lens" --iters 3 --reference-tokens 0 \
        --chunk "$c" --json "$out/kdachunk.jsonl" 2>&1 | grep '^| KDA' | sed "s/^/round $round C $c /"
    done
  done
  for c in 64 32; do
    hybrid_step "${KDAC_STEP_LEN:-65536}" "$out/kdachunk-step.jsonl" "$out/kdachunk-step-$c.log" --kda-chunk-size "$c"
  done
fi
# gqa: the 3B shape at GQA_LEN (default 64K) with the cuDNN kept-attention kernels on K/V
# expanded to the query heads (--cudnn-expand-kv, the older path), the peer mode's flags; run it
# beside `peer`, whose odyssey row has the default (native grouped-query K/V).
if only gqa; then
  run build-gpu/bench/odyssey-bench --model llama-3.2-3b --seq-len "${GQA_LEN:-65536}" \
    ${PEER_FLAGS:---recompute layer --keep-attention --offload --mlp-tile 16384 --loss-tile 4096} --steps 2 \
    --cudnn-expand-kv --json "$out/gqa.jsonl"
fi
# 512K full depth: 10 of 28 layer inputs stay on the GPU (peak ~118 GiB), the rest in pinned memory.
only 512k && run $B --seq-len 524288 --recompute layer --offload --device-resident 10 --head-groups 4 --warmup 0 --steps 1
# long1b (described above long1b-wait) comes last: a run that names other modes too runs them
# first, so the detached step has the GPU to itself from its start.
if only long1b; then
  log="${LONG_LOG:-/tmp/odyssey-long1b.log}"
  long_steps=1 phase_times=--phase-times
  [ -n "${LONG_PROFILE:-}" ] && long_steps=0 phase_times=
  setsid nohup build-gpu/bench/odyssey-bench --model "${LONG_MODEL:-llama-3.2-1b}" --seq-len "${LONG_LEN:-1048576}" \
    ${LONG_FLAGS:---recompute layer --offload --device-resident 8 --head-groups 2 --mlp-tile 16384 --loss-tile 4096} \
    ${LONG_PROFILE:+--profile "$LONG_PROFILE"} $phase_times --warmup 0 --steps "$long_steps" \
    --json "${log%.log}.jsonl" >"$log" 2>&1 < /dev/null &
  echo $! >"${log%.log}.pid"
  echo "long1b: started pid $! (log $log)"
fi
exit 0
