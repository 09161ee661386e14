"""Unit-level tests of the core zerod.Client against a real zerod (no torch needed: the core
package must work with the standard library alone).

Covers: connect errors, info, layout/register, zero-copy buffers, one AdamW step checked
bitwise against the kernel formula, errors raised as ZerodError with the daemon's message (and
the connection still usable afterwards), status text and its parser, pipelined requests waited
in any order, reattach/resume, replace, close() releasing the buffers, LocalZerod's exit
status, and library loading errors.
"""

from __future__ import annotations

import ctypes
import math
import os
import struct
import subprocess
import sys
import threading
import unittest

import common

import zerod  # noqa: E402
import zerod.testing  # noqa: E402
from zerod import Client, Group, ZerodError  # noqa: E402

BUCKET = "256"


def model(tag: str) -> list:
    """The test model; `tag` makes it a different model (layout) per test, so that state left
    by one test on the daemon's rank is not resumed by the next."""
    return [(f"{tag}.w", (10, 30)), (f"{tag}.b", (10,)), (f"{tag}.s", ())]


def f32(x: float) -> float:
    """x rounded to float32."""
    return struct.unpack("f", struct.pack("f", x))[0]


def f32_bits(x: float) -> int:
    return struct.unpack("I", struct.pack("f", x))[0]


class ClientTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls) -> None:
        cls.daemon = zerod.testing.LocalZerod(["--bucket_elems", BUCKET])

    @classmethod
    def tearDownClass(cls) -> None:
        code = cls.daemon.stop()  # raises unless zerod exits with status 0
        assert code == 0

    def connect(self, **kw) -> Client:
        c = Client(self.daemon.socket, **kw)
        self.addCleanup(c.close)
        return c

    def registered(self, groups=None, replace=True, fill=1.0, **kw) -> Client:
        c = self.connect()
        c.layout(model(self._testMethodName), groups or [Group(lr=0.1, weight_decay=0.0)], replace=replace, **kw)
        pb = c.param_buffer
        for p in c.params_info():
            for k in range(p.numel):
                pb[p.offset + k] = fill
        c.register()
        return c

    # ---- connection ---------------------------------------------------------------------------

    def test_connect_no_daemon(self) -> None:
        path = os.path.join(self.daemon.dir, "nobody-here.sock")
        with self.assertRaises(ZerodError) as cm:
            Client(path)
        e = cm.exception
        self.assertEqual(e.name, "ENOENT")
        self.assertLess(e.code, 0)
        self.assertIn(path, e.message)
        self.assertIn("is zerod running", e.message)
        self.assertEqual(e.call, "zd_connect")

    def test_info(self) -> None:
        c = self.connect()
        i = c.info
        self.assertEqual((i.world_size, i.rank, i.local_rank), (1, 0, 0))
        self.assertEqual(i.backend, "cpu")
        self.assertEqual(i.protocol_version, 1)
        self.assertEqual(i.bucket_elems, int(BUCKET))
        self.assertTrue(i.daemon_version)
        self.assertIn("rank 0/1", repr(c))

    def test_rank_busy_and_unknown(self) -> None:
        self.registered()  # attaches rank 0 (the only one)
        with self.assertRaises(ZerodError) as cm:
            Client(self.daemon.socket)  # any free rank: none
        self.assertEqual(cm.exception.name, "ZD_EBUSY")
        self.assertIn("all 1 local ranks have a client attached", cm.exception.message)
        c2 = self.connect(local_rank=0)  # an explicit rank is checked at register
        c2.layout(model("busy"))
        with self.assertRaises(ZerodError) as cm:
            c2.register()
        self.assertEqual(cm.exception.name, "ZD_EBUSY")
        self.assertIn("local rank 0 is attached to client", cm.exception.message)
        with self.assertRaises(ZerodError) as cm:
            Client(self.daemon.socket, local_rank=5)
        self.assertEqual(cm.exception.name, "ZD_ERANK")
        self.assertIn("5", cm.exception.message)

    # ---- layout, buffers, step ----------------------------------------------------------------

    def test_layout_and_buffers(self) -> None:
        c = self.connect()
        c.layout(model("t"), replace=True)
        infos = c.params_info()
        self.assertEqual([p.name for p in infos], ["t.w", "t.b", "t.s"])
        self.assertEqual([p.numel for p in infos], [300, 10, 1])
        for p in infos:
            self.assertEqual(p.offset % 64, 0, "parameters start at multiples of 64 elements")
        buckets = c.buckets_info()
        self.assertEqual(len(buckets), c.info.nbuckets)
        self.assertGreaterEqual(len(buckets), 2)
        self.assertEqual(sum(b.elems for b in buckets), c.info.total_elems)
        pb, gb = c.param_buffer, c.grad_buffer
        self.assertEqual(pb.format, "f")
        self.assertEqual(pb.nbytes, c.info.total_elems * 4)
        self.assertEqual(gb.nbytes, c.info.total_elems * 4)
        # zero-copy: the memoryview is the shared memory the library mapped
        arr = c.param_array()
        self.assertEqual(ctypes.addressof(arr), c.param_address)
        pb[3] = 2.5
        self.assertEqual(struct.unpack_from("f", arr, 12)[0], 2.5)
        self.assertTrue(all(x == 0.0 for x in gb), "new buffers are zeroed")

    def test_bf16_buffers(self) -> None:
        c = self.connect()
        c.layout(model("t"), param_dtype="bf16", grad_dtype="fp16", replace=True)
        self.assertEqual(c.param_buffer.format, "H")  # 16-bit types show their bit patterns
        self.assertEqual(c.grad_buffer.format, "H")
        self.assertEqual((c.param_dtype, c.grad_dtype), (zerod.DType.BF16, zerod.DType.F16))
        self.assertEqual(c.param_buffer.nbytes, c.info.total_elems * 2)

    def test_device_buffers_need_the_cuda_backend(self) -> None:
        # This zerod runs its CPU backend (any machine): device buffers are refused with the
        # reason, the session stays usable, and host-only/device-only accessors say which.
        c = self.connect()
        self.assertEqual(c.info.backend, "cpu")
        with self.assertRaises(ZerodError) as cm:
            c.cuda_device()
        self.assertEqual(cm.exception.name, "ZD_EBACKEND", str(cm.exception))
        with self.assertRaises(ZerodError) as cm:
            c.layout(model("t"), memory="cuda", device=0, replace=True)
        self.assertEqual(cm.exception.name, "ZD_EBACKEND", str(cm.exception))
        with self.assertRaises(ValueError):
            c.layout(model("t"), memory="gpu", replace=True)
        c.layout(model("t"), replace=True)
        self.assertEqual(c.memory, "host")
        with self.assertRaises(ValueError) as cv:
            c.param_device_array()
        self.assertIn("param_array()", str(cv.exception))
        with self.assertRaises(ZerodError) as cm:  # zd_set_stream: no device buffers
            c.set_stream(None)
        self.assertEqual(cm.exception.name, "ZD_EORDER", str(cm.exception))

    def test_device_array_interface(self) -> None:
        # The __cuda_array_interface__ a device buffer is described by (no GPU needed to build
        # the description): one dimension of total_elems, bf16 as int16, the client held.
        c = self.connect()
        arr = zerod.DeviceArray(0x7f0000000000, 311, zerod.DType.BF16, c)
        cai = arr.__cuda_array_interface__
        self.assertEqual(cai["shape"], (311,))
        self.assertEqual(cai["typestr"], "<i2")
        self.assertEqual(cai["data"], (0x7f0000000000, False))
        self.assertEqual(cai["version"], 2)
        self.assertIs(arr._zerod_client, c)
        self.assertEqual(zerod.DeviceArray(1, 2, zerod.DType.F32, c)
                         .__cuda_array_interface__["typestr"], "<f4")

    def test_step_matches_formula(self) -> None:
        lr, b1, b2, eps = 0.1, 0.9, 0.999, 1e-8
        c = self.registered([Group(lr=lr, betas=(b1, b2), eps=eps, weight_decay=0.0)])
        gb = c.grad_buffer
        for p in c.params_info():
            for k in range(p.numel):
                gb[p.offset + k] = 0.5
        r = c.step()
        self.assertEqual(r.step, 1)
        self.assertTrue(r.applied)
        self.assertEqual(r.clip_coef, 1.0)
        # kernels/adam.h, step 1 from m = v = 0 (no fma matters: its addend is 0)
        a1, a2 = f32(1 - b1), f32(1 - b2)
        m = f32(0.5 * a1)
        v = f32(f32(a2 * 0.5) * 0.5)
        bc2s = f32(math.sqrt(1 - b2))
        nss = f32(-(lr / (1 - b1)))
        d = f32(f32(f32(math.sqrt(v)) / bc2s) + f32(eps))
        want = f32(1.0 + f32(f32(nss * m) / d))
        pb = c.param_buffer
        for p in c.params_info():
            for k in range(p.numel):
                self.assertEqual(f32_bits(pb[p.offset + k]), f32_bits(want),
                                 f"{p.name}[{k}]: {pb[p.offset + k]!r} vs {want!r}")
        self.assertEqual(c.info.step, 1)

    # ---- errors -------------------------------------------------------------------------------

    def test_errors_carry_the_daemons_message(self) -> None:
        c = self.connect()
        with self.assertRaises(ZerodError) as cm:
            c.step()
        self.assertEqual(cm.exception.name, "ZD_EORDER")
        self.assertIn("before zd_register", cm.exception.message)

        c.layout(model("hp"), [Group(lr=-1.0)], replace=True)
        with self.assertRaises(ZerodError) as cm:
            c.register()
        e = cm.exception
        self.assertEqual((e.name, e.code), ("ZD_EHPARAM", zerod._lib.ZD_EHPARAM))
        self.assertIn("lr is -1", e.message)  # formatted by the daemon
        self.assertIn("zd_register", str(e))
        self.assertEqual(e.description, "invalid hyperparameter")

        with self.assertRaises(ZerodError) as cm:  # found by the library, before any request
            c.layout([("w", (4,), 3)], [Group()], replace=True)
        self.assertEqual(cm.exception.name, "ZD_EGROUP")
        self.assertIn("'w' is in group 3", cm.exception.message)

        with self.assertRaises(ZerodError) as cm:
            c.layout(model("hp"), param_dtype="f16")
        self.assertEqual(cm.exception.name, "ZD_EDTYPE")
        self.assertIn("f16", cm.exception.message)
        with self.assertRaises(ValueError):
            c.layout(model("hp"), param_dtype="int8")

    def test_errors_leave_the_session_usable(self) -> None:
        c = self.registered()
        with self.assertRaises(ZerodError) as cm:
            c.step(scatter=False)
        self.assertEqual(cm.exception.name, "ZD_EORDER")
        self.assertIn("was not scattered", cm.exception.message)
        with self.assertRaises(ZerodError) as cm:
            c.step([Group(lr=float("nan"))])
        self.assertEqual(cm.exception.name, "ZD_EHPARAM")
        with self.assertRaises(ZerodError) as cm:
            c.step([Group(), Group()])
        self.assertIn("group", cm.exception.message)
        with self.assertRaises(ZerodError) as cm:
            c.param_info(99)
        self.assertEqual(cm.exception.name, "EINVAL")
        r = c.step()  # none of the failures applied anything
        self.assertEqual(r.step, 1)

    # ---- status ---------------------------------------------------------------------------------

    def test_status(self) -> None:
        c = self.registered()
        c.step()
        text = c.status()
        self.assertTrue(text.startswith("# "))
        s = c.status_dict()
        for section in ("server", "world", "rank 0", "config"):
            self.assertIn(section, s)
        self.assertEqual(s["server"]["socket"], self.daemon.socket)
        self.assertEqual(s["world"]["world_size"], "1")
        rs = c.rank_status()
        self.assertEqual(rs["model"], "registered")
        self.assertEqual(rs["step"], "1")
        self.assertEqual(rs["params"], "3")
        self.assertEqual(int(rs["layout_hash"], 16), c.info.layout_hash)

    def test_parse_status(self) -> None:
        text = "# server\nversion:0.1.0\nsocket:/tmp/x:y\n\n# rank 0\nstep:3\nempty:\n"
        self.assertEqual(zerod.parse_status(text),
                         {"server": {"version": "0.1.0", "socket": "/tmp/x:y"},
                          "rank 0": {"step": "3", "empty": ""}})
        self.assertEqual(zerod.parse_status(""), {})
        with self.assertRaises(ValueError):
            zerod.parse_status("# s\nno separator\n")

    # ---- pipelining -----------------------------------------------------------------------------

    def test_pipelined_requests(self) -> None:
        c = self.registered()
        nb = c.info.nbuckets
        before = int(c.rank_status()["scatters"])
        scatters = [c.scatter_start(b) for b in range(nb)]
        step = c.step_start(scatter=False, gather=False)
        gather = c.gather_start()
        self.assertFalse(step.done)
        # wait out of order: the step first, then the rest
        r = step.wait()
        self.assertEqual((r.step, r.applied), (1, True))
        self.assertIsNone(gather.wait())
        for s in reversed(scatters):
            self.assertIsNone(c.wait(s))
        self.assertTrue(all(s.done for s in scatters))
        self.assertIs(step.wait(), r, "waiting twice returns the stored result")
        self.assertEqual(int(c.rank_status()["scatters"]), before + nb)
        self.assertEqual(c.info.step, 1)
        # a failing request in a pipeline fails alone
        bad = c.step_start(scatter=False)
        good = c.step_start()
        with self.assertRaises(ZerodError) as cm:
            bad.wait()
        self.assertEqual(cm.exception.name, "ZD_EORDER")
        self.assertIn("zd_wait(step)", str(cm.exception))
        self.assertEqual(good.wait().step, 2)

    def test_many_outstanding(self) -> None:
        c = self.registered()
        reqs = [c.scatter_start() for _ in range(64)]
        with self.assertRaises(ZerodError) as cm:
            c.scatter_start()
        self.assertEqual(cm.exception.name, "EBUSY")
        for r in reqs:
            r.wait()
        c.step()

    def test_threads(self) -> None:
        c = self.registered()
        errors = []

        def worker() -> None:
            try:
                for _ in range(20):
                    c.status()
            except Exception as e:  # pragma: no cover
                errors.append(e)

        ts = [threading.Thread(target=worker) for _ in range(3)]
        for t in ts:
            t.start()
        for _ in range(20):
            c.step()
        for t in ts:
            t.join()
        self.assertEqual(errors, [])
        self.assertEqual(c.info.step, 20)

    # ---- lifetime ---------------------------------------------------------------------------

    def test_reattach_resumes(self) -> None:
        c = self.registered()
        for _ in range(3):
            c.step()
        pb = c.param_buffer
        weights = list(pb)
        c.close()
        c.close()  # harmless
        with self.assertRaises(ValueError):
            pb[0]  # released by close()
        with self.assertRaises(ZerodError) as cm:
            c.step()
        self.assertEqual(cm.exception.name, "ZD_ECLOSED")

        c2 = self.connect()
        c2.layout(model(self._testMethodName), [Group(lr=0.1, weight_decay=0.0)])
        pb2 = c2.param_buffer
        for k in range(len(pb2)):
            pb2[k] = 7.0 if k < 300 else 0.0  # overwritten by zerod's master weights
        info = c2.register()
        self.assertTrue(info.resumed)
        self.assertEqual(info.step, 3)
        self.assertEqual(list(pb2), weights)
        self.assertEqual(c2.step().step, 4)

    def test_replace(self) -> None:
        self.registered().close()
        c = self.connect()
        c.layout([("other", (5,))])
        with self.assertRaises(ZerodError) as cm:
            c.register()
        self.assertEqual(cm.exception.name, "ZD_ELAYOUT")
        c.layout([("other", (5,))], replace=True)
        info = c.register()
        self.assertFalse(info.resumed)
        self.assertEqual(info.step, 0)

    def test_context_manager(self) -> None:
        with Client(self.daemon.socket) as c:
            self.assertFalse(c.closed)
        self.assertTrue(c.closed)
        self.assertIn("closed", repr(c))


