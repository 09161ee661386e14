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
    python3-pip python3-wheel "$@"
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

build() {
  # The CUDA backend is built wherever nvcc is found (meson option cuda=auto).
  if [ -x /usr/local/cuda/bin/nvcc ]; then export PATH="/usr/local/cuda/bin:$PATH"; fi
  [ -f build/build.ninja ] || meson setup build
  ninja -C build
}

demo() {
  # Starts its own zerod (world size 2: one daemon, two local ranks) and two trainer processes.
  /usr/bin/python3 examples/train_torch.py
}

run_tests() {
  meson test -C build --print-errorlogs
}

case "${1:-}" in
  demo) install_deps; build; demo ;;
  test)
    # shellcheck disable=SC2046 # one package name per word
    install_deps clang-format git yamllint systemd openssl abigail-tools $(scripts/sanitize.sh packages) \
      $(scripts/fuzz.sh packages)
    install_promtool
    build
    # The torch tests again under a torch 2.x from PyPI (suite python-torch2), next to Debian's
    # 1.13: a CPU-only venv of about 1.4 GB, made in about 30 s and kept between runs.
    ZEROD_TORCH2_PYTHON=$(scripts/torch2_venv.sh | tail -n 1)
    export ZEROD_TORCH2_PYTHON
    run_tests
    scripts/sanitize.sh # unit and integration suites under ASan + UBSan + LSan
    scripts/sanitize.sh tsan # and under ThreadSanitizer, with the Python world tests
    scripts/fuzz.sh ci  # each libFuzzer harness over its corpus and a fixed number of inputs
    ;;
  build) install_deps; build ;;
  *) echo "usage: $0 demo|test|build" >&2; exit 2 ;;
esac
