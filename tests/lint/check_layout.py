#!/usr/bin/env python3
"""Layout lint (suite `lint`): the source tree keeps the architecture docs/design.md describes.

Every #include "..." of a C, C++ or CUDA file is resolved to the file it names (file names are
unique across the tree, so a bare name is enough), and the folder of the including file must be
allowed to depend on the folder of the included one:

    public   client/include/zerod: the API's types and functions   -> public
    common   common/: shared by every side                          -> common, public
    proto    proto/: the wire formats and their conversions         -> proto, common, public
    kernels  kernels/: optimizer kernels on plain pointers          -> kernels, common, public
    client   client/ (libzerod, zeroctl)                            -> client, proto, common, public
    daemon/* zerod, in layers: each folder of daemon/ -> itself and the daemon folders below it
             (DAEMON_LAYERS, top first), kernels, proto, common, public
    examples examples/                                              -> examples, public
    tests    tests/ (checks modules from the inside)                -> anything

Also refused: relative includes ("../x.h"), a file name used twice, an include that names no file
of the tree and is not generated (*.pb-c.h), and citations of a design document outside the
repository (the word DESIGN, a space and a section sign). Prints every violation with file:line; exits 1 if there is any.
"""
import os
import re
import subprocess
import sys

SOURCE_EXT = ('.c', '.h', '.cc', '.cu', '.cuh')

# The daemon's layers, top first (daemon/meson.build builds each as a library that sees only
# itself and those below; docs/design.md, "The map").
DAEMON_LAYERS = ['core', 'control', 'transport', 'step', 'world', 'backends', 'base']

ALLOWED = {
    'public': {'public'},
    'common': {'common', 'public'},
    'proto': {'proto', 'common', 'public'},
    'kernels': {'kernels', 'common', 'public'},
    'client': {'client', 'proto', 'common', 'public'},
    'examples': {'examples', 'public'},
    'tests': None,  # anything
}
for i, layer in enumerate(DAEMON_LAYERS):
    ALLOWED['daemon/' + layer] = ({'daemon/' + below for below in DAEMON_LAYERS[i:]} |
                                  {'kernels', 'proto', 'common', 'public'})

INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"')


def area(path):
    """The architectural folder a tracked file belongs to, or None outside the rules."""
    if path.startswith('client/include/'):
        return 'public'
    parts = path.split('/')
    if parts[0] == 'daemon':
        return '/'.join(parts[:2]) if len(parts) > 2 and '/'.join(parts[:2]) in ALLOWED else None
    if parts[0] in ALLOWED:
        return parts[0]
    return None


def tracked_files(root):
    try:
        out = subprocess.run(['git', 'ls-files'], cwd=root, check=True, capture_output=True,
                             text=True).stdout.split('\n')
        return sorted({f for f in out if f})  # a file in a merge conflict is listed per stage
    except (OSError, subprocess.CalledProcessError):
        files = []
        for top, dirs, names in os.walk(root):
            dirs[:] = [d for d in dirs if not d.startswith('.') and not d.startswith('build')]
            for n in names:
                files.append(os.path.relpath(os.path.join(top, n), root))
        return files


