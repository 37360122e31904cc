# Sourced by the scripts of scripts/gpu that run what scripts/gpu/build.sh built: sets `root`
# (the checkout), puts the private prefix's libraries on LD_LIBRARY_PATH and its `bible` (the
# kjv dataset's text) on PATH, and defines wait_file PATH (waits up to 60 s for a non-empty
# file, prints it).
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
export LD_LIBRARY_PATH="$root/.deps/prefix/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PATH="$root/.deps/prefix/bin:$PATH"
wait_file() { for _ in $(seq 600); do [ -s "$1" ] && { cat "$1"; return 0; }; sleep 0.1; done; echo "no $1" >&2; return 1; }
