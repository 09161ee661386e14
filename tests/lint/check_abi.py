#!/usr/bin/env python3
"""libzerod's ABI against the baseline kept in the repository (suite `lint`).

The exported functions of libzerod and the public types they reach (client/include only: the
library's own structures, such as struct zd_client behind zd_client_t, do not count) are written
by abidw (Debian's abigail-tools) and compared by abidiff with client/abi/libzerod.abi. Any
difference fails, with abidiff's report, renames and new enumerators included: an unintended change is caught, and an intended one
(a new function, a field appended to a versioned structure: docs/abi.md) updates the baseline in
the same commit, where the reviewer sees it. Update it, after building, with

    tests/lint/check_abi.py --update build/client/libzerod.so

The dump leaves out whatever differs between builds of the same ABI (paths, locations,
DT_NEEDED, sequential type ids), so the baseline is the same with and without CUDA.

    check_abi.py LIBRARY             compare LIBRARY with the baseline (77: abidw/abidiff missing)
    check_abi.py --update LIBRARY    rewrite the baseline from LIBRARY
    check_abi.py --self-test         show that the comparison fails on real ABI changes: small
                                     libraries built here, with a structure grown by a field, a
                                     new function, a renamed field (and passes a change to a
                                     structure the headers keep opaque)
"""

import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
HEADERS = os.path.join(ROOT, "client", "include")
BASELINE = os.path.join(ROOT, "client", "abi", "libzerod.abi")
SKIP = 77

ABIDW_FLAGS = [
    "--drop-private-types",         # types not defined under the headers directory
    "--exported-interfaces-only",   # what a client can call, nothing the library keeps inside
    "--no-corpus-path", "--no-comp-dir-path", "--no-show-locs", "--no-elf-needed",
    "--type-id-style", "hash",      # ids from the types, not from the order they were read in
]


def tools_missing():
    missing = [t for t in ("abidw", "abidiff") if shutil.which(t) is None]
    if missing:
        print(f"SKIP: {' and '.join(missing)} not installed (apt-get install abigail-tools)")
        return True
    return False


def dump(library, headers, out):
    """Writes the ABI of `library`, as seen through `headers`, to the file `out`."""
    subprocess.run(["abidw", "--headers-dir", headers, *ABIDW_FLAGS, "--out-file", out, library],
                   check=True)
    with open(out) as f:
        text = f.read()
    # Translation units are named by their path relative to the build directory, which depends
    # on where the build is: keep the file name only.
    text = re.sub(r"(<abi-instr [^>]*path=')[^']*/([^'/]*')", r"\1\2", text)
    with open(out, "w") as f:
        f.write(text)


def compare(library, headers, baseline, update_hint):
    """0 when `library` has the ABI of `baseline`, else 1 after printing abidiff's report."""
    with tempfile.TemporaryDirectory() as tmp:
        current = os.path.join(tmp, "current.abi")
        dump(library, headers, current)
        # --harmless: a renamed field or a new enumerator counts too (binary-compatible, but a
        # change to the API the reviewer should see)
        r = subprocess.run(["abidiff", "--harmless", baseline, current], capture_output=True,
                           text=True)
    if r.returncode == 0:
        print(f"{library}: the ABI of {os.path.relpath(baseline, ROOT)}")
        return 0
    print(f"{library}: the ABI differs from {baseline} (abidiff exit {r.returncode}):\n")
    print(r.stdout + r.stderr)
    print(f"If the change is intended (docs/abi.md: a new function, a field appended to a "
          f"versioned structure), update the baseline in the same commit:\n  {update_hint}")
    return 1


# ---- self-test ---------------------------------------------------------------------------------

SELF_TEST_HEADER = """
#include <stddef.h>
typedef struct box box_t; /* opaque: its fields are the library's business */
typedef struct opts {
  size_t size;
  int %(a)s;
%(extra)s} opts_t;
__attribute__((visibility("default"))) int use(box_t *box, const opts_t *opts);
%(function)s
"""
SELF_TEST_SOURCE = """
#include "api.h"
struct box { int inside;%(private)s };
int use(box_t *box, const opts_t *opts) { return box->inside + opts->%(a)s; }
%(definition)s
"""


def build_lib(tmp, name, extra="", function="", definition="", private="", a="a"):
    """A small shared library in tmp/name with its public header in tmp/name/include."""
    inc = os.path.join(tmp, name, "include")
    os.makedirs(inc)
    with open(os.path.join(inc, "api.h"), "w") as f:
        f.write(SELF_TEST_HEADER % {"extra": extra, "function": function, "a": a})
    src = os.path.join(tmp, name, "lib.c")
    with open(src, "w") as f:
        f.write(SELF_TEST_SOURCE % {"definition": definition, "private": private, "a": a})
    lib = os.path.join(tmp, name, "libtiny.so")
    cc = os.environ.get("CC", "cc")
    subprocess.run([cc, "-g", "-O2", "-shared", "-fPIC", "-fvisibility=hidden", "-I", inc, "-o",
                    lib, src], check=True)
    return lib, inc


def self_test():
    if tools_missing():
        return SKIP
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        base_lib, base_inc = build_lib(tmp, "v1")
        baseline = os.path.join(tmp, "v1.abi")
        dump(base_lib, base_inc, baseline)
        cases = [
            # (what, library, expected exit, a word the report must contain)
            ("the same library", (base_lib, base_inc), 0, None),
            ("opts_t grown by a field", build_lib(tmp, "grown", extra="  int b;\n"), 1, "opts"),
            ("a new exported function", build_lib(
                tmp, "added", function='__attribute__((visibility("default"))) int more(void);',
                definition="int more(void) { return 1; }"), 1, "more"),
            ("a field of opts_t renamed", build_lib(tmp, "renamed", a="alpha"), 1, "alpha"),
            ("a field added to the opaque struct box", build_lib(
                tmp, "private", private=" int other;"), 0, None),
        ]
        for what, (lib, inc), expected, word in cases:
            print(f"---- {what}: expecting exit {expected}")
            r = subprocess.run([sys.executable, os.path.abspath(__file__), "--baseline", baseline,
                                "--headers", inc, lib], capture_output=True, text=True)
            print(r.stdout + r.stderr)
            if r.returncode != expected or (word and word not in r.stdout):
                failures.append(f"{what}: exit {r.returncode}, expected {expected}" +
                                (f" with '{word}' in the report" if word else ""))
    for f in failures:
        print(f"FAIL: {f}")
    if not failures:
        print("self-test: the check passes the same ABI and a private change, and fails a grown "
              "structure, a new function and a renamed field")
    return 1 if failures else 0


def main(argv):
    if argv[:1] == ["--self-test"]:
        return self_test()
    update, baseline, headers = False, BASELINE, HEADERS
    args = list(argv)
    while args and args[0].startswith("--"):
        opt = args.pop(0)
        if opt == "--update":
            update = True
        elif opt == "--baseline":
            baseline = args.pop(0)
        elif opt == "--headers":
            headers = args.pop(0)
        else:
            args = []
    if len(args) != 1:
        print(__doc__)
        return 2
    if tools_missing():
        return SKIP
    library = args[0]
    if update:
        os.makedirs(os.path.dirname(baseline), exist_ok=True)
        dump(library, headers, baseline)
        print(f"{os.path.relpath(baseline, ROOT)} rewritten from {library}: commit it with the "
              f"change")
        return 0
    hint = f"{os.path.relpath(__file__, ROOT)} --update {library}"
    return compare(library, headers, baseline, hint)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
