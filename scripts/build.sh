#!/usr/bin/env bash
# Configures and builds odyssey into build/ (CPU build against the venv's libtorch).
# Extra arguments go to cmake's configure step. Jobs: ODYSSEY_JOBS (default: nproc).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/setup.sh
export CCACHE_BASEDIR="${CCACHE_BASEDIR:-$root}"
export CCACHE_SLOPPINESS="${CCACHE_SLOPPINESS:-pch_defines,time_macros,include_file_mtime,include_file_ctime}"
# ODYSSEY_BUILD_TYPE (e.g. Check, the CI's: CMakeLists.txt) sets CMAKE_BUILD_TYPE; unset, a new
# build/ is RelWithDebInfo and an existing one keeps its type.
type_arg=()
[ -z "${ODYSSEY_BUILD_TYPE:-}" ] || type_arg=("-DCMAKE_BUILD_TYPE=${ODYSSEY_BUILD_TYPE}")
cmake -S . -B build -G Ninja "${type_arg[@]}" "$@" >/dev/null
ninja -C build -j "${ODYSSEY_JOBS:-$(nproc)}"
