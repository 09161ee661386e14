#!/bin/sh
# Runs a Python test with the torch 2.x interpreter named by $ZEROD_TORCH2_PYTHON (the venv that
# scripts/torch2_venv.sh makes), for the python-torch2 suite: the same tests as the python suite's
# (Debian's torch 1.13) against the torch 2.x users run. Skipped (77) when it is not set.
if [ -z "${ZEROD_TORCH2_PYTHON:-}" ]; then
  echo "SKIP: ZEROD_TORCH2_PYTHON is not set (export it to scripts/torch2_venv.sh's last line)"
  exit 77
fi
exec "$ZEROD_TORCH2_PYTHON" "$@"
