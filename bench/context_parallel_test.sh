#!/usr/bin/env bash
# odyssey-bench --context-parallel: hybrid-tiny on CPU over 2 rank processes (TCP), sharded: one
# line for the group with both ranks' figures, their losses equal to each other and, within
# 1e-5, to one process's step on the same batch and weights; bad combinations refused by name
# (exit 2). $1: the binary.
set -uo pipefail
bench="$1"
fail() { echo "context_parallel_test: $*" >&2; exit 1; }
args=(--model hybrid-tiny --device cpu --dtype float32 --seq-len 64 --recompute layer --warmup 0 --steps 1)
group="$("$bench" "${args[@]}" --context-parallel 2 --shard 2>&1)" || fail "the 2-rank run failed: $group"
one="$("$bench" "${args[@]}" 2>&1)" || fail "the one-process run failed: $one"
python3 - "$group" "$one" <<'PY' || exit 1
import json, sys
def line(text):
    return json.loads(next(l for l in text.splitlines() if l.startswith("{")))
group, one = line(sys.argv[1]), line(sys.argv[2])
ranks = group.get("ranks", [])
ok = len(ranks) == 2 and [r["rank"] for r in ranks] == [0, 1] and all(r["sharded"] for r in ranks)
ok = ok and ranks[0]["loss"] == ranks[1]["loss"] == group["loss"]
ok = ok and abs(group["loss"] - one["loss"]) <= 1e-5 * abs(one["loss"]) and group["seconds_per_step"] > 0
if not ok:
    print(f"context_parallel_test: group {group}\n one process {one}", file=sys.stderr)
    sys.exit(1)
print(f"context_parallel_test: 2 ranks loss {group['loss']:.7f}, one process {one['loss']:.7f}")
PY
out="$("$bench" --model tiny --device cpu --seq-len 64 --shard 2>&1)"
[ $? -eq 2 ] || fail "--shard without --context-parallel was not refused with exit 2: $out"
grep -q -- '--shard needs --context-parallel > 1' <<<"$out" || fail "--shard alone: $out"
out="$("$bench" --model tiny --device cpu --seq-len 64 --context-parallel 2 --fidelity 2>&1)"
[ $? -eq 2 ] || fail "--context-parallel with --fidelity was not refused with exit 2: $out"
grep -q -- '--context-parallel with --fidelity is not implemented' <<<"$out" || fail "--fidelity: $out"
echo "context_parallel_test: ok"
