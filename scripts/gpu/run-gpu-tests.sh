#!/usr/bin/env bash
# On a GPU host after scripts/gpu/build.sh: runs the test suite of build-gpu (GPU tests included;
# they skip only where there is no GPU).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
export LD_LIBRARY_PATH="$root/.deps/prefix/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PATH="$root/.deps/prefix/bin:$PATH"  # `bible` for the kjv dataset (scripts/gpu/build.sh)
cd "$root/build-gpu"
ctest --output-on-failure "$@"
