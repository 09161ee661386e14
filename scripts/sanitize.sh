#!/usr/bin/env bash
# zerod under AddressSanitizer + UndefinedBehaviorSanitizer (and LeakSanitizer, part of ASan):
# configures build-asan once, builds it and runs the unit and integration suites there. CI runs it
# after the normal tests (scripts/quickstart.sh test).
#
# Any report fails the run (halt_on_error, abort_on_error), not just the test that hit it: a zerod
# started by a test writes its stderr to a log the test deletes, and not every test checks how
# each zerod exited. So ASan and LSan reports also go to files under build-asan/sanitizer-logs,
# and this script fails, printing them, when there is any; gcc's UBSan writes only to stderr, and
# tests/harness.c fails a test whose zerod logged a report. Suppressions: tests/sanitizers/*.supp,
# third-party code only.
#
#   scripts/sanitize.sh            build, run the unit and integration suites
#   scripts/sanitize.sh python     the same plus the python suite (tests/sanitizers/wrap.sh
#                                  preloads the ASan runtime into python3, leak checks off there)
#   scripts/sanitize.sh tsan       ThreadSanitizer (build-tsan): the unit and integration suites
#                                  and the Python world tests against TSan's zerod (run_tsan)
#   scripts/sanitize.sh packages   prints the apt packages it needs besides scripts/quickstart.sh's
#
# Installs nothing. gcc's sanitizer runtimes (libasan8, libubsan1, libtsan2) come with gcc.
set -euo pipefail
cd "$(dirname "$0")/.."

BUILD="build-asan"

packages() {
  : # none: gcc depends on libasan8, libubsan1 and libtsan2 (through libgcc-12-dev)
}

configure_and_build() {
  # No CUDA: the sanitizers do not see into device code, and nvcc's host compiler would need the
  # same flags. debugoptimized: -O2 as shipped (the kernels' wide paths included), with symbols.
  if [ ! -f "$BUILD/build.ninja" ]; then
    CC=gcc CXX=g++ meson setup "$BUILD" -Db_sanitize=address,undefined -Db_lundef=false \
      -Dcuda=disabled -Dbuildtype=debugoptimized
  fi
  ninja -C "$BUILD"
}

# Options shared by every process of the run: the tests, the zerods they start, python3.
# ZEROD_TEST_SANITIZER tells the tests (tests/harness.h, tests/python/common.py) that zerod runs
# 2-15x slower: their wall-clock bounds are not checked and their hang timeouts are longer.
export_options() {
  local supp logs
  export ZEROD_TEST_SANITIZER=1
  supp="$PWD/tests/sanitizers"
  logs="$PWD/$BUILD/sanitizer-logs"
  rm -rf "$logs"
  mkdir -p "$logs"
  export ASAN_OPTIONS="halt_on_error=1:abort_on_error=1:detect_leaks=1:\
detect_stack_use_after_return=1:check_initialization_order=1:strict_init_order=1:\
suppressions=$supp/asan.supp:log_path=$logs/asan"
  export LSAN_OPTIONS="suppressions=$supp/lsan.supp:print_suppressions=0"
  export UBSAN_OPTIONS="halt_on_error=1:abort_on_error=1:print_stacktrace=1:report_error_type=1:\
suppressions=$supp/ubsan.supp:log_path=$logs/ubsan"
}

