#!/usr/bin/env bash
# odyssey-hybrid-bench refuses a bad flag on any machine, before it looks for a GPU: exit 2 and a
# message naming the flag and the rule; valid flags on a machine without a GPU end with exit 1 and
# "needs a CUDA device" (on a GPU host the same check is skipped: the bench would run). $1: the
# binary.
set -uo pipefail
bench="$1"
fail() { echo "hybrid_bench_flags_test: $*" >&2; exit 1; }
refused() {  # refused "expected message" flags...: exit 2 with the message
  local want="$1"; shift
  out="$("$bench" "$@" 2>&1)"
  local rc=$?
  [ "$rc" -eq 2 ] || fail "$* exited $rc, not 2: $out"
  grep -qF -- "$want" <<<"$out" || fail "$*: the message does not say '$want': $out"
}
refused "--tokens: 64k is not an integer" --tokens 64k
refused "--iters: 99999999999999999999 is not an integer" --iters 99999999999999999999
refused "--tokens: 0 must be at least 1" --tokens 65536,0
refused "--iters: 0 must be at least 1" --iters 0
refused "--kv-heads: 5 does not divide --heads (24)" --kv-heads 5
refused "--chunk: 48 is neither 32 nor 64" --chunk 48
refused "--segment: 100 is not a positive multiple of the chunk (64)" --segment 100
refused "--variants: 4 is not one of" --variants 0,4
refused "--gate: medium is neither mild nor strong" --gate medium
refused "--kda-direct: some is neither on nor off" --kda-direct some
refused "--kda-scan-operands: fp16 is neither tf32 nor bf16" --kda-scan-operands fp16
refused "--kda-scan-value-block: 8 is neither 32 nor 16" --kda-scan-value-block 8
refused "--kda-backward-inverse: keep is neither read nor recompute" --kda-backward-inverse keep
refused "--ops: unknown op attention" --ops kda,attention
refused "unknown flag --chunks" --chunks 32
refused "--json needs a value" --ops kda --json
# A value that is not UTF-8 comes back escaped, not raw.
out="$("$bench" --gate $'\xff' 2>&1)"
grep -qF -- '--gate: \xff is neither' <<<"$out" || fail "a non-UTF-8 value is not escaped: $out"
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi >/dev/null 2>&1; then
  out="$("$bench" --ops kda --tokens 4096 --chunk 32 2>&1)"
  rc=$?
  [ "$rc" -eq 1 ] || fail "valid flags without a GPU exited $rc, not 1: $out"
  grep -qF "needs a CUDA device" <<<"$out" || fail "valid flags without a GPU: $out"
fi
echo "hybrid_bench_flags_test: ok"
