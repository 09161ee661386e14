#!/bin/sh
# Runs a Python test of the gpu suite with the interpreter named by $ZEROD_GPU_PYTHON, else
# Debian's /usr/bin/python3 (whose CPU-only torch makes the GPU parts skip). A GPU machine's torch
# with CUDA usually lives in a venv of its own: scripts/gpu_check.sh finds it and sets the
# variable; by hand: ZEROD_GPU_PYTHON=/path/to/venv/bin/python3 meson test --suite gpu.
exec "${ZEROD_GPU_PYTHON:-/usr/bin/python3}" "$@"
