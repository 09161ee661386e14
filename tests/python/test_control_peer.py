#!/usr/bin/env python3
"""A unix: control address admits the processes the client socket admits.

zerod accepts its unix control socket itself and checks each connecting process's credentials
(SO_PEERCRED) against allowed_uids/allowed_gids before gRPC sees the connection: a socket file
left world-writable (socket_mode 0666) must not let another user read the world's status or stop
zerod. Needs root to run zeroctl as another user (uid 65534, "nobody"); skipped (77) otherwise.
"""

import os
import subprocess
import sys
import time
import unittest

import common  # noqa: F401  (sets up the path to the zerod package)

import zerod.testing  # noqa: E402

OTHER_UID = 65534


def as_other_user() -> None:
    os.setgroups([])
    os.setgid(OTHER_UID)
    os.setuid(OTHER_UID)


def zeroctl(daemon: zerod.testing.LocalZerod, *args: str, other_user: bool = False):
    return subprocess.run([os.environ["ZEROCTL_BIN"], "--address", daemon.control_address]
                          + list(args), capture_output=True, text=True, timeout=60,
                          preexec_fn=as_other_user if other_user else None)


class ControlPeerTest(unittest.TestCase):
    def start(self, *args: str) -> zerod.testing.LocalZerod:
        d = zerod.testing.LocalZerod(["--socket_mode", "0666", *args])
        os.chmod(d.dir, 0o755)  # the socket's own mode is then all that stands in the way
        self.addCleanup(d.stop)
        return d

    def test_other_user_refused_then_allowed(self) -> None:
        d = self.start()
        out = zeroctl(d, "status", other_user=True)
        self.assertNotEqual(out.returncode, 0, out.stdout)
        self.assertIn(f"admits only the users and groups of its allowed_uids and allowed_gids "
                      f"there; this process is uid {OTHER_UID}", out.stderr)
        for _ in range(100):  # the refusal's log line may land after zeroctl gave up
            if "refused a connection" in d.log():
                break
            time.sleep(0.05)
        self.assertRegex(d.log(), rf"refused a connection to unix:\S+ from pid \d+ uid "
                         rf"{OTHER_UID} gid {OTHER_UID}: not in allowed_uids or allowed_gids")
        # the drain that would stop zerod is refused the same way, and zerod goes on
        out = zeroctl(d, "drain", "--force", other_user=True)
        self.assertNotEqual(out.returncode, 0, out.stdout)
        self.assertIsNone(d.process.poll())
        # its own user still gets the status
        out = zeroctl(d, "status")
        self.assertEqual(out.returncode, 0, out.stderr)

        allowed = self.start("--allowed_uids", f"0,{OTHER_UID}")
        out = zeroctl(allowed, "status", other_user=True)
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertNotIn("refused a connection", allowed.log())


if __name__ == "__main__":
    if os.geteuid() != 0:
        print("SKIP: needs root to run zeroctl as another user")
        sys.exit(77)
    common.run(ControlPeerTest)
