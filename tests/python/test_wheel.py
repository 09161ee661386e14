"""The wheel to hand to a cluster image: `pip wheel ./client/python` with the build's libzerod
(ZEROD_LIBRARY, as meson sets it; a plain checkout finds build/client/libzerod.so) makes a
platform wheel that carries the library inside the package; installed into a fresh venv with no
checkout in sight (the package is built from a copy of client/python, installed with
--no-index --no-deps, and used from a directory outside the checkout with no PYTHONPATH or
ZEROD_LIBRARY), `import zerod` loads the bundled copy and a ZeroOptimizer steps against a real
zerod, bitwise as torch's AdamW.

Offline: pip builds with the interpreter's own setuptools and wheel (--no-build-isolation). The
venv sees the system's packages (--system-site-packages) for Debian's torch. Needs
/usr/bin/python3 with venv, ensurepip and wheel (Debian's python3-venv, python3-wheel);
skipped (77) without them.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

import common

from zerod.testing import LocalZerod  # noqa: E402

CHECK = r"""
import copy, os, sys
import zerod
here = os.path.dirname(zerod.__file__)
assert here.startswith(sys.prefix), f"zerod imported from {here}, not the venv"
path = zerod.library_path()
assert os.path.dirname(path) == here, f"library {path} is not the wheel's bundled copy"
print("library:", path)
import torch
from zerod.torch import ZeroOptimizer
torch.manual_seed(0)
base = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
ref, model = copy.deepcopy(base), copy.deepcopy(base)
x = torch.randn(4, 8)
ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
ref(x).square().sum().backward()
ropt.step()
with ZeroOptimizer(model.parameters(), lr=1e-2, socket=sys.argv[1]) as opt:
    model(x).square().sum().backward()
    opt.step()
    same = all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))
print("one step, bitwise", same)
"""


def run(cmd, **kw) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, capture_output=True, text=True, **kw)
    print(f"$ {' '.join(cmd)[:200]}\n{r.stdout}{r.stderr}", flush=True)
    return r


def main() -> None:
    py = "/usr/bin/python3"
    probe = subprocess.run([py, "-c", "import venv, ensurepip, wheel, setuptools"],
                           capture_output=True)
    if probe.returncode != 0:
        common.skip("needs python3-venv and python3-wheel: " + probe.stderr.decode()[-200:])
    lib = os.environ.get("ZEROD_LIBRARY") or os.path.join(common.ROOT, "build", "client",
                                                           "libzerod.so")
    if not os.path.exists(lib):
        print(f"FAIL: no libzerod at {lib}: build it first (ninja -C build)")
        sys.exit(1)
    with tempfile.TemporaryDirectory(prefix="zerod-wheel-") as tmp:
        # A copy of the package's sources: the wheel's build leaves nothing in the checkout
        # (and does not race test_install's build there).
        src = os.path.join(tmp, "src")
        shutil.copytree(os.path.join(common.ROOT, "client", "python"), src,
                        ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "ZEROD_LIBRARY")}
        env["ZEROD_LIBRARY"] = lib  # at build time only: the library to bundle
        dist = os.path.join(tmp, "dist")
        r = run([py, "-m", "pip", "wheel", "--no-build-isolation", "--no-index", "--no-deps",
                 "--quiet", "-w", dist, src], env=env, cwd=tmp, timeout=240)
        wheels = glob.glob(os.path.join(dist, "zerod-*.whl"))
        if r.returncode != 0 or len(wheels) != 1:
            print(f"FAIL: pip wheel exited with {r.returncode}, made {wheels}")
            sys.exit(1)
        whl = wheels[0]
        names = zipfile.ZipFile(whl).namelist()
        if "zerod/libzerod.so" not in names or "-py3-none-linux_" not in os.path.basename(whl):
            print(f"FAIL: {os.path.basename(whl)} should be a py3-none-linux_* wheel carrying "
                  f"zerod/libzerod.so; it holds {names}")
            sys.exit(1)
        with open(os.path.realpath(lib), "rb") as f, zipfile.ZipFile(whl) as z:
            if z.read("zerod/libzerod.so") != f.read():
                print(f"FAIL: the wheel's libzerod.so is not the build's {lib}")
                sys.exit(1)
        print("wheel:", os.path.basename(whl), "with zerod/libzerod.so")

        venv = os.path.join(tmp, "venv")
        subprocess.run([py, "-m", "venv", "--system-site-packages", venv], check=True)
        vpy = os.path.join(venv, "bin", "python")
        env.pop("ZEROD_LIBRARY")  # from now on nothing points at the build tree
        r = run([vpy, "-m", "pip", "install", "--no-index", "--no-deps", "--quiet", whl],
                env=env, cwd=tmp, timeout=240)
        if r.returncode != 0:
            print(f"FAIL: pip install of the wheel exited with {r.returncode}")
            sys.exit(1)
        shutil.rmtree(src)  # no sources left but the installed package
        with LocalZerod(log_level="info") as zd:
            r = run([vpy, "-c", CHECK, zd.socket], env=env, cwd=tmp, timeout=120)
        if r.returncode != 0 or "one step, bitwise True" not in r.stdout:
            print(f"FAIL: the installed wheel did not work (exit status {r.returncode})")
            sys.exit(1)
    print("ok")


if __name__ == "__main__":
    main()
