#!/bin/bash
# One command proves the CUDA path on a GPU machine (README, "Proving the GPU path"), in two parts:
#
#   scripts/gpu_check.sh bundle   here, on a machine with the CUDA toolkit and no GPU: builds with
#                                 CUDA (./build) and packs .gpu-bundle/ (git-ignored): the build's
#                                 programs and test set-up, the shared libraries they need that a
#                                 bare GPU machine lacks (not libcudart, libnccl or libc & co),
#                                 the meson that wrote the build folder, and the build's path.
#   scripts/gpu_check.sh run      there, from the same tree with .gpu-bundle/ beside it, on a
#                                 machine with only the driver, a CUDA runtime and a torch with
#                                 CUDA (and its NCCL): the gpu suite (the torch conformance matrix
#                                 and the offload test included), bench_adam_cuda, bench_offload
#                                 (--size check) and bench_step_cuda, without MPS and,
#                                 where nvidia-cuda-mps-control exists, with MPS; under 8 minutes,
#                                 every part under its own timeout. Writes gpu_check.log (every
#                                 part's output) and summary.txt (the table printed last) under
#                                 $OUT (default .gpu-run/out). Exit status: 0 when every part
#                                 that ran passed, 1 otherwise, 2 when it could not start.
#
# Nothing here may hang: every command that can wait has a timeout, and what could not run is
# said, with why, in the summary.
set -uo pipefail

ROOT=$(cd "$(dirname "$(readlink -f "$0")")/.." && pwd)
cd "$ROOT" || exit 2
BUNDLE=$ROOT/.gpu-bundle
UNPACKED=$ROOT/.gpu-run # where run unpacks the bundle: never carried along with it
BUDGET_S=${ZEROD_GPU_CHECK_BUDGET_S:-470} # the run part's whole time, under 8 minutes

die() {
  echo "gpu_check: $*" >&2
  exit 2
}

# ---- bundle --------------------------------------------------------------------------------------

