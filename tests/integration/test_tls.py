"""Integration test of mutual TLS on zerod's control plane (tls_cert, tls_key, tls_ca; zeroctl
--tls-*), suite `integration`, against real zerod and zeroctl processes.

Certificates come from scripts/make_test_ca.sh (skipped, exit 77, where openssl is missing):
  - a world of two zerods (one rank each) on TCP control addresses with TLS: the second joins
    through the first's rendezvous store, both ranks train steps (Python client over the local
    socket) with identical results, the heartbeats between them work (no node declared dead),
    and `zeroctl status --world` with zeroctl's client certificate reaches both nodes;
  - refusals: zeroctl with no certificate (a plaintext channel), a client with TLS but no
    certificate, a certificate of another CA, and a name the server's certificate does not carry
    each fail, and zerod logs each refused handshake with OpenSSL's reason; a call refused for
    the control token after TLS is logged with the peer's address and certificate subject;
  - a control_address other hosts reach (0.0.0.0) starts with TLS and no control_insecure, and
    is refused at start without TLS;
  - rotation: SIGHUP re-reads the files; a key that is not the certificate's keeps the running
    pair (a WARN naming the file); a certificate of a second CA is then served, so zeroctl
    trusting the new CA connects and zeroctl trusting only the old one is refused;
    a world of two moved to a second CA by SIGHUP: the channel rank 1's checkpoint writer opens
    afterwards presents the new certificate (the old CA's are refused by then);
  - start-up errors: a partial set, a missing file, a private key readable by others, a key not
    the certificate's: zerod exits with a message naming the setting.
Run by `meson test` with ZEROD_BIN, ZEROCTL_BIN, ZEROD_LIBRARY and PYTHONPATH set; by hand from
the repository root after a build, it finds ./build itself.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import unittest
from concurrent.futures import ThreadPoolExecutor
from typing import List, Sequence

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "tests", "python"))
import common  # noqa: E402  (paths to the package and the build when run by hand)

import zerod  # noqa: E402
import zerod.testing  # noqa: E402

ZEROCTL = os.environ.get("ZEROCTL_BIN", os.path.join(ROOT, "build", "client", "zeroctl"))
STEPS = 3


def bound_address(daemon: zerod.testing.LocalZerod) -> str:
    """The control address zerod bound (a ":0" port replaced), from its log."""
    m = re.search(r"control service on (\S+?), mutual TLS", daemon.log())
    if not m:
        raise AssertionError(f"zerod did not log a control service with TLS:\n{daemon.log()}")
    return m.group(1)


def wait_log(daemon: zerod.testing.LocalZerod, pattern: str, timeout: float = 10.0) -> str:
    """The first log line matching pattern, waiting for it."""
    deadline = time.monotonic() + timeout
    while True:
        for line in daemon.log().splitlines():
            if re.search(pattern, line):
                return line
        if time.monotonic() > deadline:
            raise AssertionError(f"no log line matches {pattern!r}:\n{daemon.log()}")
        time.sleep(0.05)


class TlsTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls) -> None:
        if not shutil.which("openssl"):
            common.skip("openssl is not installed (Debian: the openssl package); "
                        "scripts/make_test_ca.sh needs it")
        cls.dir = tempfile.mkdtemp(prefix="zerod-tls-")
        subprocess.run([os.path.join(ROOT, "scripts", "make_test_ca.sh"), cls.dir], check=True,
                       stdout=subprocess.DEVNULL)

    @classmethod
    def tearDownClass(cls) -> None:
        shutil.rmtree(cls.dir, ignore_errors=True)

    def pem(self, name: str) -> str:
        return os.path.join(self.dir, name)

    def node_tls(self, cert: str = "node.pem", key: str = "node.key") -> List[str]:
        return ["--tls_cert", self.pem(cert), "--tls_key", self.pem(key), "--tls_ca",
                self.pem("ca.pem")]

    def zeroctl(self, address: str, *args: str, cert: str = "client",
                ca: str = "ca.pem") -> subprocess.CompletedProcess:
        """zeroctl --address address [TLS flags] args; cert "" for none (a plaintext channel)."""
        tls = (["--tls-cert", self.pem(cert + ".pem"), "--tls-key", self.pem(cert + ".key"),
                "--tls-ca", self.pem(ca)] if cert else [])
        env = {k: v for k, v in os.environ.items() if not k.startswith("ZEROCTL_TLS_")}
        return subprocess.run([ZEROCTL, "--address", address, "--timeout-ms", "5000"] + tls +
                              list(args), capture_output=True, text=True, timeout=60, env=env)

    def start_fails(self, args: Sequence[str]) -> str:
        """Starts a zerod that must refuse to start; returns its log."""
        with self.assertRaises(zerod.testing.ZerodProcessError) as cm:
            zerod.testing.LocalZerod(list(args), log_level="info")
        return str(cm.exception) + "\n" + cm.exception.log

    # ---- a world of two over TLS ---------------------------------------------------------------

    def test_world_of_two_trains_over_tls(self) -> None:
        world = ["--world_size", "2", "--local_ranks", "1", "--bucket_elems", "256",
                 "--heartbeat_ms", "100", "--peer_timeout_ms", "5000"]
        d0 = zerod.testing.LocalZerod(world + ["--first_rank", "0", "--control_address",
                                               "127.0.0.1:0"] + self.node_tls())
        daemons = [d0]
        clients: List[zerod.Client] = []
        try:
            rdv = bound_address(d0)
            d1 = zerod.testing.LocalZerod(world + ["--first_rank", "1", "--control_address",
                                                   "127.0.0.1:0", "--rendezvous_address", rdv] +
                                          self.node_tls())
            daemons.append(d1)
            clients = [d.connect(0) for d in daemons]
            params = [("w", (20, 30)), ("b", (30,))]

            def run(c: zerod.Client) -> List[zerod.StepResult]:
                c.layout(params, [zerod.Group(lr=0.01)], replace=True)
                for p in c.params_info():
                    for k in range(p.numel):
                        c.param_buffer[p.offset + k] = 0.5
                c.register()  # joins the world through rank 0's store, over TLS
                out = []
                for s in range(STEPS):
                    for p in c.params_info():
                        for k in range(p.numel):
                            c.grad_buffer[p.offset + k] = 0.01 * (s + 1)
                    out.append(c.step())
                return out

            with ThreadPoolExecutor(2) as pool:
                r0, r1 = pool.map(run, clients)
            self.assertEqual([r.step for r in r0], list(range(1, STEPS + 1)))
            self.assertEqual([r.step for r in r1], list(range(1, STEPS + 1)))
            self.assertEqual(list(clients[0].param_buffer), list(clients[1].param_buffer),
                             "both ranks must hold the same parameters after the steps")
            self.assertNotEqual(clients[0].param_buffer[0], 0.5, "the steps changed nothing")
            time.sleep(0.5)  # a few heartbeats, over TLS too

            st = self.zeroctl(rdv, "status", "--world")
            self.assertEqual(st.returncode, 0, st.stdout + st.stderr)
            ranks = [ln.split()[0] for ln in st.stdout.splitlines()
                     if re.match(r"\s*[01]\s+0\s", ln)]
            self.assertEqual(sorted(ranks), ["0", "1"], st.stdout)

            for i, d in enumerate(daemons):
                log = d.log()
                self.assertIn("mutual TLS", log)
                self.assertNotIn("refused a TLS connection", log, f"zerod {i}:\n{log}")
                self.assertNotIn("has not answered", log, f"zerod {i}:\n{log}")
        finally:
            for c in clients:
                c.close()
            for d in reversed(daemons):
                d.stop()

    # ---- refusals ------------------------------------------------------------------------------

    def test_refusals_are_logged(self) -> None:
        token = self.pem("token")
        with open(token, "w") as f:
            f.write("0123456789abcdef0123456789abcdef\n")
        os.chmod(token, 0o600)
        with zerod.testing.LocalZerod(["--control_address", "127.0.0.1:0",
                                       "--control_token_file", token] + self.node_tls(),
                                      log_level="info") as d:
            addr = bound_address(d)
            port = int(addr.rsplit(":", 1)[1])

            ok = self.zeroctl(addr, "status")
            self.assertEqual(ok.returncode, 0, ok.stdout + ok.stderr)
            self.assertIn("ranks 0..0 of 1", ok.stdout)

            # A plaintext channel: zerod refuses the handshake; zeroctl says why it may be.
            plain = self.zeroctl(addr, "status", cert="")
            self.assertEqual(plain.returncode, 1, plain.stdout + plain.stderr)
            self.assertIn("no client certificate", plain.stderr)
            wait_log(d, r"WARN control: refused a TLS connection .*wrong version number: the "
                        r"other end does not speak TLS")

            # TLS without a client certificate (zeroctl cannot: all three or none).
            ctx = ssl.create_default_context(cafile=self.pem("ca.pem"))
            ctx.set_alpn_protocols(["h2"])
            with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
                with ctx.wrap_socket(raw, server_hostname="localhost") as s:
                    try:  # TLS 1.3: the server refuses after the client's handshake is done
                        s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
                        self.assertEqual(s.recv(100), b"")
                    except (ssl.SSLError, ConnectionError):
                        pass
            wait_log(d, r"refused a TLS connection .*peer did not return a certificate: the "
                        r"client presented no certificate")

            # A certificate another CA signed.
            other = self.zeroctl(addr, "status", cert="other")
            self.assertEqual(other.returncode, 1, other.stdout + other.stderr)
            wait_log(d, r"refused a TLS connection .*certificate verify failed")

            # zeroctl trusting another CA refuses zerod's certificate itself.
            distrust = self.zeroctl(addr, "status", ca="other-ca.pem")
            self.assertEqual(distrust.returncode, 1)
            self.assertIn("certificate verify failed", distrust.stderr)

            # A call past TLS refused for the token is logged with the peer and who it is.
            ck = self.zeroctl(addr, "checkpoint")
            self.assertEqual(ck.returncode, 1, ck.stdout + ck.stderr)
            self.assertIn("control token", ck.stderr)
            wait_log(d, r"refused /zerod\.v1\.Control/Checkpoint from ipv4:127\.0\.0\.1:\d+ "
                        r"\(certificate CN ?= ?zeroctl\): no control token")

    def test_other_hosts_address_needs_tls(self) -> None:
        log = self.start_fails(["--control_address", "0.0.0.0:0"])
        self.assertIn("set tls_cert, tls_key and tls_ca", log)
        with zerod.testing.LocalZerod(["--control_address", "0.0.0.0:0"] + self.node_tls(),
                                      log_level="info") as d:
            port = bound_address(d).rsplit(":", 1)[1]
            ok = self.zeroctl(f"127.0.0.1:{port}", "health")
            self.assertEqual(ok.returncode, 0, ok.stdout + ok.stderr)
            self.assertIn("SERVING", ok.stdout)
            # The node's certificate names localhost and 127.0.0.1 only: dialled by another
            # name, the client refuses the server.
            wrong = self.zeroctl(f"127.0.0.2:{port}", "health")
            self.assertEqual(wrong.returncode, 1, wrong.stdout + wrong.stderr)
            self.assertIn("Peer name 127.0.0.2 is not in peer certificate", wrong.stderr)

    # ---- rotation -------------------------------------------------------------------------------

    def test_sighup_reloads_certificates(self) -> None:
        live = tempfile.mkdtemp(dir=self.dir)  # the files zerod reads, rotated in place

        def install(cert: str, key: str, *cas: str) -> None:
            shutil.copyfile(self.pem(cert), os.path.join(live, "tls.crt"))
            shutil.copyfile(self.pem(key), os.path.join(live, "tls.key"))
            os.chmod(os.path.join(live, "tls.key"), 0o600)
            with open(os.path.join(live, "ca.crt"), "w") as f:
                for ca in cas:
                    with open(self.pem(ca)) as g:
                        f.write(g.read())

        install("node.pem", "node.key", "ca.pem")
        args = ["--control_address", "127.0.0.1:0", "--tls_cert", os.path.join(live, "tls.crt"),
                "--tls_key", os.path.join(live, "tls.key"), "--tls_ca",
                os.path.join(live, "ca.crt")]
        with zerod.testing.LocalZerod(args, log_level="info") as d:
            addr = bound_address(d)
            ok = self.zeroctl(addr, "health")
            self.assertEqual(ok.returncode, 0, ok.stdout + ok.stderr)
            # A key that is not the certificate's: the running pair stays, the log names the file.
            install("node.pem", "other.key", "ca.pem")
            d.process.send_signal(signal.SIGHUP)
            wait_log(d, r"WARN SIGHUP: TLS certificates not reloaded, the running ones stay: "
                        r"tls_key \S*tls\.key is not the private key of tls_cert \S*tls\.crt")
            ok = self.zeroctl(addr, "health")
            self.assertEqual(ok.returncode, 0, ok.stdout + ok.stderr)
            # A certificate of another CA, and a CA bundle that still admits the old clients.
            install("other.pem", "other.key", "ca.pem", "other-ca.pem")
            d.process.send_signal(signal.SIGHUP)
            wait_log(d, r"WARN SIGHUP: TLS certificates reloaded from")
            new = self.zeroctl(addr, "health", ca="other-ca.pem")
            self.assertEqual(new.returncode, 0, new.stdout + new.stderr)
            old = self.zeroctl(addr, "health")
            self.assertEqual(old.returncode, 1, old.stdout + old.stderr)
            self.assertIn("certificate verify failed", old.stderr)
            self.assertIsNone(d.process.poll(), "SIGHUP must not stop zerod")

    def test_channels_after_a_reload_present_the_new_certificate(self) -> None:
        """A world of two moves to a second CA: after SIGHUP each node serves and accepts only the
        new CA's certificates, so the channel that the checkpoint writer of rank 1 opens to rank
        0's store afterwards works only if it presents the new certificate."""
        ckpt = tempfile.mkdtemp(dir=self.dir)
        lives = [tempfile.mkdtemp(dir=self.dir) for _ in range(2)]

        def install(live: str, cert: str, key: str, ca: str) -> List[str]:
            for src, dst in ((cert, "tls.crt"), (key, "tls.key"), (ca, "ca.crt")):
                shutil.copyfile(self.pem(src), os.path.join(live, dst))
            os.chmod(os.path.join(live, "tls.key"), 0o600)
            return ["--tls_cert", os.path.join(live, "tls.crt"), "--tls_key",
                    os.path.join(live, "tls.key"), "--tls_ca", os.path.join(live, "ca.crt")]

        world = ["--world_size", "2", "--local_ranks", "1", "--bucket_elems", "256",
                 "--heartbeat_ms", "100", "--peer_timeout_ms", "5000", "--checkpoint-dir", ckpt,
                 "--collective_timeout_ms", "10000"]  # a refused channel fails the checkpoint
        d0 = zerod.testing.LocalZerod(world + ["--first_rank", "0", "--control_address",
                                               "127.0.0.1:0"] +
                                      install(lives[0], "node.pem", "node.key", "ca.pem"))
        daemons = [d0]
        clients: List[zerod.Client] = []
        try:
            rdv = bound_address(d0)
            daemons.append(zerod.testing.LocalZerod(
                world + ["--first_rank", "1", "--control_address", "127.0.0.1:0",
                         "--rendezvous_address", rdv] +
                install(lives[1], "node.pem", "node.key", "ca.pem")))
            clients = [d.connect(0) for d in daemons]

            def register_and_step(c: zerod.Client) -> zerod.StepResult:
                c.layout([("w", (20, 30))], [zerod.Group(lr=0.01)], replace=True)
                c.register()
                return c.step()

            with ThreadPoolExecutor(2) as pool:
                list(pool.map(register_and_step, clients))
            for i, d in enumerate(daemons):
                install(lives[i], "other.pem", "other.key", "other-ca.pem")
                d.process.send_signal(signal.SIGHUP)
                wait_log(d, r"WARN SIGHUP: TLS certificates reloaded from")
            # the old CA's certificates are refused now, the new one's accepted
            old = self.zeroctl(rdv, "health")
            self.assertEqual(old.returncode, 1, old.stdout + old.stderr)
            new = self.zeroctl(rdv, "health", cert="other", ca="other-ca.pem")
            self.assertEqual(new.returncode, 0, new.stdout + new.stderr)
            # rank 1's checkpoint writer opens its first channel to rank 0's store now
            with ThreadPoolExecutor(2) as pool:
                got = list(pool.map(lambda c: c.checkpoint(), clients))
            self.assertEqual(got[0][0], 1)
            self.assertTrue(os.path.exists(os.path.join(got[0][1], "manifest.json")))
            with ThreadPoolExecutor(2) as pool:
                self.assertEqual([r.step for r in pool.map(lambda c: c.step(), clients)], [2, 2])
            self.assertIsNone(d0.process.poll())
        finally:
            for c in clients:
                c.close()
            for d in reversed(daemons):
                d.stop()

    # ---- start-up errors ------------------------------------------------------------------------

    def test_start_errors_name_the_setting(self) -> None:
        base = ["--control_address", "127.0.0.1:0"]
        log = self.start_fails(base + ["--tls_cert", self.pem("node.pem")])
        self.assertIn("tls_cert, tls_key and tls_ca go together", log)
        self.assertIn("tls_key is not set", log)

        missing = self.pem("absent.key")
        log = self.start_fails(base + self.node_tls(key="absent.key"))
        self.assertIn(f"tls_key {missing}: No such file or directory", log)

        log = self.start_fails(base + self.node_tls(cert="node.key"))
        self.assertIn("is not a PEM file holding certificates", log)

        loose = self.pem("loose.key")
        shutil.copy(self.pem("node.key"), loose)
        os.chmod(loose, 0o644)
        log = self.start_fails(base + self.node_tls(key="loose.key"))
        self.assertIn("has mode 0644", log)

        log = self.start_fails(base + self.node_tls(key="client.key"))
        self.assertIn("gRPC refused the TLS identity: tls_key is not the key of tls_cert", log)

        partial = subprocess.run([ZEROCTL, "--tls-cert", self.pem("client.pem"), "status"],
                                 capture_output=True, text=True, timeout=60)
        self.assertEqual(partial.returncode, 1)
        self.assertIn("--tls-cert, --tls-key and --tls-ca go together", partial.stderr)
        mismatch = subprocess.run(
            [ZEROCTL, "--address", "127.0.0.1:1", "--tls-cert", self.pem("client.pem"),
             "--tls-key", self.pem("other.key"), "--tls-ca", self.pem("ca.pem"), "status"],
            capture_output=True, text=True, timeout=60)
        self.assertEqual(mismatch.returncode, 1)
        self.assertIn("is --tls-key the key of --tls-cert?", mismatch.stderr)


if __name__ == "__main__":
    common.run(TlsTest)
