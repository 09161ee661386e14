#!/usr/bin/env bash
# A virtual environment with a torch 2.x from PyPI that works on CPU, for the python-torch2 test
# suite (tests/python/meson.build): zerod's update must be bit-identical to the torch users run,
# and CI's Debian python3-torch is 1.13.
#
# Made as cheaply as possible: PyPI's Linux x86-64 torch wheel is the CUDA build (about 0.5 GB)
# and depends on about 2.5 GB of nvidia-* packages, cuda-* and triton, none of which CPU use
# loads. So the wheel is installed with --no-deps, and only its pure-Python dependencies next to
# it (plus numpy, which torch.as_tensor and the examples use, and safetensors, whose reader the
# checkpoint tests open zerod's files with). The result is checked by importing
# torch and running a CPU AdamW step; if that fails, the venv is left for inspection and the
# script fails.
#
#   scripts/torch2_venv.sh [--frameworks] [DIR]
#
# --frameworks: also the training frameworks the frameworks test suite runs zerod under
# (transformers, accelerate, lightning: versions in FRAMEWORKS below, $ZEROD_FRAMEWORKS_SPEC
# overrides), added to a venv that has them not yet; like torch, with --no-deps and their
# pure-Python requirements named (pip would otherwise pull the CUDA packages in again through
# torch). About 30 s and 150 MB from PyPI; the time is printed.
#
# DIR: the venv (default $ZEROD_TORCH2_VENV, else .venv/torch2 at the repository root). Idempotent:
# a DIR whose torch already passes the check is kept as it is. $ZEROD_TORCH2_SPEC is the pip
# requirement for torch (default "torch": the newest release; e.g. "torch==2.6.0"). Prints the
# venv's python on its last line of output, for ZEROD_TORCH2_PYTHON:
#
#   export ZEROD_TORCH2_PYTHON="$(scripts/torch2_venv.sh | tail -n 1)"
set -euo pipefail
cd "$(dirname "$0")/.."

frameworks=0
if [ "${1:-}" = "--frameworks" ]; then
  frameworks=1
  shift
fi
venv=${1:-${ZEROD_TORCH2_VENV:-.venv/torch2}}
spec=${ZEROD_TORCH2_SPEC:-torch}
python=$venv/bin/python

# torch >= 2 imports and steps an AdamW on CPU: what the tests need.
check() {
  "$python" - <<'EOF'
import safetensors  # the checkpoint export is checked with the ecosystem's own reader
import torch
assert int(torch.__version__.split(".")[0]) >= 2, f"torch {torch.__version__} is not 2.x"
p = torch.nn.Parameter(torch.ones(4))
opt = torch.optim.AdamW([p], lr=0.1)
p.sum().backward()
opt.step()
assert float(p.detach()[0]) < 1.0
print(f"torch {torch.__version__} works on CPU", flush=True)
EOF
}

# The frameworks, tested with these releases; their requirements that are plain Python (what
# pip's resolver picks for them, less torch's CUDA packages), unpinned.
FRAMEWORKS=${ZEROD_FRAMEWORKS_SPEC:-transformers==5.24.0 accelerate==1.15.0 lightning==2.6.6 pytorch-lightning==2.6.6}
FRAMEWORK_DEPS="PyYAML Pygments aiohappyeyeballs aiohttp aiosignal annotated-doc annotated-types anyio
  attrs click frozenlist h11 hf-xet httpcore2 httpx2 huggingface_hub idna lightning-utilities
  markdown-it-py mdurl multidict packaging propcache psutil pydantic pydantic_core regex rich
  shellingham tokenizers torchmetrics tqdm truststore typer typing-inspection yarl"

check_frameworks() {
  HF_HUB_OFFLINE=1 "$python" -c 'import transformers, accelerate, lightning.pytorch'
}

install_frameworks() {
  local t0
  t0=$(date +%s)
  # shellcheck disable=SC2086 # one requirement per word
  "$python" -m pip install -q --disable-pip-version-check --no-deps $FRAMEWORKS $FRAMEWORK_DEPS
  check_frameworks
  echo "torch2_venv: transformers, accelerate, lightning installed in $(($(date +%s) - t0)) s"
}

# lion-pytorch, the reference of zerod.torch.ZeroLion (the Lion conformance and interop tests),
# pinned, without its one requirement (torch, which is there already). Also for Debian's torch
# 1.13 (pure Python, no venv needed there): in .venv/torch113-extras, which the python suite puts
# on PYTHONPATH (tests/python/meson.build).
LION=lion-pytorch==0.2.5
EXTRAS_113=.venv/torch113-extras
ensure_lion() {
  "$python" -c 'import lion_pytorch' 2>/dev/null ||
    "$python" -m pip install -q --disable-pip-version-check --no-deps "$LION"
  [ -d "$EXTRAS_113/lion_pytorch" ] ||
    "$python" -m pip install -q --disable-pip-version-check --no-deps --target "$EXTRAS_113" "$LION"
}

if [ -x "$python" ] && check >&2 2>/dev/null; then
  ensure_lion >&2
  if [ "$frameworks" = 1 ] && ! check_frameworks >/dev/null 2>&1; then
    install_frameworks >&2
  fi
  echo "$(cd "$venv" && pwd)/bin/python"
  exit 0
fi

start=$(date +%s)
/usr/bin/python3 -m venv "$venv" >&2
"$python" -m pip install -q --disable-pip-version-check --no-deps "$spec" >&2
# torch's requirements that are plain Python, with their own (mpmath for sympy, MarkupSafe for
# jinja2); pip resolves their versions against what is installed.
"$python" -m pip install -q --disable-pip-version-check filelock typing-extensions sympy networkx \
  jinja2 fsspec numpy safetensors >&2
"$python" scripts/torch2_stubs.py "$("$python" -c "import importlib.util as u; print(u.find_spec('torch').submodule_search_locations[0])")" >&2
check >&2
ensure_lion >&2
if [ "$frameworks" = 1 ]; then install_frameworks >&2; fi
echo "torch2_venv: $venv ready in $(($(date +%s) - start)) s ($(du -sh "$venv" | cut -f1))" >&2
echo "$(cd "$venv" && pwd)/bin/python"