bundle() {
  export PATH=/usr/local/cuda/bin:$PATH
  command -v nvcc >/dev/null || die "nvcc not found (expected in /usr/local/cuda/bin): the bundle needs a CUDA build"
  command -v meson >/dev/null || die "meson not found"
  if [ ! -f build/build.ninja ]; then
    meson setup build -Dcuda=enabled >/dev/null || die "meson setup build -Dcuda=enabled failed"
  fi
  # meson's nvcc rule names a depfile that nvcc does not write (it writes <object minus .o>.d), so
  # ninja would keep .cu objects built against older headers: every .cu is rebuilt for the bundle.
  find kernels daemon tests -name '*.cu' -exec touch {} +
  ninja -C build -j"${ZEROD_BUILD_JOBS:-2}" >/dev/null || die "ninja -C build failed (run it to see why)"
  [ -x build/tests/gpu/bench_step_cuda ] ||
    die "build/ has no CUDA targets: reconfigure with 'meson configure build -Dcuda=enabled'"

  local stage=$BUNDLE/stage
  rm -rf "$BUNDLE" "$UNPACKED"
  mkdir -p "$stage/build" "$stage/lib" "$stage/mesonpkg"
  # The build's files the gpu suite and the benchmarks need: meson's test set-up, the programs of
  # every test of suite gpu and the targets they depend on, the benchmarks, zerod, zeroctl and
  # libzerod (object files and static libraries stay here). Debug sections are stripped from the
  # copies (symbols stay, for backtraces).
  python3 - "$stage/build" <<'EOF' || die "cannot read the build's introspection (build/meson-info)"
import json, os, shutil, sys
out = sys.argv[1]
info = "build/meson-info"
tests = json.load(open(os.path.join(info, "intro-tests.json")))
targets = json.load(open(os.path.join(info, "intro-targets.json")))
by_id = {t["id"]: t for t in targets}
files = set()
for t in tests:
    if "gpu" not in t.get("suite", []) and not any(s.endswith(":gpu") for s in t.get("suite", [])):
        continue
    if t["cmd"] and os.path.abspath(t["cmd"][0]).startswith(os.path.abspath("build") + "/"):
        files.add(t["cmd"][0])
    for dep in t.get("depends", []):
        files.update(by_id.get(dep, {}).get("filename", []))
for t in targets:
    name = t["name"]
    if name in ("zerod", "zeroctl", "zerod_shared", "libzerod") or name.startswith("bench_") and name.endswith("_cuda") \
            or name.startswith("zerod") and t["type"] == "shared library":
        files.update(t["filename"])
root = os.path.abspath(".")
for f in sorted(files):
    f = os.path.abspath(f)
    if not f.startswith(os.path.join(root, "build") + "/") or not os.path.exists(f):
        continue
    rel = os.path.relpath(f, os.path.join(root, "build"))
    dst = os.path.join(out, rel)
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    shutil.copy2(f, dst)
    print(rel)
for d in ("meson-private", "meson-info"):
    shutil.copytree(os.path.join("build", d), os.path.join(out, d),
                    ignore=shutil.ignore_patterns("*.exe", "sanitycheck*"))
os.makedirs(os.path.join(out, "meson-logs"), exist_ok=True)
EOF
  # libzerod's SONAME links (libzerod.so -> .so.1 -> .so.1.0.0)
  (cd build && find . -name 'libzerod.so*' -type l -print0 | xargs -0 -I{} cp -P {} "$stage/build/{}")
  find "$stage/build" -type f -perm -u+x -exec strip --strip-debug {} + 2>/dev/null
  # Shared libraries a bare GPU machine lacks: what ldd names, less the C runtime, the CUDA
  # runtime and NCCL (the GPU machine's own: its torch's).
  find "$stage/build" -type f -perm -u+x -print0 | xargs -0 ldd 2>/dev/null | awk '/=>/ {print $3}' |
    sort -u | grep -vE '/(libc|libm|libdl|libpthread|librt|libutil|ld-linux[^/]*|libstdc\+\+|libgcc_s|libcudart|libnccl|libcuda|libzerod)\.so' |
    while read -r lib; do cp -L "$lib" "$stage/lib/"; done
  # The meson that wrote build/ (a newer one refuses the folder), without its caches.
  local mpy mdir
  mpy=$(head -1 "$(command -v meson)" | sed -n 's/^#! *//p' | awk '{print $1}')
  [ -x "$mpy" ] || mpy=python3
  mdir=$("$mpy" -c 'import mesonbuild, os; print(os.path.dirname(mesonbuild.__file__))') ||
    die "cannot find the mesonbuild package of $(command -v meson)"
  cp -r "$mdir" "$stage/mesonpkg/"
  find "$stage/mesonpkg" -name __pycache__ -prune -exec rm -rf {} +
  echo "$ROOT" >"$stage/origin"
  git rev-parse HEAD >"$stage/commit" 2>/dev/null || true
  tar -C "$stage" -czf "$BUNDLE/bundle.tgz" . || die "tar failed"
  cp "$stage/origin" "$BUNDLE/origin"
  rm -rf "$stage"
  local tree bundle_mb
  bundle_mb=$(du -sm "$BUNDLE" | cut -f1)
  tree=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | awk '{printf "%d", $1 / 1048576}')
  echo "gpu_check: .gpu-bundle/ is ${bundle_mb} MiB (the tracked tree about ${tree} MiB; the device tool carries 64 MiB in all)"
  if [ $((bundle_mb + tree)) -ge 60 ]; then
    echo "gpu_check: WARNING: bundle and tree together are close to or over 64 MiB" >&2
  fi
  echo "gpu_check: on the GPU machine, from this tree's root: scripts/gpu_check.sh run"
}

# ---- run -----------------------------------------------------------------------------------------

T0=$(date +%s)
left() { echo $((BUDGET_S - ($(date +%s) - T0))); }

# log_part NAME: a header in the combined log
log_part() { printf '\n===== %s (%s s left of %s)\n' "$1" "$(left)" "$BUDGET_S" >>"$LOG"; }

