#!/usr/bin/env bash
# The Bazel build beside CMake (docs/build.md): builds the torch-free binaries
# (odyssey-controller, odyssey, odyssey-plan), runs every torch-free GoogleTest test with
# `bazel test`, then checks that the Bazel and CMake builds name the same sources and tests
# (scripts/bazel-drift.py). Offline; installs nothing beyond scripts/setup.sh (bazel-bootstrap
# among its Debian packages). Extra arguments go to `bazel test` (e.g. //server/...).
# `bazel test //...` builds every target it names, the binaries too. Jobs: .bazelrc's (2);
# ODYSSEY_BAZEL_ARGS adds flags (e.g. --config=big, --config=opt).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
if ! command -v bazel >/dev/null; then
  echo "bazel-test: no bazel on PATH: run scripts/setup.sh (Debian's bazel-bootstrap)" >&2
  exit 1
fi
start=$(date +%s)
targets=("$@")
((${#targets[@]})) || targets=(//...)
# shellcheck disable=SC2086
nice -n 10 bazel test ${ODYSSEY_BAZEL_ARGS:-} "${targets[@]}"
python3 scripts/bazel-drift.py
echo "bazel-test: ok in $(( $(date +%s) - start )) s"
