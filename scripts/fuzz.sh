#!/usr/bin/env bash
# The libFuzzer harnesses of tests/fuzz: configures build-fuzz once (clang, ASan + UBSan,
# -Dfuzz=true), builds the harnesses, then either runs the `fuzz` suite (a fixed number of inputs
# per harness from a fixed seed: seconds, what CI runs) or fuzzes each harness for a while.
#
#   scripts/fuzz.sh ci           build, run the fuzz suite
#   scripts/fuzz.sh [SECONDS]    build, fuzz each harness SECONDS (default 60) one after the other
#                                and print the executions each reached
#   scripts/fuzz.sh packages     prints the apt packages it needs besides scripts/quickstart.sh's
#
# A long run keeps what it learns in build-fuzz/fuzz-corpus/<harness> (the next run starts from
# there and the seeds in tests/fuzz/corpus) and writes a crash's input to
# build-fuzz/fuzz-crash/<harness>/; a crash fails the script. Keep an input worth keeping as a
# regression seed in tests/fuzz/corpus/<harness>/regress-<what>. Installs nothing.
set -euo pipefail
cd "$(dirname "$0")/.."

BUILD="build-fuzz"
HARNESSES=(frame layout config control session)

packages() {
  # clang-14 compiles the harnesses; libclang-rt-14-dev holds libFuzzer and clang's sanitizer
  # runtimes; llvm-14 the symbolizer that turns a crash's stack into file:line.
  echo clang-14 libclang-rt-14-dev llvm-14
}

configure_and_build() {
  if [ ! -f "$BUILD/build.ninja" ]; then
    CC=clang-14 CXX=clang++-14 meson setup "$BUILD" -Dfuzz=true -Db_sanitize=address,undefined \
      -Db_lundef=false -Dcuda=disabled -Dbuildtype=debugoptimized
  fi
  local targets=()
  for h in "${HARNESSES[@]}"; do targets+=("tests/fuzz/fuzz_$h"); done
  ninja -C "$BUILD" "${targets[@]}"
}

symbolizer() {
  local s=/usr/lib/llvm-14/bin/llvm-symbolizer
  if [ -x "$s" ]; then export ASAN_SYMBOLIZER_PATH="$s"; fi
}

fuzz_long() {
  local seconds=$1 h failed=0 log
  export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1}"
  export UBSAN_OPTIONS="${UBSAN_OPTIONS:-halt_on_error=1:abort_on_error=1:print_stacktrace=1}"
  for h in "${HARNESSES[@]}"; do
    mkdir -p "$BUILD/fuzz-corpus/$h" "$BUILD/fuzz-crash/$h"
    log="$BUILD/fuzz-crash/$h/last-run.log"
    if ! "$BUILD/tests/fuzz/fuzz_$h" -max_total_time="$seconds" -print_final_stats=1 \
      -error_exitcode=1 -timeout_exitcode=1 -artifact_prefix="$BUILD/fuzz-crash/$h/" \
      "$BUILD/fuzz-corpus/$h" "tests/fuzz/corpus/$h" >"$log" 2>&1; then
      failed=1
      echo "fuzz_$h: CRASH (log: $log)"
      grep -E 'ERROR:|FUZZ_CHECK|SUMMARY|Test unit written' "$log" | head -8 | sed 's/^/    /'
    fi
    echo "fuzz_$h: $(grep -E '^Done [0-9]+ runs' "$log" || echo 'no final stats (see the log)')," \
      "$(grep -oE 'cov: [0-9]+ ft: [0-9]+ corp: [0-9]+' "$log" | tail -1)"
  done
  return "$failed"
}

case "${1:-60}" in
  packages) packages ;;
  ci)
    configure_and_build
    symbolizer
    meson test -C "$BUILD" --no-rebuild --suite fuzz --print-errorlogs
    ;;
  *[!0-9]*)
    echo "usage: $0 [ci|SECONDS|packages]" >&2
    exit 2
    ;;
  *)
    configure_and_build
    symbolizer
    fuzz_long "$1"
    ;;
esac