def check(root):
    """The violations in the tree at root, as printable lines."""
    files = tracked_files(root)
    sources = [f for f in files if f.endswith(SOURCE_EXT)]
    problems = []

    by_name = {}
    for f in sources:
        by_name.setdefault(os.path.basename(f), []).append(f)
    for name, where in sorted(by_name.items()):
        if len(where) > 1:
            problems.append(f'{", ".join(where)}: file name {name} is used {len(where)} times; '
                            'names must be unique (includes are by bare name)')

    for f in sources:
        if f.startswith('daemon/') and area(f) is None:
            problems.append(f'{f}: in no layer of the daemon; put it in one of daemon/'
                            f'{{{",".join(DAEMON_LAYERS)}}}')
            continue
        src_area = area(f)
        allowed = ALLOWED.get(src_area) if src_area else None
        with open(os.path.join(root, f), encoding='utf-8', errors='replace') as fh:
            lines = fh.readlines()
        for n, line in enumerate(lines, 1):
            m = INCLUDE.match(line)
            if not m:
                continue
            inc = m.group(1)
            if '..' in inc.split('/'):
                problems.append(f'{f}:{n}: relative include "{inc}"; include by file name')
                continue
            name = os.path.basename(inc)
            if name.endswith('.pb-c.h'):
                dst_area = 'proto'  # generated from proto/*.proto into the build directory
            elif name in by_name:
                dst_area = area(by_name[name][0])
            else:
                problems.append(f'{f}:{n}: "{inc}" is not a file of the tree')
                continue
            if allowed is not None and dst_area not in allowed:
                problems.append(f'{f}:{n}: {src_area} includes "{inc}" ({dst_area}); {src_area} '
                                f'may include only {", ".join(sorted(allowed))}')

    cite = re.compile('DESIGN \u00a7')
    for f in files:
        if f.startswith('tests/lint/'):
            continue
        try:
            with open(os.path.join(root, f), encoding='utf-8') as fh:
                for n, line in enumerate(fh, 1):
                    if cite.search(line):
                        problems.append(f'{f}:{n}: cites "DESIGN \u00a7", a document outside the '
                                        'repository; cite docs/design.md')
        except (UnicodeDecodeError, IsADirectoryError, FileNotFoundError):
            continue

    return sources, problems


def self_test():
    """The checker itself: a small tree with one planted violation of each kind is refused, and
    the same tree without them passes."""
    import tempfile
    good = {
        'common/error.h': '#include "zerod.h"\n',
        'client/include/zerod/zerod.h': '',
        'kernels/adam.c': '#include "error.h"\n#include "zerod.h"\n',
        'daemon/step/rank.c': '#include "adam.h"\n#include "zerod.pb-c.h"\n#include "comm.h"\n',
        'daemon/backends/comm.h': '#include "config.h"\n',
        'daemon/base/config.h': '',
        'daemon/core/daemon.c': '#include "rank.c"\n#include "comm.h"\n',
        'kernels/adam.h': '',
        'tests/t.c': '#include "rank.c"\n',
    }
    bad = {
        'kernels/bad1.c': '#include "rank.c"\n',            # kernels -> daemon
        'common/bad2.c': '#include "adam.h"\n',             # common -> kernels
        'client/bad3.c': '#include "../common/error.h"\n',  # relative
        'proto/rank.c': '',                                  # a second rank.c
        'daemon/step/bad4.c': '#include "nowhere.h"\n',     # no such file
        'docs/x.md': 'see DESIGN \u00a74\n',                 # outside citation
        'daemon/backends/bad5.c': '#include "daemon.c"\n',  # a back edge: backends -> core
        'daemon/base/bad6.h': '#include "comm.h"\n',        # base -> backends
        'daemon/stray.c': '',                                # a file outside every layer
    }
    for tree, want in ((good, 0), ({**good, **bad}, 9)):
        with tempfile.TemporaryDirectory() as root:
            for rel, text in tree.items():
                os.makedirs(os.path.join(root, os.path.dirname(rel)), exist_ok=True)
                with open(os.path.join(root, rel), 'w') as fh:
                    fh.write(text)
            _, problems = check(root)
            if len(problems) != want:
                print(f'self-test: expected {want} violation(s), got {len(problems)}:')
                for p in problems:
                    print('  ' + p)
                return 1
    print('self-test: planted violations found, clean tree passes')
    return 0


def main():
    if len(sys.argv) > 1 and sys.argv[1] == '--self-test':
        return self_test()
    sources, problems = check(sys.argv[1] if len(sys.argv) > 1 else '.')
    for p in problems:
        print(p)
    print(f'checked {len(sources)} sources: {len(problems)} layout violation(s)')
    return 1 if problems else 0


if __name__ == '__main__':
    sys.exit(main())
