"""SIGTERM while a zerod re-forms its world, with a trainer's registration queued behind it.

Of a world of two zerods, zerod 1 is SIGKILLed and not restarted. A trainer of zerod 0 steps,
the step fails (ZD_EPEER) and zerod 0's rank starts re-forming the world, waiting for rank 1; a
second registration queues behind that. zerod 0 is then stopped with SIGTERM: the queued
registration must be refused (ZD_EDEGRADED or the connection closed) and zerod must exit with
status 0. It used to run the registration without a communicator and die with SIGSEGV (found by
fault_trials.py).
"""

from __future__ import annotations

import signal
import tempfile
import threading
import time
import unittest

import common

import zerod.testing  # noqa: E402
from zerod import ZerodError  # noqa: E402


class HealShutdownTest(unittest.TestCase):
    def test_sigterm_while_reforming_with_a_register_queued(self) -> None:
        ckpt = tempfile.mkdtemp(prefix="zerod-heal-")
        world = zerod.testing.LocalWorld(
            2, daemons=2, log_level="info",
            args=["--bucket_elems", "512", "--checkpoint_dir", ckpt, "--checkpoint_every_steps",
                  "7", "--heartbeat_ms", "100", "--peer_timeout_ms", "1000"])
        errors: dict = {}

        def trainer(r: int, steps: int, key: str) -> None:
            try:
                c = world.connect(r)
                c.layout([("w", (1000,))], grad_mean=False)
                c.register()
                for _ in range(steps):
                    c.step()
                c.close()
            except ZerodError as e:
                errors[key] = e.name

        try:
            threads = [threading.Thread(target=trainer, args=(r, 20, f"first{r}"))
                       for r in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            self.assertEqual(errors, {})
            common.stop_zerod(world.daemons[1], signal.SIGKILL)
            trainer(0, 1, "reattach")  # resumes alone; its step finds rank 1 gone
            self.assertEqual(errors.get("reattach"), "ZD_EPEER")
            queued = threading.Thread(target=trainer, args=(0, 1, "queued"))
            queued.start()
            time.sleep(0.5)  # its register waits behind the re-forming
            common.stop_zerod(world.daemons[0], signal.SIGTERM)  # exit 0 (it used to SIGSEGV)
            queued.join(20)
            self.assertIn(errors.get("queued"), ("ZD_EDEGRADED", "ZD_ECLOSED", "ECONNRESET",
                                                 "EPIPE"))
        finally:
            world.stop(signal.SIGKILL, check=False)  # only what a failure above left running


if __name__ == "__main__":
    common.run(HealShutdownTest)
