#!/usr/bin/env bash
# The main job on the embedded default: trains the tiny byte-level model on the King James
# Bible text (on the GPU if there is one, else the CPU) and writes a Hugging Face checkpoint
# to out/demo. Extra arguments go to odyssey-train (see --help).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/build.sh
exec build/tools/odyssey-train --model tiny --data kjv --out out/demo "$@"
