"""Stand-ins for the CUDA libraries that PyPI's (CUDA) torch wheel links against, so that the
wheel imports and runs on CPU without the 2.5 GB of nvidia-* packages (scripts/torch2_venv.sh).

torch's libraries name libcudart, libcublas, libcudnn, ... as NEEDED and reference their symbols
with symbol versions, so the loader wants a file of each soname that defines those versions.
This writes, for each such library missing from the system, a small shared object with that
soname, defining every symbol torch references from it (with its version) as a function that
returns 100 (cudaErrorNoDevice): torch then finds no GPU, and its CPU code never calls them. The
objects go into torch/lib, which is on the RPATH ($ORIGIN) of every torch library.

    python torch2_stubs.py TORCH_DIR    (the installed package's directory)
"""

import collections
import os
import re
import subprocess
import sys
import tempfile


def run(*cmd: str) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout


def main() -> None:
    torch_dir = sys.argv[1]
    libdir = os.path.join(torch_dir, "lib")
    objects = [os.path.join(libdir, f) for f in sorted(os.listdir(libdir)) if ".so" in f]
    objects += [os.path.join(torch_dir, f) for f in os.listdir(torch_dir)
                if f.startswith("_C") and f.endswith(".so")]
    present = set(os.listdir(libdir))
    system = set(re.findall(r"^\s+(\S+) \(", run("/sbin/ldconfig", "-p"), re.M))
    # The CUDA libraries are replaced even where the system has them (a CUDA toolkit installed):
    # the venv then behaves alike on every machine, always as torch without a GPU.
    cuda = re.compile(r"lib(cu|nv|nccl)")
    missing, unversioned = set(), set()
    symbols = collections.defaultdict(lambda: collections.defaultdict(set))  # lib -> ver -> syms
    for obj in objects:
        needed = re.findall(r"\(NEEDED\)\s+Shared library: \[(.+?)\]", run("readelf", "-dW", obj))
        missing |= {n for n in needed if n not in present and (n not in system or cuda.match(n))}
        # version name -> the library that must define it
        owner, current = {}, None
        for line in run("readelf", "-VW", obj).splitlines():
            m = re.search(r"File: (\S+)", line)
            if m:
                current = m.group(1)
            m = re.search(r"Name: (\S+)", line)
            if m and current:
                owner[m.group(1)] = current
        for line in run("nm", "-D", "--undefined-only", obj).splitlines():
            m = re.match(r"\s*U (\S+)@(\S+)$", line)
            if m and owner.get(m.group(2)) in missing:
                symbols[owner[m.group(2)]][m.group(2)].add(m.group(1))
            m = re.match(r"\s*U ([A-Za-z_]\w*)$", line)
            if m:
                unversioned.add(m.group(1))
    # Libraries without symbol versions (cuSPARSELt, cuFile, NCCL, NVSHMEM, the driver): their
    # symbols must still resolve when torch's libraries load (some are bound eagerly), so each
    # unversioned symbol goes to the library its prefix names (driver API: cu...).
    prefixes = [("cusparseLt", "libcusparseLt.so"), ("cuFile", "libcufile.so"),
                ("nccl", "libnccl.so"), ("pnccl", "libnccl.so"), ("nvshmem", "libnvshmem_host.so"),
                ("cu", "libcuda.so")]
    for sym in sorted(unversioned):
        for prefix, stem in prefixes:
            lib = next((m for m in missing if m.startswith(stem)), None)
            if sym.startswith(prefix) and lib and not re.match(r"cu(blas|dnn|fft|rand|solver|"
                                                               r"sparse[^L]|da[A-Z_])", sym):
                symbols[lib][""].add(sym)
                break
    with tempfile.TemporaryDirectory() as tmp:
        for lib in sorted(missing):
            src, script = os.path.join(tmp, "stub.c"), os.path.join(tmp, "stub.map")
            with open(src, "w") as c, open(script, "w") as v:
                n = 0
                for ver, syms in sorted(symbols[lib].items(), key=lambda kv: kv[0] == ""):
                    v.write(f"{ver} {{ global:\n" if ver else "{ global:\n")
                    for sym in sorted(syms):
                        c.write(f'int f{n}(void) __asm__("{sym}");\nint f{n}(void) {{ return 100; }}\n')
                        v.write(f"  {sym};\n")
                        n += 1
                    v.write("};\n")
                if not symbols[lib]:
                    v.write("{ local: *; };\n")
            run("gcc", "-shared", "-fPIC", "-O0", "-o", os.path.join(libdir, lib), src,
                f"-Wl,-soname,{lib}", f"-Wl,--version-script={script}")
            print(f"torch2_stubs: {lib}: {sum(len(s) for s in symbols[lib].values())} symbols",
                  file=sys.stderr)


if __name__ == "__main__":
    main()
