"""The world's coordination on etcd (`rendezvous = etcd://...`), against a real etcd server.

  1. unreachable: a zerod of a W=2 world whose etcd endpoint nothing listens on logs an error
     naming the endpoint and the etcd URL (its rank degraded with that reason; zerod serves on);
then Debian's etcd (package etcd-server) starts on random loopback ports with a temporary data
directory, and:
  2. the rendezvous client's rules on etcd (tests/integration/test_etcd_rdv.c, the program named
     by --rdv; default build/tests/integration/test_etcd_rdv);
  3. a W=2 world of two zerods forms through etcd and trains the deterministic steps of
     fault_trials.py bit for bit like the reference (the built-in store's runs equal it too:
     fault_trials, test_checkpoint); etcd is stopped and started again (same data directory and
     port) in the middle of the run: the world trains on while it is down, and the checkpoints
     complete once it is back (their agreement goes through the store); every key in etcd is
     under /zerod/ and the node registry under /zerod/<job>/node/ (read through etcd's HTTP
     gateway);
  4. rank 0's zerod is SIGKILLed after a checkpoint, in the middle of the run, and started again
     with --resume latest at another control address (as on a replacement node: with the
     built-in store the other node's rendezvous_address would name the dead one): the world
     re-forms through etcd and trains to the end bit for bit (fault_trials.Trial, target
     "zerod 0"); the same for zerod 1 (at its own address);
  5. a W=2 world trains through an etcd that requires client certificates (--client-cert-auth;
     scripts/make_test_ca.sh's CA), the zerods' tls_cert being their client certificate.

Exit 77 (skip) only when the etcd binary is not installed. About 30 s.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import queue
import ssl
from typing import List, Optional

import common

import numpy as np

import fault_trials as ft
import zerod.testing  # noqa: E402

ETCD = shutil.which("etcd") or ("/usr/bin/etcd" if os.path.exists("/usr/bin/etcd") else None)
STEPS = 30


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


class Etcd:
    """One etcd member on loopback: client and peer ports drawn at random, a temporary data
    directory kept across restart()."""

    def __init__(self, tmp: str, tls: Optional[str] = None) -> None:
        name = "etcd-tls" if tls else "etcd"
        self.dir = os.path.join(tmp, name)
        self.tls = tls  # make_test_ca.sh's directory: node.pem serves, ca.pem checks clients
        self.port, self.peer = free_port(), free_port()
        self.proc = None
        self.log_path = os.path.join(tmp, name + ".log")
        self.start()

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        scheme = "https" if self.tls else "http"
        c, p = f"{scheme}://127.0.0.1:{self.port}", f"http://127.0.0.1:{self.peer}"
        tls = []
        if self.tls:
            tls = ["--cert-file", os.path.join(self.tls, "node.pem"),
                   "--key-file", os.path.join(self.tls, "node.key"),
                   "--trusted-ca-file", os.path.join(self.tls, "ca.pem"), "--client-cert-auth"]
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [ETCD, "--name", "zd", "--data-dir", self.dir, "--listen-client-urls", c,
             "--advertise-client-urls", c, "--listen-peer-urls", p,
             "--initial-advertise-peer-urls", p, "--initial-cluster", f"zd={p}",
             "--log-level", "warn"] + tls,
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + 20
        while True:  # ready: the gateway answers a range
            try:
                self.keys("/")
                return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"etcd did not start: {self.tail()}")
                time.sleep(0.05)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(15)

    def tail(self) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-5:])
        except OSError:
            return "(no log)"

    def keys(self, prefix: str) -> list:
        """Every key beginning with prefix, through etcd's JSON gateway (/v3/kv/range)."""
        b = prefix.encode()
        end = b[:-1] + bytes([b[-1] + 1])
        body = json.dumps({"key": base64.b64encode(b).decode(),
                           "range_end": base64.b64encode(end).decode(), "keys_only": True})
        ctx = None
        if self.tls:
            ctx = ssl.create_default_context(cafile=os.path.join(self.tls, "ca.pem"))
            ctx.load_cert_chain(os.path.join(self.tls, "node.pem"),
                                os.path.join(self.tls, "node.key"))
        req = urllib.request.Request(f"{'https' if self.tls else 'http'}://{self.endpoint}"
                                     f"/v3/kv/range", body.encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=2, context=ctx) as r:
            out = json.loads(r.read())
        return [base64.b64decode(kv["key"]).decode() for kv in out.get("kvs", [])]


