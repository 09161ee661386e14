#!/bin/sh
# Runs a Python test with the torch 2.x interpreter named by $ZEROD_TORCH2_PYTHON (the venv that
# scripts/torch2_venv.sh makes), for the python-torch2 suite: the same tests as the python suite's
# (Debian's torch 1.13) against the torch 2.x users run. Skipped (77) when it is not set.
#
# PyPI's torch takes Tensor.sqrt from MKL, whose kernels on an Intel CPU match none of zerod's sqrt
# modes (README, "Which torch it matches"). There the test runs as such a user is told to run it:
# with MKL_CBWR=COMPATIBLE, MKL's reproducible mode, whose kernel zerod's mkl_ex mode reproduces.
# Elsewhere (AMD) torch runs as it comes.
if [ -z "${ZEROD_TORCH2_PYTHON:-}" ]; then
  echo "SKIP: ZEROD_TORCH2_PYTHON is not set (export it to scripts/torch2_venv.sh's last line)"
  exit 77
fi
if [ -z "${MKL_CBWR:-}" ] && ! "$ZEROD_TORCH2_PYTHON" -c '
import sys
import zerod.torch
sys.exit(1 if zerod.torch._probe_sqrt()[1] else 0)'; then
  echo "torch's sqrt matches none of zerod's modes on this CPU: running with MKL_CBWR=COMPATIBLE"
  export MKL_CBWR=COMPATIBLE
fi
exec "$ZEROD_TORCH2_PYTHON" "$@"