class LoadingTest(unittest.TestCase):
    def run_py(self, code: str, **env: str) -> subprocess.CompletedProcess:
        e = dict(os.environ, **env)
        return subprocess.run([sys.executable, "-c", code], env=e, capture_output=True,
                              text=True, timeout=60)

    def test_missing_library(self) -> None:
        r = self.run_py("import zerod; zerod.Client('/nonexistent')",
                        ZEROD_LIBRARY="/nonexistent/libzerod.so")
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("LibraryNotFoundError", r.stderr)
        self.assertIn("ZEROD_LIBRARY is '/nonexistent/libzerod.so'", r.stderr)

    def test_core_imports_without_torch(self) -> None:
        code = ("import sys; sys.modules['torch'] = None\n"
                "import zerod, zerod.testing; print(zerod.library_path())")
        r = self.run_py(code)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(r.stdout.strip(), os.environ["ZEROD_LIBRARY"])

    def test_local_zerod_exit_status(self) -> None:
        d = zerod.testing.LocalZerod(["--bucket_elems", "1000"], log_level="info")
        with d.connect() as c:
            self.assertEqual(c.info.bucket_elems, 1000)
        self.assertEqual(d.stop(), 0)
        self.assertFalse(os.path.exists(d.dir), "the directory goes when zerod exits cleanly")
        with self.assertRaises(zerod.testing.ZerodProcessError) as cm:
            zerod.testing.LocalZerod(["--no_such_setting", "1"])
        self.assertIn("no_such_setting", cm.exception.log)


if __name__ == "__main__":
    common.run(ClientTest, LoadingTest)