# Prints every report written during the run; fails if there is one.
check_logs() {
  local logs="$BUILD/sanitizer-logs" f found=0
  for f in "$logs"/*; do
    [ -e "$f" ] || continue
    found=1
    echo "==== sanitizer report: $f ====" >&2
    cat "$f" >&2
  done
  return "$found"
}

run_suites() {
  local rc=0 suites=(--suite unit --suite integration)
  [ "${1:-}" != python ] || suites+=(--suite python)
  export_options
  # The wrapper preloads the ASan runtime into the Python tests (integration/metrics and the
  # python suite), which load libzerod.so into /usr/bin/python3.
  meson test -C "$BUILD" "${suites[@]}" --print-errorlogs --wrapper "$PWD/tests/sanitizers/wrap.sh" ||
    rc=$?
  check_logs || rc=1
  return "$rc"
}

# ThreadSanitizer (build-tsan, no CUDA): the unit and integration suites, then the Python tests
# that run worlds of several ranks and zerods (heals, kills, drains, TLS, the fault trials) against
# TSan's zerod and zeroctl. python3 is not instrumented, so those load the normal build's
# libzerod (build/, which the test command builds first): the daemon is what is checked. The
# colours test is left out: it reads zerod's mappings from /proc, where TSan's own mappings of the
# same size confuse it. Gloo, gRPC and OpenSSL are uninstrumented: tests/sanitizers/tsan.supp
# says what is suppressed and why. Any report fails the run, printed by location.
TSAN_PYTHON_TESTS=(tests/integration/test_tls.py tests/integration/test_metrics.py
  tests/python/test_abandon.py tests/python/test_checkpoint.py tests/python/test_drain.py
  tests/python/test_heal_shutdown.py tests/python/test_rank_handover.py
  "tests/python/fault_trials.py --trials 8 --min-effective 6 --zerod-restart-delay 1.5,2")

run_tsan() {
  local build="build-tsan" logs rc=0 t
  if [ ! -f build/client/libzerod.so ]; then
    echo "$0 tsan: build/ (the normal build) is needed for the Python tests' libzerod" >&2
    return 2
  fi
  if [ ! -f "$build/build.ninja" ]; then
    CC=gcc CXX=g++ meson setup "$build" -Db_sanitize=thread -Db_lundef=false -Dcuda=disabled \
      -Dbuildtype=debugoptimized
  fi
  ninja -C "$build"
  logs="$PWD/$build/sanitizer-logs"
  rm -rf "$logs"
  mkdir -p "$logs"
  # exitcode=0: a report must not stop a test half-way; the logs say what was found.
  export TSAN_OPTIONS="suppressions=$PWD/tests/sanitizers/tsan.supp:log_path=$logs/tsan:exitcode=0"
  export ZEROD_TEST_SANITIZER=1 # no wall-clock bounds, longer hang timeouts (export_options)
  meson test -C "$build" --no-rebuild --print-errorlogs --suite unit || rc=$?
  # shellcheck disable=SC2046 # one test name per word
  meson test -C "$build" --no-rebuild --print-errorlogs --suite integration \
    $(meson test -C "$build" --no-rebuild --list --suite integration 2>/dev/null |
      sed -n 's|^zerod:integration / ||p' | grep -vx -e colours -e metrics -e tls) || rc=$?
  for t in "${TSAN_PYTHON_TESTS[@]}"; do
    echo "tsan: $t"
    # shellcheck disable=SC2086 # a test and its arguments
    ZEROD_BIN="$PWD/$build/daemon/zerod" ZEROCTL_BIN="$PWD/$build/client/zeroctl" \
      ZEROD_LIBRARY="$PWD/build/client/libzerod.so" PYTHONPATH="$PWD/client/python" \
      ZEROD_BACKEND=cpu timeout 600 /usr/bin/python3 $t >"$logs/python.log" 2>&1 ||
      { rc=1; cat "$logs/python.log" >&2; }
  done
  rm -f "$logs/python.log"
  if compgen -G "$logs/tsan.*" >/dev/null; then
    echo "ThreadSanitizer reports by location (full reports in $logs):" >&2
    grep -h '^SUMMARY' "$logs"/tsan.* | sort | uniq -c | sort -rn >&2
    cat "$logs"/tsan.* >&2
    rc=1
  fi
  return "$rc"
}

case "${1:-}" in
  packages) packages ;;
  tsan) run_tsan ;;
  "" | python)
    configure_and_build
    run_suites "${1:-}"
    ;;
  *)
    echo "usage: $0 [python|tsan|packages]" >&2
    exit 2
    ;;
esac
