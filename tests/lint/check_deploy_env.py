#!/usr/bin/env python3
"""Deployment variables (suite `lint`): every ZEROD_* variable that the files in deploy/ set or
name (the systemd unit and its drop-ins, the Kubernetes manifests, the Dockerfile, the example
configuration) is a setting of zerod, as `zerod --help-markdown` lists them with their
environment variables. A misspelt variable is otherwise silently ignored by zerod, and the
deployment runs with a default nobody chose.

    check_deploy_env.py ZEROD REPOSITORY_ROOT

Exits 0, or 1 naming each unknown variable with file:line and the closest real one.
"""
import difflib
import os
import re
import subprocess
import sys

VAR = re.compile(r'\bZEROD_[A-Z0-9_]+\b')


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    zerod, root = sys.argv[1], sys.argv[2]
    table = subprocess.run([zerod, '--help-markdown'], check=True, capture_output=True,
                           text=True).stdout
    known = set(re.findall(r'^\| `[a-z_]+` \| `(ZEROD_[A-Z0-9_]+)` \|', table, re.M))
    if len(known) < 10:
        sys.exit(f'zerod --help-markdown listed {len(known)} variables; expected its table:\n'
                 f'{table}')
    problems, seen = [], 0
    deploy = os.path.join(root, 'deploy')
    for top, _, names in os.walk(deploy):
        for n in sorted(names):
            path = os.path.join(top, n)
            rel = os.path.relpath(path, root)
            with open(path, errors='replace') as f:
                for lineno, line in enumerate(f, 1):
                    for var in VAR.findall(line):
                        seen += 1
                        if var not in known:
                            close = difflib.get_close_matches(var, known, 1)
                            problems.append(f'{rel}:{lineno}: {var} is not a zerod setting' +
                                            (f' (did you mean {close[0]}?)' if close else ''))
    for p in problems:
        print(p)
    print(f'{seen} uses of ZEROD_* variables in deploy/, {len(problems)} unknown '
          f'({len(known)} settings)')
    sys.exit(1 if problems else 0)


if __name__ == '__main__':
    main()
