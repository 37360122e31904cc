#!/usr/bin/env bash
# Installs what a fresh Debian 12 machine lacks to build and test odyssey:
# the Debian packages (toolchain, gRPC, protobuf, Abseil, prometheus-cpp, SQLite, CLI11,
# nlohmann-json, spdlog, yaml-cpp, cpp-httplib, GoogleTest, ccache, the bible-kjv text, OpenSSL
# headers for the TLS file checks and the openssl CLI for the TLS tests' throwaway CA, Prometheus
# for promtool, which checks deploy/prometheus/alerts.yml and fires each alert in a test,
# bazel-bootstrap for the Bazel build beside CMake, scripts/bazel-test.sh and docs/build.md) and a
# project-local Python venv (.venv) with torch==2.11.0 (the libtorch the build links) and
# transformers and peft (parity tests), grpcio + grpcio-tools + setuptools >= 70.1 (the Python
# client and its tests), kubernetes-validate (deploy/'s manifests against the Kubernetes schemas),
# matplotlib (`odyssey plot`). Idempotent: a second run only checks.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

debs=(build-essential cmake ninja-build ccache pkg-config git python3-venv
  libgrpc++-dev libgrpc-dev protobuf-compiler protobuf-compiler-grpc libprotobuf-dev
  libabsl-dev prometheus-cpp-dev libsqlite3-dev sqlite3 libcli11-dev nlohmann-json3-dev
  libspdlog-dev libfmt-dev libyaml-cpp-dev libcpp-httplib-dev libgtest-dev libgmock-dev
  libssl-dev openssl bible-kjv prometheus bazel-bootstrap)
missing=()
for p in "${debs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing Debian packages: ${missing[*]}"
  sudo_cmd=""
  [ "$(id -u)" -eq 0 ] || sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

py="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv"
  "$py" -m venv .venv
fi
if ! .venv/bin/python -c 'import torch, transformers, safetensors; assert torch.__version__.startswith("2.11.0")' 2>/dev/null; then
  echo "setup: installing torch==2.11.0 and transformers into .venv (large download, once)"
  .venv/bin/pip install -q --upgrade pip
  .venv/bin/pip install -q "torch==2.11.0" "transformers>=4.56,<5" safetensors numpy pyyaml grpcio grpcio-tools
fi
# peft (tests/parity/run_parity.py loads odyssey's LoRA adapter folders with it); a few seconds.
if ! .venv/bin/python -c 'import peft' 2>/dev/null; then
  echo "setup: installing peft into .venv"
  .venv/bin/pip install -q "peft>=0.13,<1"
fi
# The Python client's tests (client/python/tests) build and install the package offline
# (pip --no-build-isolation): they need grpcio-tools to generate its stubs and a setuptools that
# builds wheels on its own (>= 70.1; Debian 12's venv bundles 66, which needs `wheel`).
if ! .venv/bin/python - 2>/dev/null <<'PY'
import grpc, grpc_tools, google.protobuf, numpy, setuptools
assert tuple(int(x) for x in setuptools.__version__.split(".")[:2]) >= (70, 1)
PY
then
  echo "setup: installing grpcio, grpcio-tools, numpy and setuptools>=70.1 into .venv"
  .venv/bin/pip install -q grpcio grpcio-tools numpy "setuptools>=70.1"
fi
# deploy/'s manifests are validated against the Kubernetes schemas (tests/deploy/deploy_test.py):
# kubernetes-validate carries them (a 22 MB wheel, ~15 s to install once).
if ! .venv/bin/python -c 'import kubernetes_validate' 2>/dev/null; then
  echo "setup: installing kubernetes-validate into .venv"
  .venv/bin/pip install -q "kubernetes-validate==1.37.0"
fi
# `odyssey plot` draws a job's loss, tokens/s and GPU memory with matplotlib (client/python,
# odyssey_client/plot.py): 21 s to install with its dependencies (numpy too, into an empty
# folder) on the shared 2-core machine.
if ! .venv/bin/python -c 'import matplotlib' 2>/dev/null; then
  echo "setup: installing matplotlib into .venv"
  .venv/bin/pip install -q "matplotlib>=3.5"
fi
echo "setup: ok ($(.venv/bin/python -c 'import torch; print("torch", torch.__version__)'))"
