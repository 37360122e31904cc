#!/usr/bin/env bash
# Runs every test: installs what is missing (scripts/setup.sh), builds, then ctest.
# Extra arguments go to ctest (e.g. -R parity).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/build.sh
cd build
mkdir -p Testing
set +e
ctest --output-on-failure -j "${ODYSSEY_TEST_JOBS:-2}" "$@" 2>&1 | tee Testing/ctest-output.log
rc=${PIPESTATUS[0]}
set -e
# GPU-only tests skip without a GPU (ctest: "Not Run", "(Skipped)"): say how many, so a CPU
# run's summary shows that the CUDA paths were not exercised.
skipped=$(grep -c '(Skipped)$' Testing/ctest-output.log || true)
echo "tests: ctest exit ${rc}; ${skipped} skipped (GPU-only where no GPU is visible):" \
     "$(grep -E '\(Skipped\)$' Testing/ctest-output.log | awk '{print $3}' | tr '\n' ' ')"
exit "$rc"
