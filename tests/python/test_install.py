"""Installs the Python package the way its README says, into a fresh virtual environment, and
uses it from there with no environment variable pointing at the library or the source tree:
`pip install ./client/python` from a built checkout bundles build/client/libzerod.so
(client/python/setup.py), and `import zerod` then loads that copy and talks to a real zerod.

Offline: the venv's own pip and setuptools build the package (--no-build-isolation --no-index),
so the test needs no package index. Needs /usr/bin/python3 with the venv module (Debian's
python3-venv) and the wheel package (python3-wheel); skipped (77) without them.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import common

from zerod.testing import LocalZerod  # noqa: E402

CHECK = r"""
import os, sys, zerod
path = zerod.library_path()
print("library:", path)
assert path.startswith(sys.prefix), f"library {path} is not the venv's bundled copy"
c = zerod.Client(sys.argv[1])
print("attached to local rank", c.info.local_rank, "of", c.info.world_size)
c.close()
print("installed package works")
"""


def main() -> None:
    py = "/usr/bin/python3"
    probe = subprocess.run([py, "-c", "import venv, ensurepip, wheel"], capture_output=True)
    if probe.returncode != 0:
        common.skip("needs python3-venv and python3-wheel: " + probe.stderr.decode()[-200:])
    lib = os.environ.get("ZEROD_LIBRARY")
    with tempfile.TemporaryDirectory(prefix="zerod-venv-") as tmp:
        venv = os.path.join(tmp, "venv")
        # --system-site-packages: setuptools' wheel support comes from Debian's python3-wheel,
        # as it would for a user who wants Debian's torch in the venv.
        subprocess.run([py, "-m", "venv", "--system-site-packages", venv], check=True)
        vpy = os.path.join(venv, "bin", "python")
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "ZEROD_LIBRARY")}
        if lib:  # the library this build made (meson sets it); a plain checkout finds build/
            env["ZEROD_LIBRARY"] = lib
        r = subprocess.run([vpy, "-m", "pip", "install", "--no-build-isolation", "--no-index",
                            "--quiet", os.path.join(common.ROOT, "client", "python")],
                           env=env, capture_output=True, text=True, timeout=240)
        print(r.stdout + r.stderr)
        if r.returncode != 0:
            print(f"FAIL: pip install exited with {r.returncode}")
            sys.exit(1)
        env.pop("ZEROD_LIBRARY", None)  # from now on nothing points at the build tree
        with LocalZerod() as zd:
            r = subprocess.run([vpy, "-c", CHECK, zd.socket], env=env, cwd=tmp,
                               capture_output=True, text=True, timeout=60)
        print(r.stdout + r.stderr)
        if r.returncode != 0 or "installed package works" not in r.stdout:
            print(f"FAIL: the installed package did not work (exit status {r.returncode})")
            sys.exit(1)
    print("ok")


if __name__ == "__main__":
    main()
