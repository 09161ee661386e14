"""A restarted rank 0 that dies again right after the world re-formed with it is noticed.

Of a world of two zerods (the built-in rendezvous store lives in zerod 0), zerod 0 is SIGKILLed;
zerod 1's heartbeat finds it silent and its rank re-forms the world with the restarted zerod 0
(a new process). zerod 0 is then SIGKILLed again at once, before zerod 1's heartbeat (every 5 s
here) read the node registry anew, which dies with zerod 0. The heartbeat must still find the
new process silent within about one heartbeat and peer_timeout_ms: the world's formation told it
which process to watch. It used to watch the first process, whose verdict it had given already
(and which the new world instance ignores), so zerod 1 said `ok` until a collective timed out
(30 minutes by default): the 30 s stall of a survivor seen in the kill trials.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import time
import unittest

import common

import zerod.testing  # noqa: E402

HEARTBEAT_MS = 5000
PEER_TIMEOUT_MS = 1000
ZEROCTL = os.environ.get("ZEROCTL_BIN", os.path.join(common.ROOT, "build", "client", "zeroctl"))


def health(d: zerod.testing.LocalZerod) -> str:
    """The zerod's rank's health (zeroctl status), "" when it does not answer."""
    out = subprocess.run([ZEROCTL, "--address", d.control_address, "status", "--json"],
                         capture_output=True, text=True, timeout=30)
    return json.loads(out.stdout)["ranks"][0]["health"] if out.returncode == 0 else ""


class Rank0RewatchTest(unittest.TestCase):
    def wait_health(self, d: zerod.testing.LocalZerod, ok: bool, timeout: float) -> float:
        """Seconds until d's rank is `ok` (ok) or anything else (not ok); fails after timeout."""
        t0 = time.monotonic()
        while True:
            h = health(d)
            if (h == "ok") == ok:
                return time.monotonic() - t0
            self.assertLess(time.monotonic() - t0, timeout,
                            f"zerod's rank stays {h!r} for {timeout} s (wanted "
                            f"{'ok' if ok else 'not ok'}); log:\n{d.log()[-3000:]}")
            time.sleep(0.02)

    def restart_rank0(self, world: zerod.testing.LocalWorld) -> None:
        """zerod 0 again, a new process at the control address zerod 1 was given."""
        old = world.daemons[0]
        addr = old.control_address
        if os.path.exists(addr[len("unix:"):]):
            os.unlink(addr[len("unix:"):])
        new = zerod.testing.LocalZerod(old.args + ["--control_address", addr],
                                       log_level="info", keep_dir=True)
        new.control_address = addr
        world.daemons[0] = new

    def test_restarted_rank0_killed_at_once_is_noticed(self) -> None:
        ckpt = tempfile.mkdtemp(prefix="zerod-rewatch-")
        world = zerod.testing.LocalWorld(
            2, daemons=2, log_level="info", keep_dir=True,
            args=["--bucket_elems", "512", "--checkpoint_dir", ckpt, "--heartbeat_ms",
                  str(HEARTBEAT_MS), "--peer_timeout_ms", str(PEER_TIMEOUT_MS)])
        limit = (HEARTBEAT_MS + PEER_TIMEOUT_MS) / 1000 + 5  # one round late, plus slack
        try:
            survivor = world.daemons[1]
            self.wait_health(survivor, ok=True, timeout=30)
            common.stop_zerod(world.daemons[0], signal.SIGKILL)
            self.wait_health(survivor, ok=False, timeout=limit)  # the first process's silence
            self.restart_rank0(world)
            self.wait_health(survivor, ok=True, timeout=60)  # re-formed with the new process
            seen = len(survivor.log())
            common.stop_zerod(world.daemons[0], signal.SIGKILL)
            took = self.wait_health(survivor, ok=False, timeout=limit)
            print(f"the second death of zerod 0 noticed in {took:.2f} s (heartbeat_ms "
                  f"{HEARTBEAT_MS}, peer_timeout_ms {PEER_TIMEOUT_MS})")
            self.assertIn("has not answered for", survivor.log()[seen:],
                          "the heartbeat's verdict on the second process is not in the log")
        finally:
            world.stop(signal.SIGKILL, check=False)


if __name__ == "__main__":
    common.run(Rank0RewatchTest)
