#!/usr/bin/env bash
# zerod quick start on Debian 12: installs what zerod needs, builds it, then runs the main job
# (a local zerod world of two ranks training a small PyTorch model, next to a torch-only
# baseline) or every test suite.
#
#   scripts/quickstart.sh demo    install, build, run the demo
#   scripts/quickstart.sh test    install, build, run all tests, then the unit and integration
#                                 suites under ASan+UBSan and under TSan (with the Python world
#                                 tests), and the fuzz harnesses (what CI runs)
#   scripts/quickstart.sh build   install and build only
#
# Where nvcc is found, the build must have the CUDA backend, and with it the gpu test suite: the
# test command fails before running anything when it does not (meson setup's warning says what
# is missing, NCCL or the CUDA runtime). --no-cuda (after the command) builds without CUDA on
# purpose (-Dcuda=disabled) and tests without the gpu suite.
set -euo pipefail
cd "$(dirname "$0")/.."

sudo_cmd=()
[ "$(id -u)" -eq 0 ] || sudo_cmd=(sudo)

# Extra packages as arguments (the tests add clang-format, yamllint and systemd-analyze for the
# lint suite).
install_deps() {
  "${sudo_cmd[@]}" apt-get update -q
  "${sudo_cmd[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
    gcc g++ meson ninja-build pkg-config libuv1-dev libprotobuf-c-dev protobuf-c-compiler \
    libgrpc-dev libgloo-dev libmicrohttpd-dev libjansson-dev libxxhash-dev python3 python3-numpy python3-torch python3-venv \
    python3-pip python3-wheel etcd-server "$@"
}

# promtool (checks the metrics exposition) without the rest of Debian's prometheus package (its
# dependencies are about 320 MB and its postinst starts a Prometheus server): the binary only.
install_promtool() {
  command -v promtool >/dev/null && return
  local tmp
  tmp=$(mktemp -d)
  (cd "$tmp" && apt-get download prometheus >/dev/null &&
    dpkg-deb --fsys-tarfile prometheus_*.deb | tar -xO ./usr/bin/promtool >promtool)
  "${sudo_cmd[@]}" install -m 755 "$tmp/promtool" /usr/local/bin/promtool
  rm -rf "$tmp"
}

no_cuda=0

build() {
  # The CUDA backend is built wherever nvcc is found (meson option cuda=auto), unless --no-cuda.
  if [ -x /usr/local/cuda/bin/nvcc ]; then export PATH="/usr/local/cuda/bin:$PATH"; fi
  if [ "$no_cuda" = 1 ]; then
    if [ -f build/build.ninja ]; then meson configure build -Dcuda=disabled; else
      meson setup build -Dcuda=disabled; fi
  fi
  [ -f build/build.ninja ] || meson setup build
  ninja -C build
}

# Fails when nvcc is here but build/ has no CUDA backend: its gpu suite would be left out of the
# run without a word. The gpu suite's CUDA tests (cuda_available and the others) exist only in a
# build with the backend; python_torch_cuda, in the same suite, exists in every build.
check_gpu_suite() {
  local nvcc
  nvcc=$(command -v nvcc) || return 0
  if [ "$no_cuda" = 1 ]; then
    echo "quickstart: nvcc is at $nvcc; --no-cuda: built and tested without the CUDA backend"
    return 0
  fi
  if meson introspect build --tests | python3 -c '
import json, sys
tests = json.load(sys.stdin)
gpu = [t for t in tests if "zerod:gpu" in t["suite"] and t["name"] == "cuda_available"]
sys.exit(0 if gpu else 1)'
  then
    return 0
  fi
  echo "quickstart: nvcc is at $nvcc, but build/ has no CUDA backend, so the gpu test suite" \
    "would not run. meson setup's warning (meson-logs/meson-log.txt in build/) names what is" \
    "missing, NCCL or the CUDA runtime; 'meson configure build | grep cuda' shows the option." \
    "Install what is missing and reconfigure (meson setup --reconfigure build), or run" \
    "'$0 test --no-cuda' to test without CUDA on purpose." >&2
  return 1
}

demo() {
  # Starts its own zerod (world size 2: one daemon, two local ranks) and two trainer processes.
  /usr/bin/python3 examples/train_torch.py
}

run_tests() {
  meson test -C build --print-errorlogs
}

case "${2:-}" in
  "") ;;
  --no-cuda) no_cuda=1 ;;
  *) echo "usage: $0 demo|test|build [--no-cuda]" >&2; exit 2 ;;
esac

case "${1:-}" in
  demo) install_deps; build; demo ;;
  test)
    # shellcheck disable=SC2046 # one package name per word
    install_deps clang-format git yamllint systemd openssl abigail-tools $(scripts/sanitize.sh packages) \
      $(scripts/fuzz.sh packages)
    install_promtool
    build
    check_gpu_suite
    # The torch tests again under a torch 2.x from PyPI (suite python-torch2), next to Debian's
    # 1.13: a CPU-only venv of about 1.4 GB, made in about 30 s and kept between runs; with
    # transformers, accelerate and lightning for the frameworks suite (about 30 s more to
    # install, 150 MB; the suite itself about 3 minutes on 2 cores).
    ZEROD_TORCH2_PYTHON=$(scripts/torch2_venv.sh --frameworks | tail -n 1)
    export ZEROD_TORCH2_PYTHON
    run_tests
    scripts/sanitize.sh # unit and integration suites under ASan + UBSan + LSan
    scripts/sanitize.sh tsan # and under ThreadSanitizer, with the Python world tests
    scripts/fuzz.sh ci  # each libFuzzer harness over its corpus and a fixed number of inputs
    ;;
  build) install_deps; build ;;
  *) echo "usage: $0 demo|test|build [--no-cuda]" >&2; exit 2 ;;
esac
