#!/usr/bin/env python3
"""systemd lint (suite `lint`): the shipped unit deploy/zerod.service, alone and with the GPU
drop-in deploy/zerod.service.d/gpu.conf, is what systemd accepts and as confined as promised.

Usage: check_systemd.py ZEROD_BINARY REPOSITORY_ROOT

For each of the two configurations, in a scratch root directory laid out as after an install
(the unit in /etc/systemd/system, zerod at /usr/local/sbin/zerod, a copy of this host's
/usr/lib/systemd/system for the targets it names):
  - `systemd-analyze verify` exits 0 and prints nothing (it exits 0 on unknown keys and bad
    values, printing a warning, so any output fails the check; a unit with a bad key proves here
    that this systemd does print one);
  - `systemd-analyze security --offline=true --threshold=25` gives an overall exposure of at most
    2.5 (the scale is 0..10; --threshold counts tenths).
Also: no WatchdogSec= while zerod's sources never send WATCHDOG=1 (a watchdog nobody feeds kills
a healthy zerod), and Type=notify and RuntimeDirectory=zerod are there.

Exits 0 if all holds, 1 with every problem otherwise, 77 (skipped) where systemd-analyze is not
installed or too old for --offline (systemd < 250), or where this host has no systemd units to
copy. systemd need not be running: these are static checks.
"""
import os
import re
import shutil
import subprocess
import sys
import tempfile

SKIP = 77
MAX_EXPOSURE = 2.5


def skip(why):
    print(f'SKIP: {why}')
    sys.exit(SKIP)


def host_units():
    for d in ('/usr/lib/systemd/system', '/lib/systemd/system'):
        if os.path.isfile(os.path.join(d, 'multi-user.target')):
            return d
    return None


def make_root(tmp, zerod, unit_text, dropins):
    """A root directory with zerod installed, the unit, its drop-ins and the host's units."""
    root = tempfile.mkdtemp(dir=tmp)
    os.makedirs(os.path.join(root, 'usr/local/sbin'))
    shutil.copy2(zerod, os.path.join(root, 'usr/local/sbin/zerod'))
    etc = os.path.join(root, 'etc/systemd/system')
    os.makedirs(etc)
    with open(os.path.join(etc, 'zerod.service'), 'w') as f:
        f.write(unit_text)
    if dropins:
        os.makedirs(os.path.join(etc, 'zerod.service.d'))
        for path in dropins:
            shutil.copy2(path, os.path.join(etc, 'zerod.service.d', os.path.basename(path)))
    shutil.copytree(host_units(), os.path.join(root, 'usr/lib/systemd/system'), symlinks=True)
    return root


def analyze(*args):
    r = subprocess.run(['systemd-analyze', *args], capture_output=True, text=True, timeout=120)
    return r.returncode, (r.stdout + r.stderr).strip()


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    zerod, repo = sys.argv[1], sys.argv[2]
    unit_path = os.path.join(repo, 'deploy', 'zerod.service')
    gpu_dropin = os.path.join(repo, 'deploy', 'zerod.service.d', 'gpu.conf')
    if not shutil.which('systemd-analyze'):
        skip('systemd-analyze is not installed (Debian: package systemd)')
    if not host_units():
        skip('this host has no systemd units (/usr/lib/systemd/system) to verify against')
    rc, out = analyze('security', '--help')
    if '--offline' not in out:
        skip('this systemd-analyze has no --offline (systemd >= 250 needed)')

    problems = []
    with open(unit_path) as f:
        unit = f.read()
    settings = [l.split('=', 1)[0].strip() for l in unit.splitlines()
                if l and not l.lstrip().startswith(('#', ';', '['))]
    if 'Type=notify' not in unit.splitlines():
        problems.append(f'{unit_path}: Type=notify is missing (zerod sends READY=1)')
    if 'RuntimeDirectory=zerod' not in unit.splitlines():
        problems.append(f'{unit_path}: RuntimeDirectory=zerod is missing (the socket lives there)')
    sends_watchdog = False
    for top, _, names in os.walk(os.path.join(repo, 'daemon')):
        for n in names:
            if n.endswith(('.c', '.cc')):
                with open(os.path.join(top, n), errors='replace') as f:
                    sends_watchdog |= 'WATCHDOG=1' in f.read()
    if 'WatchdogSec' in settings and not sends_watchdog:
        problems.append(f'{unit_path}: WatchdogSec= is set but zerod never sends WATCHDOG=1: '
                        'systemd would kill a healthy zerod')

    with tempfile.TemporaryDirectory(prefix='zd_systemd_') as tmp:
        # This systemd reports a bad key, so that silence below means something.
        root = make_root(tmp, zerod, unit.replace('[Service]\n', '[Service]\nNoSuchKey=1\n', 1),
                         [])
        rc, out = analyze('verify', f'--root={root}', 'zerod.service')
        if 'NoSuchKey' not in out:
            problems.append('systemd-analyze verify did not report an unknown key; cannot trust '
                            f'its silence (rc {rc}, output: {out or "none"})')

        for name, dropins in (('zerod.service', []), ('zerod.service + gpu.conf', [gpu_dropin])):
            root = make_root(tmp, zerod, unit, dropins)
            rc, out = analyze('verify', f'--root={root}', 'zerod.service')
            if rc != 0 or out:
                problems.append(f'{name}: systemd-analyze verify: exit {rc}:\n{out}')
            else:
                print(f'{name}: systemd-analyze verify: ok')
            rc, out = analyze('security', '--offline=true', f'--root={root}',
                              f'--threshold={int(MAX_EXPOSURE * 10)}', '--no-pager',
                              'zerod.service')
            m = re.search(r'Overall exposure level for zerod\.service: ([0-9.]+)', out)
            if not m:
                problems.append(f'{name}: systemd-analyze security gave no exposure level '
                                f'(exit {rc}):\n{out}')
                continue
            exposure = float(m.group(1))
            if rc != 0 or exposure > MAX_EXPOSURE:
                problems.append(f'{name}: exposure {exposure} (exit {rc}), at most '
                                f'{MAX_EXPOSURE} wanted:\n{out}')
            else:
                print(f'{name}: systemd-analyze security: exposure {exposure} '
                      f'(at most {MAX_EXPOSURE})')

    for p in problems:
        print(p)
    sys.exit(1 if problems else 0)


if __name__ == '__main__':
    main()