# note TEXT: a line for the summary's "not run" list (also in the log)
note() {
  echo "$*" >>"$WORK/notes"
  echo "gpu_check: $*" >>"$LOG"
}

# timed LIMIT_S NAME CMD...: runs CMD under timeout (capped by what is left of the budget, at
# least MIN_S=15), output into the log and into $WORK/NAME.out; returns its status (124: timeout)
timed() {
  local limit=$1 name=$2 cap
  shift 2
  cap=$(($(left) - 10))
  [ "$cap" -lt "$limit" ] && limit=$cap
  if [ "$limit" -lt 15 ]; then
    note "$name: not run, the ${BUDGET_S} s budget is spent"
    echo "$name 125" >>"$WORK/results"
    return 125
  fi
  log_part "$name: $* (timeout ${limit} s)"
  local before rc t
  before=$(zerod_pids)
  t=$(date +%s)
  timeout -k 10 "$limit" "$@" >"$WORK/$name.out" 2>&1
  rc=$?
  cat "$WORK/$name.out" >>"$LOG"
  echo "----- $name: exit $rc after $(($(date +%s) - t)) s" >>"$LOG"
  echo "$name $rc" >>"$WORK/results"
  case $rc in
    0) ;;
    77) note "$name: skipped (exit 77): $(grep -m1 -iE 'skip' "$WORK/$name.out" | cut -c1-150)" ;;
    124 | 137) note "$name: timed out after ${limit} s" ;;
    *) note "$name: FAILED (exit $rc)" ;;
  esac
  reap_zerods "$before"
  return "$rc"
}

# The zerod processes of this build (by their binary's path), to end those a timed-out part left.
zerod_pids() { pgrep -f "^[^ ]*($ROOT|${ORIGIN:-$ROOT})/build/daemon/zerod( |$)" 2>/dev/null | sort; }
reap_zerods() {
  local pid
  for pid in $(comm -13 <(echo "$1") <(zerod_pids)); do
    kill -TERM "$pid" 2>/dev/null && echo "gpu_check: ended zerod $pid, left behind" >>"$LOG"
  done
  sleep 1
  for pid in $(comm -13 <(echo "$1") <(zerod_pids)); do kill -KILL "$pid" 2>/dev/null; done
}

# meson from the bundle (the version that wrote build/), run by $MESON_PY: a program, for timeout
make_meson() {
  cat >"$WORK/meson" <<EOF
#!/bin/sh
PYTHONPATH="$UNPACKED/mesonpkg\${PYTHONPATH:+:\$PYTHONPATH}" exec "$MESON_PY" -c 'import sys; from mesonbuild.mesonmain import main; sys.argv[0] = "meson"; sys.exit(main())' "\$@"
EOF
  chmod +x "$WORK/meson"
}

# The interpreter with a torch that sees CUDA, else one with any torch, else none.
find_torch_python() {
  local py best=""
  for py in ${ZEROD_GPU_PYTHON:-} "$(command -v python3 || true)" /opt/torch/.venv/bin/python3 \
    /opt/conda/bin/python3 /usr/local/bin/python3 /usr/bin/python3; do
    [ -x "$py" ] || continue
    if timeout 90 "$py" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 3)' 2>/dev/null; then
      echo "$py"
      return 0
    fi
    [ -z "$best" ] && timeout 60 "$py" -c 'import torch' 2>/dev/null && best=$py
  done
  echo "$best"
}

