#!/usr/bin/env bash
# On a Debian 12 machine with package registries: downloads the Debian runtime + dev packages
# that odyssey's binaries need into .deps/debs (ignored by git), for a GPU host that has no
# registry (Ubuntu 24.04 with CUDA and libtorch, but no gRPC/Abseil/...). scripts/gpu/build.sh
# unpacks them there into a private prefix. Idempotent.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
out="$root/.deps/debs"
mkdir -p "$out"
pkgs=(
  # core: every binary
  libabsl20220623 libabsl-dev nlohmann-json3-dev libcli11-dev libspdlog1.10 libspdlog-dev libfmt9 libfmt-dev
  libgtest-dev libgmock-dev googletest
  # service: gRPC, protobuf, SQLite, metrics, YAML
  libgrpc++1.51 libgrpc++-dev libgrpc29 libgrpc-dev libprotobuf32 libprotobuf-lite32 libprotobuf-dev libprotoc32
  protobuf-compiler protobuf-compiler-grpc libre2-9 libre2-dev libc-ares2 libc-ares-dev libupb0 libupb-dev
  libsqlite3-0 libsqlite3-dev libyaml-cpp0.7 libyaml-cpp-dev prometheus-cpp-dev libprometheus-cpp-core1.0
  libprometheus-cpp-pull1.0 libcpp-httplib0.11 libcpp-httplib-dev libcivetweb1 libcivetweb-dev
  # TLS: OpenSSL headers for common/tls.cc, and libssl3 so that libssl-dev's libcrypto.so
  # symlink resolves inside the private prefix (Debian's 3.0.x, which libgrpc was built against)
  libssl3 libssl-dev
  # the 'kjv' dataset (the tiny model's default text) reads the `bible` program's output;
  # build.sh puts a `bible` in .deps/prefix/bin that finds the text inside the prefix
  bible-kjv bible-kjv-text
)
missing=()
for p in "${pkgs[@]}"; do
  ls "$out/${p}_"*.deb >/dev/null 2>&1 || missing+=("$p")
done
if ((${#missing[@]})); then
  apt-get update -qq
  (cd "$out" && apt-get download "${missing[@]}")
fi
echo "fetch-debs: $(ls "$out"/*.deb | wc -l) packages, $(du -sh "$out" | cut -f1) in $out"
