#!/usr/bin/env bash
# Mutation check of the core behaviours: each mutant in scripts/mutants.txt is a one-line change
# of the project's own source (resume from a stale checkpoint, offload silently off, weight
# decay on 1-D parameters, ...). For each, in turn: the line is replaced in place, the one test
# target it names is rebuilt incrementally in build/ (ninja + ccache: one translation unit and
# one link), and the test it names must FAIL. A mutant that passes means the test guarding that
# behaviour was weakened (or the behaviour moved without its test): the script fails naming
# it. A mutant whose line is no longer in its file (or is there twice), or that no longer
# compiles, fails the script as loudly: update its entry.
#
# Every source is restored after its mutant (also on error or Ctrl-C, by a trap), the targets
# are rebuilt from the restored sources at the end (ccache hits), and the script checks that
# every mutated file is byte-for-byte what it was before.
#
# Usage: scripts/mutants.sh [NAME_REGEX]   (needs build/ configured and built: scripts/build.sh)
#        scripts/mutants.sh --lines          (no build: only checks that every entry's file exists
#                                             and holds its `from` line exactly once; the test
#                                             suite runs it as ctest `mutant_lines`, so a moved
#                                             line fails in seconds, not after the whole check)
# Environment: ODYSSEY_MUTANT_JOBS (ninja -j, default 2), ODYSSEY_MUTANT_TIMEOUT (seconds per
# test run, default 600), ODYSSEY_MUTANT_WHOLE=1 (run each mutant's whole test binary or
# unittest file instead of the one named test: how the "before" counts in docs/architecture.md
# were taken, against the tests as they were).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
only="${1:-}"
lines_only=0
if [ "$only" = "--lines" ]; then lines_only=1; only=""; fi
jobs="${ODYSSEY_MUTANT_JOBS:-2}"
limit="${ODYSSEY_MUTANT_TIMEOUT:-600}"
table="scripts/mutants.txt"
export CCACHE_BASEDIR="${CCACHE_BASEDIR:-$root}"
export CCACHE_SLOPPINESS="${CCACHE_SLOPPINESS:-pch_defines,time_macros,include_file_mtime,include_file_ctime}"
[ "$lines_only" = 1 ] || [ -f build/build.ninja ] || { echo "mutants: build/ is not configured (run scripts/build.sh first)" >&2; exit 2; }

backup_dir="$(mktemp -d)"
current=""  # the file mutated right now (restored by the trap)
restore() {
  if [ -n "$current" ]; then
    cp -p "$backup_dir/current" "$current"
    touch "$current"  # newer than the mutant's objects: ninja rebuilds the original
    current=""
  fi
}
trap 'restore; rm -rf "$backup_dir"' EXIT
trap 'exit 130' INT TERM

# Replaces the one line of $1 equal to $2 (whole line, exactly once) with $3.
# Exit 3: the line is missing or not unique.
mutate() {
  python3 - "$1" "$2" "$3" <<'EOF'
import sys
path, old, new = sys.argv[1:]
lines = open(path).read().split("\n")
hits = [i for i, line in enumerate(lines) if line == old]
if len(hits) != 1:
    print(f"{path}: the line occurs {len(hits)} times (want exactly 1): {old.strip()}", file=sys.stderr)
    sys.exit(3)
lines[hits[0]] = new
open(path, "w").write("\n".join(lines))
EOF
}

declare -a names files froms tos builds tests
name="" file="" from="" to="" build="" test=""
flush() {
  if [ -n "$name" ]; then
    names+=("$name"); files+=("$file"); froms+=("$from"); tos+=("$to"); builds+=("$build"); tests+=("$test")
  fi
  name="" file="" from="" to="" build="" test=""
}
while IFS= read -r line || [ -n "$line" ]; do
  case "$line" in
    '#'* ) continue ;;
    '' ) flush; continue ;;
  esac
  key="${line%% *}"
  value=""
  [ "$key" = "$line" ] || value="${line#* }"
  case "$key" in
    mutant) flush; name="$value" ;;
    file) file="$value" ;;
    from) from="$value" ;;
    to) to="$value" ;;
    build) build="$value" ;;
    test) test="$value" ;;
    *) echo "mutants: $table: unknown key '$key' in: $line" >&2; exit 2 ;;
  esac
done < "$table"
flush