# The folder of a library: under the torch python's site-packages (the nvidia-* wheels), else
# wherever find sees it first.
find_lib_dir() {
  local name=$1 dir=""
  if [ -n "$TORCH_PY" ]; then
    dir=$(timeout 60 "$TORCH_PY" - "$name" <<'EOF' 2>/dev/null
import glob, os, site, sys
roots = site.getsitepackages() + [site.getusersitepackages()]
for r in roots:
    for pat in ("nvidia/*/lib/", "nvidia/*/*/lib/", "torch/lib/"):
        hits = glob.glob(os.path.join(r, pat, sys.argv[1]))
        if hits:
            print(os.path.dirname(hits[0]))
            sys.exit(0)
EOF
    )
  fi
  if [ -z "$dir" ]; then
    dir=$(timeout 60 find /usr/local/cuda/ /usr/local/nvidia /usr/lib /usr/local/lib /opt -name "$name" 2>/dev/null | head -1)
    [ -n "$dir" ] && dir=$(dirname "$dir")
  fi
  echo "$dir"
}

# What bench_step_cuda's usage line offers (other options come and go with the code).
bench_step_has() { build/tests/gpu/bench_step_cuda --help 2>&1 | grep -q -- "$1"; }

bench_step_runs() { # LABEL: the step benchmark's runs (old and new step, W=2) in one mode
  local label=$1 args=(--zerod "$ROOT/build/daemon/zerod" --min-log2 20 --max-log2 28)
  if bench_step_has --cuda-step; then args+=(--cuda-step legacy,fast); fi
  timed 110 "bench_step_cuda_$label" build/tests/gpu/bench_step_cuda "${args[@]}"
  if bench_step_has "--world"; then
    timed 70 "bench_step_cuda_w2_$label" build/tests/gpu/bench_step_cuda --zerod "$ROOT/build/daemon/zerod" \
      --min-log2 20 --max-log2 26 --world 2
  else
    note "bench_step_cuda --world 2 ($label): not run, this bench_step_cuda has no --world"
  fi
}

# zerod_mps LABEL: starts a CUDA zerod for a few seconds and keeps its start-up line about MPS
# (daemon/backends/mps.c: what zerod itself detects), for the summary.
zerod_mps() {
  local label=$1 pid i line
  [ "$(left)" -gt 40 ] || return 0
  build/daemon/zerod --backend cuda --socket "$WORK/mps-$label.sock" --control_address \
    "unix:$WORK/mps-$label.ctl" --log_level info >"$WORK/zerod_$label.log" 2>&1 &
  pid=$!
  for i in $(seq 1 40); do
    grep -q -E 'ready|error|ERROR' "$WORK/zerod_$label.log" 2>/dev/null && break
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.25
  done
  kill -TERM "$pid" 2>/dev/null
  for i in $(seq 1 40); do kill -0 "$pid" 2>/dev/null || break; sleep 0.25; done
  kill -KILL "$pid" 2>/dev/null
  wait "$pid" 2>/dev/null
  log_part "zerod's start-up ($label)"
  cat "$WORK/zerod_$label.log" >>"$LOG"
  line=$(grep -m1 'MPS: ' "$WORK/zerod_$label.log" | sed 's/.*MPS: /MPS: /' | cut -c1-150)
  echo "zerod ($label): ${line:-no MPS line in its log (see gpu_check.log)}" >>"$WORK/mps_lines"
}

