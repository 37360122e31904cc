#!/usr/bin/env bash
# Runs every test: installs what is missing (scripts/setup.sh), builds, then ctest.
# Extra arguments go to ctest (e.g. -R parity).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/build.sh
cd build
ctest --output-on-failure -j "${ODYSSEY_TEST_JOBS:-2}" "$@"
