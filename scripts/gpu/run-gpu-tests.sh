#!/usr/bin/env bash
# On a GPU host after scripts/gpu/build.sh: runs the test suite of build-gpu (GPU tests included;
# they skip only where there is no GPU).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$root/build-gpu"
ctest --output-on-failure "$@"