mps_start() {
  export CUDA_MPS_PIPE_DIRECTORY=$WORK/mps-pipe CUDA_MPS_LOG_DIRECTORY=$WORK/mps-log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  log_part "MPS: nvidia-cuda-mps-control -d (pipe $CUDA_MPS_PIPE_DIRECTORY)"
  if ! timeout 20 nvidia-cuda-mps-control -d >>"$LOG" 2>&1; then
    note "MPS: nvidia-cuda-mps-control -d failed (its log: $CUDA_MPS_LOG_DIRECTORY, in gpu_check.log)"
    cat "$CUDA_MPS_LOG_DIRECTORY"/* >>"$LOG" 2>/dev/null
    unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
    return 1
  fi
  MPS_UP=1
}

mps_stop() {
  [ "${MPS_UP:-0}" = 1 ] || return 0
  echo "MPS servers that ran: $(echo get_server_list | timeout 10 nvidia-cuda-mps-control 2>&1 |
    tr '\n' ' ')" >>"$WORK/mps_lines"
  echo quit | timeout 20 nvidia-cuda-mps-control >>"$LOG" 2>&1 || note "MPS: 'quit' to the control daemon failed"
  sleep 1
  cat "$CUDA_MPS_LOG_DIRECTORY"/*.log >>"$LOG" 2>/dev/null
  MPS_UP=0
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
}

# The summary: benchmarks first and the verdicts last, so that the end of the output (all a
# caller may see of it, e.g. the device tool's output_tail) holds the suite, the matrix and
# what did not run; the whole of it is $OUT/summary.txt.
summary() {
  local S=$OUT/summary.txt f
  {
    echo "======== gpu_check summary ($(($(date +%s) - T0)) s; every output: gpu_check.log)"
    echo "machine: $GPU_LINE"
    echo "torch:   $TORCH_LINE"
    echo "bundle:  built at $ORIGIN, commit $(cat "$UNPACKED/commit" 2>/dev/null || echo '?')"
    if [ -f "$WORK/bench_offload.out" ]; then
      echo
      echo "-- bench_offload --size check (a GPU model, its optimizer state in a CPU zerod)"
      grep -vE '^ *$' "$WORK/bench_offload.out" | grep -vE '^(zerod: |Traceback)' | cut -c1-130 | tail -12
    fi
    for f in bench_adam_cuda bench_step_cuda_nomps bench_step_cuda_w2_nomps bench_step_cuda_mps \
      bench_step_cuda_w2_mps; do
      [ -f "$WORK/$f.out" ] || continue
      echo
      echo "-- $f (%copy: of a device-to-device copy of the same bytes, measured alongside)"
      grep -vE '^#? *$' "$WORK/$f.out" | cut -c1-110
    done
    if [ -s "$WORK/mps_lines" ]; then
      echo
      echo "-- MPS as zerod saw it"
      sed 's/^/  /' "$WORK/mps_lines"
    fi
    echo
    echo "-- torch conformance matrix (python_torch_cuda)"
    if [ -s "$WORK/matrix.txt" ]; then
      # The CUDA matrix where there is one (the CPU one, run first, stays in the log).
      if grep -q '^matrix: torch .* on CUDA' "$WORK/matrix.txt"; then
        awk '/^matrix: torch / {on = /on CUDA/} on' "$WORK/matrix.txt" | sed 's/^matrix: /  /'
        echo "  (the CPU matrix, torch's CPU paths against zerod's CPU backend: in gpu_check.log)"
      else
        sed 's/^matrix: /  /' "$WORK/matrix.txt"
      fi
    else
      echo "  (not produced: see python_torch_cuda below)"
    fi
    echo
    echo "-- offload: torch's CUDA single-tensor AdamW against its CPU formula (python_offload_cuda)"
    if [ -s "$WORK/offload_probe.txt" ]; then
      sed 's/^offload probe: /  /' "$WORK/offload_probe.txt" | cut -c1-200
    else
      echo "  (not produced: see python_offload_cuda below)"
    fi
    echo
    echo "-- gpu suite (meson test --suite gpu)"
    if [ -f build/meson-logs/testlog.json ]; then
      "$MESON_PY" - build/meson-logs/testlog.json <<'EOF'
import json, sys
for line in open(sys.argv[1]):
    try:
        t = json.loads(line)
    except ValueError:
        continue
    out = t.get("stdout") or ""
    why = ""
    if t["result"] in ("SKIP", "FAIL", "TIMEOUT", "ERROR"):
        tail = [l for l in out.splitlines() if l.strip()][-1:] or [""]
        why = tail[0][:100]
    print(f"  {t['name']:<34} {t['result']:<8} {t.get('duration', 0):7.1f} s  {why}")
EOF
    else
      echo "  (no testlog.json: the suite did not run)"
    fi
    echo
    echo "-- not run, or incomplete"
    if [ -s "$WORK/notes" ]; then sed 's/^/  /' "$WORK/notes"; else echo "  nothing"; fi
    echo "======== result: $1"
  } >"$S"
  cat "$S" >>"$LOG"
  cat "$S"
}

run() {
  OUT=${OUT:-$UNPACKED/out}
  mkdir -p "$OUT" || die "cannot create $OUT"
  LOG=$OUT/gpu_check.log
  : >"$LOG"
  WORK=$(mktemp -d /tmp/gpu_check.XXXXXX) || die "mktemp failed"
  : >"$WORK/notes"
  : >"$WORK/results"
  MPS_UP=0
  trap 'mps_stop; rm -rf "$WORK"' EXIT
  trap 'exit 143' TERM INT # the EXIT trap (MPS stopped) runs on these too
  GPU_LINE="?" TORCH_LINE="?" ORIGIN=$ROOT MESON_PY=python3
  local status=0

  [ -f "$BUNDLE/bundle.tgz" ] || die "no .gpu-bundle/bundle.tgz: run 'scripts/gpu_check.sh bundle' on the build machine first"
  local sum
  sum=$(cksum <"$BUNDLE/bundle.tgz")
  if [ "$(cat "$UNPACKED/bundle.cksum" 2>/dev/null)" != "$sum" ]; then # new, or another bundle
    rm -rf "$UNPACKED/build" "$UNPACKED/lib" "$UNPACKED/mesonpkg"
    mkdir -p "$UNPACKED" && tar -C "$UNPACKED" -xzf "$BUNDLE/bundle.tgz" ||
      die "cannot unpack .gpu-bundle/bundle.tgz into .gpu-run/"
    echo "$sum" >"$UNPACKED/bundle.cksum"
  fi
  ORIGIN=$(cat "$UNPACKED/origin")
  # build/: a build made here stays; else the bundle's.
  if [ ! -e build ]; then ln -s .gpu-run/build build; fi
  # The build folder names files by the absolute path of the tree that built it.
  if [ "$ORIGIN" != "$ROOT" ]; then
    if [ -L "$ORIGIN" ] || [ ! -e "$ORIGIN" ]; then
      mkdir -p "$(dirname "$ORIGIN")" && ln -sfn "$ROOT" "$ORIGIN" ||
        die "cannot link $ORIGIN (the build's path) to $ROOT: run as root, or from $ORIGIN"
    else
      note "the build's path $ORIGIN exists and is not this tree ($ROOT): the tests run what is there"
    fi
  fi

  log_part "machine"
  {
    date -u
    uname -a
    nproc
  } >>"$LOG" 2>&1
  if command -v nvidia-smi >/dev/null; then
    GPU_LINE=$(timeout 30 nvidia-smi --query-gpu=name,memory.total,driver_version,compute_mode --format=csv,noheader 2>&1 | head -4 | tr '\n' ';')
    timeout 30 nvidia-smi >>"$LOG" 2>&1
  else
    GPU_LINE="no nvidia-smi: no NVIDIA driver here (the GPU tests skip)"
    note "no GPU: nvidia-smi not found; the gpu suite's tests skip and the benchmarks exit 77"
  fi

  TORCH_PY=$(find_torch_python)
  if [ -n "$TORCH_PY" ]; then
    TORCH_LINE="$TORCH_PY: $(timeout 90 "$TORCH_PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())' 2>&1 | tail -1)"
    export ZEROD_GPU_PYTHON=$TORCH_PY
    MESON_PY=$TORCH_PY
  else
    TORCH_LINE="no python3 here imports torch"
    note "no torch: python_torch_cuda skips"
  fi
  [ -x /usr/bin/python3 ] && [ -z "$TORCH_PY" ] && MESON_PY=/usr/bin/python3
  echo "torch: $TORCH_LINE" >>"$LOG"

  local nccl cudart
  nccl=$(find_lib_dir 'libnccl.so.2')
  cudart=$(find_lib_dir 'libcudart.so.13')
  [ -z "$nccl" ] && note "libnccl.so.2 not found (torch's nvidia-nccl wheel, /usr, /opt): zerod cannot start"
  [ -z "$cudart" ] && note "libcudart.so.13 not found: the CUDA programs cannot start"
  # The bundle's libraries go on LD_LIBRARY_PATH, which every process here inherits (torch's
  # python too): those the machine has itself (same soname: libssl, libz, libffi, ...) stay
  # aside, so that only what is missing comes from the build machine, unless zerod then lacks one.
  mkdir -p "$UNPACKED/lib-host-has"
  local lib
  ldconfig -p >"$WORK/ldcache" 2>/dev/null
  for lib in "$UNPACKED"/lib/*; do
    [ -e "$lib" ] || continue
    if grep -qF "$(printf '\t')$(basename "$lib") (" "$WORK/ldcache"; then
      mv "$lib" "$UNPACKED/lib-host-has/"
    fi
  done
  export LD_LIBRARY_PATH=$UNPACKED/lib${nccl:+:$nccl}${cudart:+:$cudart}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  if ldd build/daemon/zerod build/client/libzerod.so 2>&1 | grep -q 'not found'; then
    mv "$UNPACKED"/lib-host-has/* "$UNPACKED/lib/" 2>/dev/null
    echo "gpu_check: the machine's own libraries did not satisfy zerod: all the bundle's in use" >>"$LOG"
  fi
  export PYTHONUNBUFFERED=1 ZEROD_TORCH_MATRIX=$WORK/matrix.txt ZEROD_OFFLOAD_REPORT=$WORK/offload_probe.txt
  {
    echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
    ldd build/daemon/zerod | grep -E 'not found|nccl|cudart'
  } >>"$LOG" 2>&1
  if ldd build/daemon/zerod | grep -q 'not found'; then
    note "zerod misses libraries: $(ldd build/daemon/zerod | grep 'not found' | awk '{print $1}' | tr '\n' ' ')"
  fi

  # 1. The gpu suite once (without MPS): its tests carry their own meson timeouts too.
  make_meson
  rm -f build/meson-logs/testlog.json # the summary reads this run's, never an older one
  timed 290 gpu_suite "$WORK/meson" test -C "$ORIGIN/build" --no-rebuild --suite gpu --print-errorlogs
  # 2. The kernel against a copy.
  timed 60 bench_adam_cuda build/tests/gpu/bench_adam_cuda --min-log2 20 --max-log2 28
  # 2b. Offload (a GPU model on a CPU zerod) next to torch's fused AdamW and the copies: the check
  # size (81M parameters, about 30 s; --size small/large by hand).
  if [ -n "$TORCH_PY" ]; then
    timed 40 bench_offload env PYTHONPATH="$ROOT/client/python" ZEROD_BIN="$ROOT/build/daemon/zerod" \
      ZEROD_LIBRARY="$ROOT/build/client/libzerod.so" "$TORCH_PY" tests/bench/bench_offload.py --size check
  else
    note "bench_offload: not run, no python with torch"
  fi
  # 3. The whole step, without MPS, then with it where the machine has it.
  zerod_mps nomps
  bench_step_runs nomps
  if command -v nvidia-cuda-mps-control >/dev/null; then
    if [ "$(left)" -gt 90 ] && mps_start; then
      zerod_mps mps
      bench_step_runs mps
      mps_stop
    elif [ "${MPS_UP:-0}" = 0 ] && [ "$(left)" -le 90 ]; then
      note "MPS: bench_step_cuda with MPS not run, under 90 s of the budget left"
    fi
  else
    note "MPS: nvidia-cuda-mps-control not found, the steps were measured without MPS only"
  fi
  # Failed: any part that ran and neither passed nor skipped (77; 125: not run for time).
  if awk '$2 != 0 && $2 != 77 && $2 != 125 {bad = 1} END {exit !bad}' "$WORK/results"; then
    status=1
  fi
  summary "$([ "$status" = 0 ] && echo 'every part that ran passed or skipped' || echo 'FAILURES (see above)')"
  return "$status"
}

case "${1:-}" in
  bundle) bundle ;;
  run) run ;;
  *)
    sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
    ;;
esac
