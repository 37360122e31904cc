#!/bin/sh
echo "bazel coverage is not supported by odyssey's offline Bazel build (docs/build.md)" >&2
exit 1
