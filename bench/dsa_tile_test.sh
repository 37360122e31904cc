#!/usr/bin/env bash
# odyssey-bench --dsa-tile acts: a hybrid step with DSA query tiles of 5 on CPU, its JSON naming
# the tile; a tile of 0 and a model without DSA layers refused by name (exit 2). --keep-selection
# the same: a hybrid step naming it, a model without DSA layers refused. --kda-chunk-size too: a
# hybrid step at C = 32 whose JSON names it (the model's KDA layers run it), 48 and a model
# without KDA layers refused by name. $1: the binary.
set -uo pipefail
bench="$1"
fail() { echo "dsa_tile_test: $*" >&2; exit 1; }
out="$("$bench" --model hybrid-tiny --device cpu --dtype float32 --seq-len 48 --recompute layer --warmup 0 --steps 1 \
        --dsa-tile 5 2>&1)" || fail "the tiled step failed: $out"
grep -q '"dsa_tile":5[,}]' <<<"$out" || fail "the JSON does not name the tile: $out"
out="$("$bench" --model hybrid-tiny --device cpu --seq-len 48 --dsa-tile 0 2>&1)"
[ $? -eq 2 ] || fail "--dsa-tile 0 was not refused with exit 2: $out"
grep -q -- '--dsa-tile (0) must be >= 1' <<<"$out" || fail "--dsa-tile 0: $out"
out="$("$bench" --model tiny --device cpu --seq-len 48 --dsa-tile 8 2>&1)"
[ $? -eq 2 ] || fail "--dsa-tile on a model without DSA layers was not refused with exit 2: $out"
grep -q -- '--dsa-tile acts on DSA layers; tiny has none' <<<"$out" || fail "no DSA layers: $out"
out="$("$bench" --model hybrid-tiny --device cpu --dtype float32 --seq-len 48 --recompute layer --warmup 0 --steps 1 \
        --keep-selection 2>&1)" || fail "the step with kept selections failed: $out"
grep -q '"memory":"[^"]* keep_selection' <<<"$out" || fail "the JSON does not name keep_selection: $out"
out="$("$bench" --model tiny --device cpu --seq-len 48 --recompute layer --keep-selection 2>&1)"
[ $? -eq 2 ] || fail "--keep-selection on a model without DSA layers was not refused with exit 2: $out"
grep -q "memory.keep_selection acts on DSA layers in the sparse indexer stage; model 'tiny' has none" <<<"$out" \
  || fail "keep_selection without DSA layers: $out"
out="$("$bench" --model hybrid-tiny --device cpu --dtype float32 --seq-len 48 --recompute layer --warmup 0 --steps 1 \
        --kda-chunk-size 32 2>&1)" || fail "the step at KDA chunk 32 failed: $out"
grep -q '"kda_chunk_size":32[,}]' <<<"$out" || fail "the JSON does not name KDA chunk 32: $out"
out="$("$bench" --model hybrid-tiny --device cpu --dtype float32 --seq-len 48 --recompute layer --warmup 0 --steps 1 2>&1)" \
  || fail "the default step failed: $out"
grep -q '"kda_chunk_size":64[,}]' <<<"$out" || fail "the JSON does not name the default KDA chunk 64: $out"
out="$("$bench" --model hybrid-tiny --device cpu --seq-len 48 --kda-chunk-size 48 2>&1)"
[ $? -eq 2 ] || fail "--kda-chunk-size 48 was not refused with exit 2: $out"
grep -q 'kda_chunk_size (48) must be 32 or 64' <<<"$out" || fail "--kda-chunk-size 48: $out"
out="$("$bench" --model tiny --device cpu --seq-len 48 --kda-chunk-size 32 2>&1)"
[ $? -eq 2 ] || fail "--kda-chunk-size on a model without KDA layers was not refused with exit 2: $out"
grep -q 'kda_chunk_size: the model has no KDA layers' <<<"$out" || fail "no KDA layers: $out"
echo "dsa_tile_test: ok"
