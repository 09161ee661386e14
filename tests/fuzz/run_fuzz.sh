#!/bin/sh
# Runs one libFuzzer harness from its seed corpus (tests/fuzz/meson.build, scripts/fuzz.sh):
#   run_fuzz.sh HARNESS SEEDS WORK [libFuzzer flags...]
# New inputs go to WORK/corpus, emptied first, never to SEEDS (the checked-in corpus); a crash
# input is kept as WORK/crash-* (or leak-*, timeout-*), and its path printed by libFuzzer.
# A sanitizer report aborts the run: libFuzzer then saves the input and exits non-zero.
set -eu
harness=$1 seeds=$2 work=$3
shift 3
rm -rf "$work"
mkdir -p "$work/corpus"
export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-halt_on_error=1:abort_on_error=1:print_stacktrace=1}"
exec "$harness" -artifact_prefix="$work/" -print_final_stats=1 -error_exitcode=1 -timeout_exitcode=1 "$@" "$work/corpus" "$seeds"
