"""Registrations that outlive a failure: a trainer restarted at once gets its rank back, not
ZD_EBUSY; a registration waiting for the world survives a peer zerod's restart.

A W=2 world in one zerod. Trainer 0 registers (collective: it waits for rank 1) and is SIGKILLed
while it waits; its session keeps rank 0 until that registration gives up (within a second of
the client leaving). A new trainer 0 that registers at once waits for the departed client's rank
instead of being refused, and registers with the trainer of rank 1 (seen first in the fault
trials: a zerod restarted during registration, the trainers restarted torchrun-style).

A W=2 world of two zerods with checkpoints. Trainer 1 registers and waits for rank 0; zerod 0 is
SIGKILLed and restarted (--resume latest, as a supervisor would), at once or 1.5 s later. The heartbeat tells zerod 1 its
world broke; its waiting registration must not fail (ZD_EPEER) nor wait out the connect timeout:
zerod 1 re-forms the world and registers again there, and trainer 1 steps with the restarted
trainer 0.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import unittest

import common

import zerod.testing  # noqa: E402
from zerod import Client, Group  # noqa: E402

MODEL = [("w", (10, 30)), ("b", (10,))]


def wait_for_log(test: unittest.TestCase, d: "zerod.testing.LocalZerod", pattern: str, count: int,
                 timeout: float = 30.0) -> None:
    """Until zerod's log matches pattern count times (a safety net of timeout seconds)."""
    deadline = time.monotonic() + timeout
    while len(re.findall(pattern, d.log())) < count:
        if time.monotonic() > deadline:
            test.fail(f"zerod's log did not match {pattern!r} {count} times within {timeout} s:\n"
                      f"{d.log()[-3000:]}")
        time.sleep(0.02)


def register(socket: str, local: int) -> Client:
    c = Client(socket, local_rank=local)
    c.layout(MODEL, [Group(lr=0.1)])
    c.register()
    return c


class RankHandoverTest(unittest.TestCase):
    def test_register_waits_for_a_departed_client(self) -> None:
        with zerod.testing.LocalWorld(2) as world:
            sock0, local0 = world.endpoint(0)
            sock1, local1 = world.endpoint(1)
            first = subprocess.Popen([sys.executable, __file__, "--child", sock0, str(local0)])
            d = world.daemons[0]
            # Its registration waits for rank 1 at the barrier.
            wait_for_log(self, d, r"rendezvous set 'barrier/\w+/register/1/0'", 1)
            self.assertIsNone(first.poll())
            first.send_signal(signal.SIGKILL)
            first.wait(10)

            results: dict = {}

            def trainer(rank: int, sock: str, local: int) -> None:
                try:
                    results[rank] = register(sock, local)
                except Exception as e:  # noqa: BLE001  (reported below)
                    results[rank] = e
            threads = [threading.Thread(target=trainer, args=(0, sock0, local0), daemon=True)]
            threads[0].start()
            # Rank 1's trainer only once the dead client's registration has given up (within a
            # second of the disconnect, zerod's barrier slice) and the restarted trainer's has
            # taken the rank and reached the barrier in its place. Sooner, rank 1 could complete
            # the barrier with the dead client's registration: its rank would then stand in for a
            # first step that this test's trainers never take.
            wait_for_log(self, d, r"register waits for local rank 0, held by session \d+ "
                         r"\(pid \d+\) whose client has gone", 1)
            wait_for_log(self, d, r"waiting for the other ranks' clients to register", 1)
            wait_for_log(self, d, r"rendezvous set 'barrier/\w+/register/1/0'", 2)
            threads.append(threading.Thread(target=trainer, args=(1, sock1, local1), daemon=True))
            threads[1].start()
            for t in threads:
                t.join(30)
            self.assertIsInstance(results.get(0), Client,
                                  f"the restarted trainer 0 was refused: {results.get(0)}")
            self.assertIsInstance(results.get(1), Client, f"trainer 1: {results.get(1)}")
            c0, c1 = results[0], results[1]
            self.assertEqual((c0.info.world_size, c1.info.world_size), (2, 2))
            self.assertRegex(d.log(), r"register waits for local rank 0, held by session \d+ "
                             r"\(pid \d+\) whose client has gone")
            c0.close()
            c1.close()

    def test_registration_survives_a_restarted_peer(self) -> None:
        self.registration_survives(restart_after=0.0, peer_timeout_ms=1000)

    def test_registration_waits_out_a_peer_that_is_down(self) -> None:
        """zerod 0, which holds the rendezvous store, stays down for 1.5 s: less than the peer
        timeout, more than the store's retry slice. The barrier waits for the store instead of
        failing the registration with ZD_EPEER before any verdict."""
        self.registration_survives(restart_after=1.5, peer_timeout_ms=3000)

    def registration_survives(self, restart_after: float, peer_timeout_ms: int) -> None:
        ckpt = tempfile.mkdtemp(prefix="zerod-reform-")
        world = zerod.testing.LocalWorld(
            2, daemons=2, log_level="info",
            args=["--checkpoint_dir", ckpt, "--heartbeat_ms", "100", "--peer_timeout_ms",
                  str(peer_timeout_ms)])
        results: dict = {}

        def trainer(rank: int) -> None:
            try:
                c = world.connect(rank)
                c.layout(MODEL, [Group(lr=0.1)])
                c.register()
                results[rank] = c
            except Exception as e:  # noqa: BLE001  (reported below)
                results[rank] = e

        try:
            waiting = threading.Thread(target=trainer, args=(1,), daemon=True)
            waiting.start()
            time.sleep(0.5)  # its registration waits for rank 0
            self.assertNotIn(1, results, "trainer 1 registered without rank 0")
            old = world.daemons[0]
            common.stop_zerod(old, signal.SIGKILL)
            time.sleep(restart_after)
            new = zerod.testing.LocalZerod(old.args + ["--resume", "latest"], log_level="info",
                                           start=False, keep_dir=True)
            shutil.rmtree(new.dir, ignore_errors=True)
            new.dir, new.socket, new.control_address = old.dir, old.socket, old.control_address
            new.log_path = os.path.join(old.dir, "zerod.restarted.log")
            world.daemons[0] = new
            new.start()
            restarted = threading.Thread(target=trainer, args=(0,), daemon=True)
            restarted.start()
            waiting.join(30)
            restarted.join(5)
            self.assertIsInstance(results.get(1), Client,
                                  f"trainer 1's registration: {results.get(1)}; zerod 1's log:\n"
                                  f"{world.daemons[1].log()[-3000:]}")
            self.assertIsInstance(results.get(0), Client, f"trainer 0: {results.get(0)}")
            self.assertRegex(world.daemons[1].log(),
                             r"registration: the world broke while it formed .*registering again")
            steps = []
            threads = [threading.Thread(target=lambda c=results[r]: steps.append(c.step().step))
                       for r in (0, 1)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
            self.assertEqual(steps, [1, 1])
            for r in (0, 1):
                results[r].close()
            common.stop_world(world)  # the restarted zerod and zerod 1 exit 0
        finally:
            world.stop(signal.SIGKILL, check=False)  # only what a failure above left running
            shutil.rmtree(ckpt, ignore_errors=True)


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        register(sys.argv[2], int(sys.argv[3]))
        time.sleep(60)  # killed before
        sys.exit(1)
    common.run(RankHandoverTest)
