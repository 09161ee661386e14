#!/bin/sh
# Test wrapper of scripts/sanitize.sh (meson test --wrapper): runs a test command as it is, except
# a Python test. /usr/bin/python3 is not instrumented and loads libzerod.so (instrumented) with
# ctypes, so the ASan runtime must come first in the process: it is preloaded into python3 only,
# never into meson. Every program such a test starts inherits it (zerod, pip, the shell tools);
# python3, numpy and torch keep memory until exit by design, so leaks are not looked for there
# (the C integration tests look for zerod's and libzerod's).
case "$1" in
  */python3*)
    LD_PRELOAD="$(gcc -print-file-name=libasan.so):$(gcc -print-file-name=libubsan.so)"
    ASAN_OPTIONS="${ASAN_OPTIONS:+$ASAN_OPTIONS:}detect_leaks=0"
    export LD_PRELOAD ASAN_OPTIONS
    ;;
esac
exec "$@"