def check(cond: bool, msg: str) -> None:
    if not cond:
        raise AssertionError(msg)


def unreachable(tmp: str) -> None:
    dead = f"127.0.0.1:{free_port()}"
    url = f"etcd://{dead}/unreachable"
    d = zerod.testing.LocalZerod(["--world_size", "2", "--first_rank", "0", "--local_ranks", "1",
                                  "--rendezvous", url, "--connect_timeout_ms", "1500"],
                                 log_level="info", timeout=30.0)
    try:
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            lines = [l for l in d.log().splitlines()
                     if " ERROR " in l and dead in l and url in l]
            if lines:
                break
            time.sleep(0.1)
        check(bool(lines), f"no log line names the etcd endpoint {dead}:\n{d.log()[-3000:]}")
        print(f"unreachable: {lines[0][:300]}", flush=True)
    finally:
        common.stop_zerod(d, signal.SIGTERM, timeout=12.0)


def train(etcd: Etcd, tmp: str, ref_digest: dict, ref: dict, job: str, restart: bool,
          extra: List[str] = []) -> None:
    """A W=2 world through etcd trains STEPS steps bit for bit; with restart, etcd is stopped at
    a third of them and started again once the world has trained on without it."""
    url = f"etcd://{etcd.endpoint}/{job}"
    ckpt = os.path.join(tmp, "ckpt-" + job)
    os.mkdir(ckpt)
    world = zerod.testing.LocalWorld(
        2, daemons=2, args=ft.ZEROD_ARGS + ["--checkpoint_dir", ckpt, "--rendezvous", url] + extra,
        log_level="info", timeout=30.0, keep_dir=True)
    events: "queue.Queue[tuple]" = queue.Queue()
    procs = []
    try:
        for r in range(2):
            sock, _ = world.endpoint(r)
            p = subprocess.Popen([sys.executable, ft.__file__, "--driver", "--socket", sock,
                                  "--rank", str(r), "--steps", str(STEPS), "--out",
                                  os.path.join(tmp, f"final-{job}{r}.npz")],
                                 stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
            procs.append(p)

            def read(p=p, r=r) -> None:
                for line in p.stdout:
                    events.put((r, json.loads(line)))
                events.put((r, {"ev": "exit", "rc": p.wait()}))

            threading.Thread(target=read, daemon=True).start()
        done, down_steps, restarted, t_up = set(), 0, False, None
        deadline = time.monotonic() + 90
        while len(done) < 2:
            check(time.monotonic() < deadline, f"the run did not end within 90 s (done: {done})")
            if restarted and t_up is None and time.monotonic() - t_down > 3:
                etcd.start()  # steps held at a checkpoint waiting for etcd: bring it back
                t_up = time.monotonic()
            try:
                r, ev = events.get(timeout=0.2)
            except queue.Empty:
                continue
            if ev["ev"] == "error":
                raise AssertionError(f"trainer {r}: {ev}")
            if ev["ev"] == "exit":
                check(ev["rc"] == 0, f"trainer {r} exited with {ev['rc']}")
                done.add(r)
            if ev["ev"] == "step":
                check(ev["digest"] == ref_digest[ev["step"]],
                      f"trainer {r}: step {ev['step']} differs from the reference")
                if etcd.proc.poll() is not None and r == 0:
                    down_steps += 1
                if restart and r == 0 and ev["step"] == STEPS // 3 and not restarted:
                    etcd.stop()  # the world trains on while etcd is down
                    restarted = True
                    t_down = time.monotonic()
                if restarted and t_up is None and r == 0 and down_steps >= 2:
                    etcd.start()
                    t_up = time.monotonic()
        if restart:
            check(restarted and t_up is not None, "etcd was not restarted during the run")
            check(down_steps >= 1, "no step was trained while etcd was down")
        for r in range(2):
            got = dict(np.load(os.path.join(tmp, f"final-{job}{r}.npz")))
            for name, _ in ft.PARAMS:
                check(np.array_equal(got[name].view(np.uint32), ref[STEPS][name].view(np.uint32)),
                      f"trainer {r}: {name} differs from the reference at step {STEPS}")
        due = STEPS // ft.EVERY * ft.EVERY
        deadline = time.monotonic() + 10
        while max(ft.complete_checkpoints(ckpt), default=0) < due:
            check(time.monotonic() < deadline,
                  f"the checkpoint of step {due} did not complete after etcd came back "
                  f"(complete: {ft.complete_checkpoints(ckpt)})")
            time.sleep(0.05)
        # zeroctl status --world through node 1 (not rank 0's): the registry is read from etcd
        zeroctl = os.environ.get("ZEROCTL_BIN",
                                 os.path.join(common.ROOT, "build", "client", "zeroctl"))
        out = subprocess.run([zeroctl, "--address", world.daemons[1].control_address, "status",
                              "--world", "--json"], capture_output=True, text=True, timeout=30)
        check(out.returncode == 0, f"zeroctl status --world at node 1: {out.stderr.strip()}")
        listed = json.loads(out.stdout)
        check(sorted(n.get("first_rank", -1) for n in listed["nodes"]) == [0, 1] and
              all(n["ok"] for n in listed["nodes"]) and len(listed["ranks"]) == 2,
              f"zeroctl status --world at node 1 lists {listed['nodes']}; expected both nodes")
        keys = etcd.keys("/")
        mine = [k for k in keys if k.startswith(f"/zerod/{job}/")]
        check(all(k.startswith("/zerod/") for k in keys),
              f"keys outside /zerod/: {[k for k in keys if not k.startswith('/zerod/')][:5]}")
        check(any(k.startswith(f"/zerod/{job}/node/") for k in mine), "no node registry in etcd")
        print(f"world of 2 through etcd{' with TLS' if etcd.tls else ''}: {STEPS} steps bit for "
              f"bit{f', {down_steps} of them while etcd was down' if restart else ''}; "
              f"{len(mine)} keys under /zerod/{job}/", flush=True)
    except BaseException:
        sys.stderr.write(world.log()[-6000:])
        raise
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for i, d in enumerate(world.daemons):
            common.stop_zerod(d, signal.SIGTERM, timeout=12.0)


class MovedRankZero(ft.Trial):
    """A fault trial whose killed zerod 0 comes back at another control address (a replacement
    node): only a store that outlives node 0 lets the world re-form."""

    def restart_zerod(self, i: int) -> None:
        if i != 0:
            super().restart_zerod(i)
            return
        old = self.world.daemons[0]
        self.zerod_restarts += 1
        new = zerod.testing.LocalZerod(old.args + ["--resume", "latest"], log_level="info",
                                       start=False, timeout=30.0, keep_dir=True)
        shutil.rmtree(new.dir, ignore_errors=True)
        new.dir, new.socket = old.dir, old.socket  # the trainers' endpoint stays
        new.control_address = "unix:" + os.path.join(old.dir, "control-moved.sock")
        new.log_path = os.path.join(old.dir, f"zerod.moved{self.zerod_restarts}.log")
        self.world.daemons[0] = new
        new.start()


def zerod_lost(etcd: Etcd, tmp: str, ref: dict, ref_digest: dict, which: int) -> None:
    """zerod `which` SIGKILLed after a checkpoint and started again (zerod 0 at another control
    address); the world re-forms through etcd and finishes bit for bit."""
    url = f"etcd://{etcd.endpoint}/lost{which}"
    saved = ft.ZEROD_ARGS
    ft.ZEROD_ARGS = saved + ["--rendezvous", url]
    try:
        # target "zerod <which>" (every fourth trial), killed after a checkpoint: the first such
        # trial of seed 1 whose kill lands while the run is on
        for i in range(2 + which, 400, 4):
            trial_tmp = tempfile.mkdtemp(prefix="zerod-etcd-trial-", dir=tmp)
            trial = MovedRankZero(i, 1, ref, dict(ref_digest), STEPS, 60.0, trial_tmp,
                                  (1.5, 2.0))
            check(trial.target == f"zerod {which}", trial.target)
            if trial.kill_step <= ft.EVERY + 1 or trial.kill_step > STEPS - 8:
                shutil.rmtree(trial_tmp, ignore_errors=True)
                continue
            trial.run()
            moved = [l for l in trial.world.daemons[1].log().splitlines()
                     if "control-moved.sock" in l] if which == 0 else ["(not moved)"]
            print(trial.line(), flush=True)
            for n in trial.notes:
                print(f"    {n}", flush=True)
            if trial.outcome != "ok":
                trial.keep_logs(os.path.join(trial_tmp, "logs"))
                for f in sorted(os.listdir(os.path.join(trial_tmp, "logs"))):
                    with open(os.path.join(trial_tmp, "logs", f), errors="replace") as fh:
                        sys.stderr.write(f"---- {f} ----\n" + "".join(fh.readlines()[-40:]))
                raise AssertionError(f"zerod {which}'s loss through etcd: {trial.outcome}")
            check(bool(moved), "zerod 1 never watched rank 0's node at its new address")
            if which == 0:
                print(f"    zerod 1: {moved[0][:200]}", flush=True)
            trial.cleanup()
            if trial.effective:
                return
        raise AssertionError(f"no trial's kill of zerod {which} landed while the run was on")
    finally:
        ft.ZEROD_ARGS = saved


def tls_world(tmp: str, ref: dict, ref_digest: dict) -> None:
    """etcd that requires client certificates (--client-cert-auth, make_test_ca.sh's CA): the
    zerods' TLS identity (tls_cert, tls_key, tls_ca) is their etcd client certificate."""
    if not shutil.which("openssl"):
        print("tls: SKIPPED (openssl is not installed)", flush=True)
        return
    certs = os.path.join(tmp, "certs")
    subprocess.run([os.path.join(common.ROOT, "scripts", "make_test_ca.sh"), certs], check=True,
                   stdout=subprocess.DEVNULL)
    etcd = Etcd(tmp, tls=certs)
    try:
        train(etcd, tmp, ref_digest, ref, "tls", restart=False,
              extra=["--tls_cert", os.path.join(certs, "node.pem"), "--tls_key",
                     os.path.join(certs, "node.key"), "--tls_ca", os.path.join(certs, "ca.pem")])
    finally:
        etcd.stop()


def main() -> int:
    if ETCD is None:
        print("SKIP: etcd is not installed (Debian package etcd-server)")
        return common.SKIP
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rdv", default=os.path.join(common.ROOT, "build", "tests", "integration",
                                                  "test_etcd_rdv"))
    args = ap.parse_args()
    t0 = time.monotonic()
    tmp = tempfile.mkdtemp(prefix="zerod-etcd-")
    etcd = None
    try:
        unreachable(tmp)
        etcd = Etcd(tmp)
        rc = subprocess.run([args.rdv, etcd.endpoint, f"127.0.0.1:{free_port()}"],
                            timeout=120).returncode
        check(rc == 0, f"{args.rdv} exited with {rc}")
        ref = ft.reference(STEPS)
        ref_digest = {s: ft.digest(p) for s, p in ref.items()}
        train(etcd, tmp, ref_digest, ref, "train", restart=True)
        zerod_lost(etcd, tmp, ref, ref_digest, 0)
        zerod_lost(etcd, tmp, ref, ref_digest, 1)
        tls_world(tmp, ref, ref_digest)
    except BaseException:
        if etcd is not None:
            sys.stderr.write(f"---- etcd log ----\n{etcd.tail()}")
        raise
    finally:
        if etcd is not None:
            etcd.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"passed in {time.monotonic() - t0:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
