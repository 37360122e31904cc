#!/bin/sh
# An sh_test's script for a test that CMake writes as a binary and its arguments
# (add_test(NAME n COMMAND binary args...)): runs its first argument with the rest.
# bench/BUILD's bench_fidelity_reference uses it.
exec "$@"
