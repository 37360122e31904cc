#!/usr/bin/env bash
# On a GPU host (Ubuntu 24.04, CUDA 13 with nvcc, torch 2.11 + CUDA in the default python3,
# CMake + Ninja, no package registry): unpacks the Debian packages that scripts/gpu/fetch-debs.sh
# put in .deps/debs into a private prefix (.deps/prefix), configures odyssey against the host's
# libtorch and CUDA for sm_90, and builds into build-gpu/.
#   ODYSSEY_SERVICE=OFF   build only the engine, model, planner, bench and their tests
#   PYTHON=...            the python whose torch to link (default: python3)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"
prefix="$root/.deps/prefix"
# Unpack once, and again when fetch-debs.sh added packages since (e.g. libssl-dev for TLS).
if [ ! -f "$prefix/.unpacked" ] || [ -n "$(find .deps/debs -name '*.deb' -newer "$prefix/.unpacked" 2>/dev/null)" ]; then
  ls .deps/debs/*.deb >/dev/null 2>&1 || { echo "no .deps/debs: run scripts/gpu/fetch-debs.sh on a machine with registries"; exit 2; }
  rm -rf "$prefix" && mkdir -p "$prefix"
  for d in .deps/debs/*.deb; do dpkg -x "$d" "$prefix"; done
  touch "$prefix/.unpacked"
fi
# `bible` (the kjv dataset) looks for its text in /usr/lib; this one reads the prefix's copy.
if [ -x "$prefix/usr/bin/bible" ]; then
  mkdir -p "$prefix/bin"
  printf '#!/bin/sh\nexec "%s" -p "%s" "$@"\n' "$prefix/usr/bin/bible" "$prefix/usr/lib" >"$prefix/bin/bible"
  chmod +x "$prefix/bin/bible"
fi
lib="$prefix/usr/lib/x86_64-linux-gnu"
export PATH="$prefix/bin:$prefix/usr/bin:$PATH"
export LD_LIBRARY_PATH="$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
py="${PYTHON:-python3}"
cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DODYSSEY_CUDA=ON -DODYSSEY_PYTHON="$(command -v "$py")" \
  -DODYSSEY_SERVICE="${ODYSSEY_SERVICE:-ON}" \
  -DCMAKE_CUDA_ARCHITECTURES=90 -DTORCH_CUDA_ARCH_LIST=9.0 \
  -DCMAKE_PREFIX_PATH="$prefix/usr" -DCMAKE_INCLUDE_PATH="$prefix/usr/include" -DCMAKE_LIBRARY_PATH="$lib" \
  -DCMAKE_EXE_LINKER_FLAGS="-L$lib -Wl,--disable-new-dtags -Wl,-rpath-link,$lib -Wl,-rpath,$lib" \
  -DCMAKE_SHARED_LINKER_FLAGS="-L$lib -Wl,-rpath-link,$lib" >/dev/null
ninja -C build-gpu -j "$(nproc)" "$@"
