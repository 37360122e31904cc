#!/usr/bin/env bash
# The Bazel build beside CMake (docs/build.md).
#
#   scripts/bazel-test.sh          the torch-free part (what CI runs): builds odyssey-controller,
#                                  odyssey and odyssey-plan, runs the GoogleTest tests of proto/,
#                                  common/, planner/, server/ and client/, then checks that the
#                                  Bazel and CMake builds name the same sources and tests,
#                                  libtorch folders included (scripts/bazel-drift.py).
#   scripts/bazel-test.sh --all    the whole tree: also the libtorch targets (kernels/, model/,
#                                  engine/, worker/, tools/, bench/ against the venv's libtorch)
#                                  and their tests; a cold build of it is far past CI's budget
#                                  (docs/build.md has the figures), so CI does not run it. Bazel's
#                                  disk cache (ODYSSEY_BAZEL_DISK_CACHE, default
#                                  ~/.cache/odyssey-bazel-disk) keeps its compiles across
#                                  checkouts and `bazel clean`.
#
# Offline; installs nothing beyond scripts/setup.sh (bazel-bootstrap among its Debian packages,
# the venv's torch). Other arguments go to `bazel test` in place of the default targets (e.g.
# //server/...). Jobs: .bazelrc's (2); ODYSSEY_BAZEL_ARGS adds flags (e.g. --config=big,
# --config=opt, --jobs=1).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
if ! command -v bazel >/dev/null; then
  echo "bazel-test: no bazel on PATH: run scripts/setup.sh (Debian's bazel-bootstrap)" >&2
  exit 1
fi
start=$(date +%s)
all=0
targets=()
for a in "$@"; do
  if [[ "$a" == --all ]]; then all=1; else targets+=("$a"); fi
done
flags=()
if ((all)); then
  cache="${ODYSSEY_BAZEL_DISK_CACHE:-$HOME/.cache/odyssey-bazel-disk}"
  mkdir -p "$cache"
  flags+=("--disk_cache=$cache")
  ((${#targets[@]})) || targets=(//...)
elif ! ((${#targets[@]})); then
  # The torch-free part, what CI builds: none of these loads @torch (the venv's libtorch).
  # engine/'s, worker/'s and model/'s torch-free tests (rl_datum_test, checkpoint_folder_test,
  # config_test) are left to --all: ctest runs them in CI already, and their compiles would
  # cost CI time for nothing new.
  targets=(//:binaries //proto/... //common/... //planner/... //server/... //client/...
           //model:odyssey_model_config)
fi
# shellcheck disable=SC2086
nice -n 10 bazel test ${ODYSSEY_BAZEL_ARGS:-} "${flags[@]}" "${targets[@]}"
python3 scripts/bazel-drift.py
echo "bazel-test: ok in $(( $(date +%s) - start )) s"
