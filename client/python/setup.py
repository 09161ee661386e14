"""Build hook of the zerod package: bundle libzerod into the package when installed from a
checkout, so that `pip install ./client/python` gives a package that works with no environment
variable (zerod._lib loads the bundled copy), and `pip wheel ./client/python` a wheel to hand to
a cluster image that carries the library. A wheel with the library is tagged for this platform
(py3-none-linux_x86_64 here: any Python 3, since the package reaches the library through ctypes,
but only machines that run the library's code); one without it is pure Python (py3-none-any).

Where the library is taken from, at install time: $ZEROD_LIBRARY if set, else the checkout's
build tree (build/client/libzerod.so, next to this file's ../../). If neither exists, nothing is
bundled and the package uses the system's libzerod at run time (`meson install`). A bundled copy
is a snapshot: after rebuilding libzerod, install the package again.
"""

import os
import shutil

from setuptools import Distribution, setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))


def library_to_bundle():
    env = os.environ.get("ZEROD_LIBRARY")
    if env:
        if not os.path.exists(env):
            raise SystemExit(f"ZEROD_LIBRARY is {env!r}, which does not exist")
        return env
    tree = os.path.join(HERE, "..", "..", "build", "client", "libzerod.so")
    return tree if os.path.exists(tree) else None


class BuildPyWithLibrary(build_py):
    def run(self):
        super().run()
        lib = library_to_bundle()
        dest = os.path.join(self.build_lib, "zerod", "libzerod.so")
        if lib:
            shutil.copyfile(os.path.realpath(lib), dest)  # the file, not the symlink
            print(f"zerod: bundled {os.path.realpath(lib)} as {dest}")
        else:
            print("zerod: no libzerod to bundle (no $ZEROD_LIBRARY, no build/client/libzerod.so): "
                  "the package will load the system's libzerod")


try:  # setuptools >= 70.1 has its own; before, the wheel package's
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:
    try:
        from wheel.bdist_wheel import bdist_wheel
    except ImportError:  # no wheel support at all: pip says so when asked for a wheel
        bdist_wheel = None

cmdclass = {"build_py": BuildPyWithLibrary}
if bdist_wheel is not None:
    class BdistWheelWithLibrary(bdist_wheel):
        def get_tag(self):
            python, abi, plat = super().get_tag()
            if not self.root_is_pure:
                python, abi = "py3", "none"  # ctypes: no Python ABI involved
            return python, abi, plat

    cmdclass["bdist_wheel"] = BdistWheelWithLibrary



class DistributionWithLibrary(Distribution):
    def has_ext_modules(self):
        # Machine code inside (the bundled library): a platform wheel, installed to platlib.
        return library_to_bundle() is not None


setup(cmdclass=cmdclass, distclass=DistributionWithLibrary)