if [ "$lines_only" = 1 ]; then
  bad=0
  for i in "${!names[@]}"; do
    f="${files[$i]}"
    if [ ! -f "$f" ]; then echo "mutant ${names[$i]}: BROKEN: $f does not exist"; bad=$((bad + 1)); continue; fi
    n=$(python3 -c 'import sys; print(open(sys.argv[1]).read().split("\n").count(sys.argv[2]))' "$f" "${froms[$i]}")
    if [ "$n" != 1 ]; then
      echo "mutant ${names[$i]}: BROKEN: its line occurs $n times in $f (want exactly 1): ${froms[$i]## }"
      bad=$((bad + 1))
    fi
  done
  echo "mutants: ${#names[@]} entries, $bad with a missing or repeated line"
  [ "$bad" -eq 0 ]
  exit
fi

killed=0 survived=() broken=() targets=() sums=()
start=$(date +%s)
# File by file (the table's order within a file): a file restored after its mutant need not be
# compiled again before its next mutant, only after its last.
mapfile -t order < <(for i in "${!names[@]}"; do printf '%s\t%s\n' "${files[$i]}" "$i"; done | sort -s -t $'\t' -k1,1 | cut -f2)
for i in "${order[@]}"; do
  n="${names[$i]}"
  if [ -n "$only" ] && ! [[ "$n" =~ $only ]]; then continue; fi
  f="${files[$i]}" b="${builds[$i]}" t="${tests[$i]}"
  if [ "${ODYSSEY_MUTANT_WHOLE:-0}" = 1 ]; then
    t="${t%% --gtest_filter=*}"
    t="$(echo "$t" | sed -E 's/ [A-Za-z]+Test\.test_[A-Za-z0-9_]+$//')"
  fi
  t0=$(date +%s)
  [ -f "$f" ] || { echo "mutant $n: BROKEN: $f does not exist"; broken+=("$n"); continue; }
  sums+=("$(sha256sum "$f")")
  cp -p "$f" "$backup_dir/current"
  current="$f"
  if ! mutate "$f" "${froms[$i]}" "${tos[$i]}"; then
    echo "mutant $n: BROKEN: its line is not in $f once; update scripts/mutants.txt"
    broken+=("$n"); restore; continue
  fi
  if [ -n "$b" ]; then
    targets+=("$b")
    if ! log=$(nice -n 10 ninja -C build -j "$jobs" $b 2>&1); then
      echo "$log" | tail -20
      echo "mutant $n: BROKEN: does not compile"
      broken+=("$n"); restore; continue
    fi
  fi
  set +e
  out=$(timeout "$limit" bash -c "$t" 2>&1)
  rc=$?
  set -e
  restore
  dt=$(( $(date +%s) - t0 ))
  if [ "$rc" -ne 0 ]; then
    # (a test whose output names no failing case, e.g. a plain script, is named by its command)
    failed=$( { echo "$out" | grep -oE '^\[  FAILED  \] [A-Za-z][^ ]*|^(FAIL|ERROR): [^ ]+' || true; } |
             sed -E 's/^\[  FAILED  \] //' | sort -u | head -3 | tr '\n' ' ')
    echo "mutant $n: killed (${dt}s, exit $rc) by ${failed:-$t}"
    killed=$((killed + 1))
  else
    echo "mutant $n: SURVIVED (${dt}s): $f: '${tos[$i]## }' passes: $t"
    survived+=("$n")
  fi
done

# Rebuild what was built from mutants, from the restored sources.
if [ "${#targets[@]}" -gt 0 ]; then
  mapfile -t unique < <(printf '%s\n' "${targets[@]}" | tr ' ' '\n' | sort -u)
  nice -n 10 ninja -C build -j "$jobs" "${unique[@]}" >/dev/null
fi
for s in "${sums[@]}"; do
  echo "$s" | sha256sum --check --quiet - || { echo "mutants: a source was not restored: $s" >&2; exit 1; }
done

total=$(( killed + ${#survived[@]} + ${#broken[@]} ))
echo "mutants: $killed killed, ${#survived[@]} survived, ${#broken[@]} broken (of $total, $(( $(date +%s) - start ))s)"
[ "${#survived[@]}" -eq 0 ] || echo "mutants: survived: ${survived[*]}"
[ "${#broken[@]}" -eq 0 ] || echo "mutants: broken: ${broken[*]}"
[ "${#survived[@]}" -eq 0 ] && [ "${#broken[@]}" -eq 0 ]
