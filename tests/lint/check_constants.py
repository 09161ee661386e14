#!/usr/bin/env python3
"""libzerod's table of constants (zd_constants(), client/abi.c) against the public headers
(suite `lint`).

Bindings take the headers' integer constants from that table instead of copying them (the Python
package defines its ZD_* names from it), so the table must name every one, with the value the
compiler gives it. The names come from the headers themselves, run through the C preprocessor:
every enumerator of an enum whose name starts with ZD_ (the error codes too, which errors.h
generates from its X-macro list) and every object-like macro ZD_* whose value is an integer
literal. Their values come from a program compiled against the headers. A constant added to
zerod.h without its row in client/abi.c fails here, as does a row the headers do not have.

    check_constants.py LIBRARY    compare (the C compiler is $CC, else cc)
    check_constants.py --self-test  show that a missing, extra or wrong constant is reported
"""

import ctypes
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
HEADERS = os.path.join(ROOT, "client", "include")
INCLUDES = "#include <zerod/errors.h>\n#include <zerod/zerod.h>\n"
INTEGER = re.compile(r"^\(?\s*-?\s*(0[xX][0-9a-fA-F]+|\d+)[uUlL]*\s*\)?$")


def cc():
    return os.environ.get("CC", "cc").split()


def header_names(headers):
    """The integer constants the headers define: enumerators and integer macros named ZD_*."""
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "names.c")
        with open(src, "w") as f:
            f.write(INCLUDES)
        expanded = subprocess.run(cc() + ["-E", "-P", "-I", headers, src], check=True,
                                  capture_output=True, text=True).stdout
        macros = subprocess.run(cc() + ["-E", "-dM", "-I", headers, src], check=True,
                                capture_output=True, text=True).stdout
    names = []
    for body in re.findall(r"\benum\b[^{;]*\{([^}]*)\}", expanded):
        for item in body.split(","):
            m = re.match(r"\s*(ZD_\w+)", item)
            if m:
                names.append(m.group(1))
    for line in macros.splitlines():
        m = re.match(r"#define (ZD_\w+) (.*)$", line)  # function-like macros have "(" after the name
        if m and INTEGER.match(m.group(2).strip()):
            names.append(m.group(1))
    return names


def header_values(headers, names):
    """The value of each name, as a program compiled against the headers sees it."""
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = os.path.join(tmp, "values.c"), os.path.join(tmp, "values")
        with open(src, "w") as f:
            f.write("#include <stdio.h>\n" + INCLUDES + "int main(void) {\n")
            for n in names:
                f.write(f'  printf("%s %lld\\n", "{n}", (long long)({n}));\n')
            f.write("  return 0;\n}\n")
        subprocess.run(cc() + ["-I", headers, "-o", exe, src], check=True)
        out = subprocess.run([exe], check=True, capture_output=True, text=True).stdout
    return {name: int(value) for name, value in (line.split() for line in out.splitlines())}


class Constant(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("value", ctypes.c_int64)]


def library_table(library):
    lib = ctypes.CDLL(library)
    fn = lib.zd_constants
    fn.restype = ctypes.c_size_t
    fn.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_size_t)]
    base, stride = ctypes.c_void_p(), ctypes.c_size_t()
    n = fn(ctypes.byref(base), ctypes.byref(stride))
    rows = [Constant.from_address(base.value + i * stride.value) for i in range(n)]
    return [(r.name.decode(), int(r.value)) for r in rows]


def differences(header, table):
    """What is wrong with the table (a list of lines; empty when it matches the headers)."""
    problems = []
    names = [n for n, _ in table]
    for n in sorted({n for n in names if names.count(n) > 1}):
        problems.append(f"{n} appears {names.count(n)} times in the table")
    got = dict(table)
    for n, v in header.items():
        if n not in got:
            problems.append(f"{n} = {v} is in the headers but not in the table (client/abi.c)")
        elif got[n] != v:
            problems.append(f"{n} is {got[n]} in the table, {v} in the headers")
    for n in got:
        if n not in header:
            problems.append(f"{n} is in the table but the headers define no such constant")
    return problems


def self_test():
    header = {"ZD_OK": 0, "ZD_F32": 1, "ZD_STEP_NO_GATHER": 2}
    cases = [
        ("the same constants", list(header.items()), []),
        ("a constant missing", [("ZD_OK", 0), ("ZD_F32", 1)], ["ZD_STEP_NO_GATHER = 2"]),
        ("a wrong value", [("ZD_OK", 0), ("ZD_F32", 3), ("ZD_STEP_NO_GATHER", 2)],
         ["ZD_F32 is 3 in the table, 1 in the headers"]),
        ("an extra row", list(header.items()) + [("ZD_GONE", 5)], ["ZD_GONE is in the table"]),
        ("a row twice", list(header.items()) + [("ZD_F32", 1)], ["ZD_F32 appears 2 times"]),
    ]
    failed = 0
    for what, table, expected in cases:
        got = differences(header, table)
        ok = len(got) == len(expected) and all(any(e in g for g in got) for e in expected)
        print(f"{'ok  ' if ok else 'FAIL'} {what}: {got}")
        failed += not ok
    # And the headers' names are found: a few of each kind.
    names = header_names(HEADERS)
    for n in ("ZD_F32", "ZD_EBUFFER", "ZD_OK", "ZD_STEP_NO_GATHER", "ZD_ALL_BUCKETS",
              "ZD_VERSION_MAJOR"):
        if n not in names:
            print(f"FAIL: {n} not found in the headers")
            failed += 1
    for n in ("ZD_EXPORT", "ZD_VERSION_STRING", "ZD_MODEL_DESC_INIT", "ZD_ERROR_MAP"):
        if n in names:
            print(f"FAIL: {n} taken for an integer constant")
            failed += 1
    print(f"self-test: {'passed' if not failed else f'{failed} failures'} "
          f"({len(names)} constants in the headers)")
    return 1 if failed else 0


def main(argv):
    if argv[:1] == ["--self-test"]:
        return self_test()
    if len(argv) != 1:
        print(__doc__)
        return 2
    names = header_names(HEADERS)
    header = header_values(HEADERS, names)
    problems = differences(header, library_table(argv[0]))
    for p in problems:
        print(p)
    if problems:
        print(f"zd_constants() and the headers disagree: the table is in client/abi.c")
        return 1
    print(f"zd_constants() names the {len(header)} integer constants of the headers, with their "
          f"values")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
