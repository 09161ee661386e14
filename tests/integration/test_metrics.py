"""Integration test of zerod's Prometheus endpoint (daemon/control/metrics.c), suite `integration`.

Starts a real zerod of two local ranks with metrics_address 127.0.0.1:0 (the bound port is read
from its log), runs a known number of steps on both ranks through libzerod (the zerod Python
package), and scrapes http://.../metrics with urllib:
  - the exposition passes `promtool check metrics` (Prometheus' own parser and linter; that case
    is skipped, exit 77, where promtool is not installed: see README, "Operations"),
  - the values are those of the run: ranks, steps, state bytes, clients, health, and the same as
    zerod's status for the numbers a test cannot predict (shard sizes, request counts),
  - every metric name the Grafana dashboard (deploy/grafana/zerod.json) queries is in the scrape,
  - the HTTP edges: 404 elsewhere than /metrics, 405 for POST, HEAD, and a port in use refused at
    start with a message naming metrics_address.
Run by `meson test` with ZEROD_BIN, ZEROD_LIBRARY and PYTHONPATH set; by hand from the
repository root after a build, it finds ./build itself.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import tempfile
import sys
import threading
import time
import unittest
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Tuple

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "tests", "python"))
import common  # noqa: E402  (paths to the package and the build when run by hand)

import zerod  # noqa: E402
import zerod.testing  # noqa: E402

STEPS = 5
RANKS = 2
DASHBOARD = os.path.join(ROOT, "deploy", "grafana", "zerod.json")

Sample = Tuple[str, Dict[str, str], str]  # name, labels, value text


def parse_exposition(text: str) -> Tuple[Dict[str, str], List[Sample]]:
    """The families ({name: type}) and samples of a text exposition. Strict about what zerod
    writes (promtool checks the format in general): every sample belongs to the family whose
    TYPE came last."""
    types: Dict[str, str] = {}
    samples: List[Sample] = []
    current = None
    label = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            assert name not in types, f"family {name} has two TYPE lines"
            types[name] = kind
            current = name
            continue
        if line.startswith("#") or not line:
            continue
        m = re.fullmatch(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)", line)
        assert m, f"not a sample line: {line!r}"
        name, labels, value = m.group(1), m.group(2) or "", m.group(3)
        family = name
        if types.get(current) == "histogram" and name in (current + "_bucket", current + "_sum",
                                                           current + "_count"):
            family = current
        assert family == current, f"sample {name} outside its family block ({current})"
        samples.append((name, dict(label.findall(labels)), value))
    return types, samples


def values(samples: List[Sample], name: str, **labels: str) -> List[float]:
    return [float(v) for n, ls, v in samples
            if n == name and all(ls.get(k) == x for k, x in labels.items())]


def one(samples: List[Sample], name: str, **labels: str) -> float:
    vs = values(samples, name, **labels)
    if len(vs) != 1:
        raise AssertionError(f"{name}{labels}: {len(vs)} samples, expected 1")
    return vs[0]


class MetricsTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls) -> None:
        cls.checkpoints = tempfile.mkdtemp(prefix="zerod-metrics-")
        cls.daemon = zerod.testing.LocalZerod(
            ["--local_ranks", str(RANKS), "--bucket_elems", "256", "--metrics_address",
             "127.0.0.1:0", "--checkpoint_dir", cls.checkpoints, "--checkpoint_every_steps",
             "2"], log_level="info")
        m = re.search(r"metrics on http://(127\.0\.0\.1:\d+)/metrics", cls.daemon.log())
        if not m:
            cls.daemon.stop()
            raise AssertionError(f"zerod did not log its metrics address:\n{cls.daemon.log()}")
        cls.address = m.group(1)
        cls.url = f"http://{cls.address}/metrics"
        cls.clients = [zerod.Client(cls.daemon.socket, local_rank=r) for r in range(RANKS)]
        cls.results = cls.train()

    @classmethod
    def tearDownClass(cls) -> None:
        for c in cls.clients:
            c.close()
        assert cls.daemon.stop() == 0
        shutil.rmtree(cls.checkpoints, ignore_errors=True)

    @classmethod
    def train(cls) -> List[zerod.StepResult]:
        """STEPS steps of a two-parameter model on both ranks (each rank in its own thread: a
        step is collective); returns rank 0's results."""
        params = [("w", (30, 40)), ("b", (40,))]

        def run(c: zerod.Client) -> List[zerod.StepResult]:
            c.layout(params, [zerod.Group(lr=0.01)], max_grad_norm=10.0, replace=True)
            for p in c.params_info():
                for k in range(p.numel):
                    c.param_buffer[p.offset + k] = 0.5
            c.register()
            out = []
            for s in range(STEPS):
                g = c.grad_buffer
                for p in c.params_info():
                    for k in range(p.numel):
                        g[p.offset + k] = 0.01 * (s + 1)
                out.append(c.step())
            return out

        with ThreadPoolExecutor(RANKS) as pool:
            results = list(pool.map(run, cls.clients))
        return results[0]

    def scrape(self) -> Tuple[Dict[str, str], List[Sample], str]:
        with urllib.request.urlopen(self.url, timeout=10) as r:
            self.assertEqual(r.status, 200)
            self.assertEqual(r.headers["Content-Type"], "text/plain; version=0.0.4; charset=utf-8")
            text = r.read().decode()
        types, samples = parse_exposition(text)
        return types, samples, text

    def test_promtool(self) -> None:
        promtool = shutil.which("promtool")
        if not promtool:
            self.skipTest("promtool is not installed (Debian: the prometheus package's "
                          "/usr/bin/promtool; see README, Operations)")
        _, _, text = self.scrape()
        r = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True,
                           text=True, timeout=60)
        self.assertEqual((r.returncode, r.stdout + r.stderr), (0, ""),
                         f"promtool check metrics on:\n{text}")

    def test_values_of_the_run(self) -> None:
        types, s, _ = self.scrape()
        status = self.clients[0].status_dict()
        self.assertEqual(one(s, "zerod_world_size"), RANKS)
        self.assertEqual(one(s, "zerod_local_ranks"), RANKS)
        self.assertEqual(one(s, "zerod_clients_connected"), RANKS)
        self.assertEqual(len(values(s, "zerod_rank_healthy")), RANKS)
        self.assertEqual(one(s, "zerod_info", backend="cpu", version=status["server"]["version"]),
                         1)
        self.assertEqual(types["zerod_requests_total"], "counter")
        # The status request above came after the scrape: the status counts itself.
        self.assertEqual(one(s, "zerod_requests_total") + 1,
                         int(status["server"]["requests_total"]))
        self.assertEqual(one(s, "zerod_request_errors_total"), 0)
        for r in range(RANKS):
            rank = {"rank": str(r), "local_rank": str(r)}
            st = status[f"rank {r}"]
            self.assertEqual(one(s, "zerod_rank_healthy", **rank), 1)
            self.assertEqual(one(s, "zerod_rank_degraded", **rank, reason=""), 0)
            self.assertEqual(one(s, "zerod_rank_client_attached", **rank), 1)
            self.assertEqual(one(s, "zerod_rank_model_registered", **rank), 1)
            self.assertEqual(one(s, "zerod_rank_params", **rank), 2)
            # the model's elements with the layout's padding (parameters and buckets aligned)
            self.assertEqual(one(s, "zerod_rank_model_elements", **rank), int(st["total_elems"]))
            self.assertGreaterEqual(int(st["total_elems"]), 30 * 40 + 40)
            self.assertEqual(one(s, "zerod_rank_step", **rank), STEPS)
            self.assertEqual(one(s, "zerod_rank_steps_skipped_total", **rank), 0)
            self.assertEqual(one(s, "zerod_rank_loss_scale", **rank), 1)
            shard = int(st["shard_elems"])
            self.assertGreaterEqual(shard * RANKS, 30 * 40 + 40)
            self.assertEqual(one(s, "zerod_rank_shard_elements", **rank), shard)
            # fp32 master weights, exp_avg and exp_avg_sq of the shard; the reduced gradients
            self.assertEqual(one(s, "zerod_rank_state_bytes", **rank, kind="master_and_moments"),
                             3 * 4 * shard)
            self.assertEqual(one(s, "zerod_rank_state_bytes", **rank, kind="grad_shard"),
                             int(st["grad_shard_bytes"]))
            # no amsgrad: no max_exp_avg_sq
            self.assertEqual(one(s, "zerod_rank_state_bytes", **rank, kind="max_exp_avg_sq"), 0)
            self.assertEqual(one(s, "zerod_rank_scatters_total", **rank), int(st["scatters"]))
            self.assertEqual(one(s, "zerod_rank_gathers_total", **rank), int(st["gathers"]))
            self.assertGreater(one(s, "zerod_rank_last_step_duration_seconds", **rank), 0)
            self.assertEqual(one(s, "zerod_rank_last_step_duration_seconds", **rank),
                             int(st["last_step_us"]) / 1e6)
            self.assertGreater(one(s, "zerod_rank_mean_step_duration_seconds", **rank), 0)
        # The norm of the last step, as the client got it (the status keeps 6 digits).
        self.assertAlmostEqual(one(s, "zerod_rank_grad_norm", rank="0"),
                               self.results[-1].grad_norm, delta=1e-5 * self.results[-1].grad_norm)
        self.assertGreater(self.results[-1].grad_norm, 0)

    def test_histogram_and_phases(self) -> None:
        _, s, _ = self.scrape()
        for r in range(RANKS):
            rank = {"rank": str(r), "local_rank": str(r)}
            buckets = [(float(ls["le"]), float(v)) for n, ls, v in s
                       if n == "zerod_rank_step_duration_seconds_bucket" and ls["rank"] == str(r)]
            self.assertGreaterEqual(len(buckets), 10)
            self.assertEqual(buckets[-1], (float("inf"), STEPS))  # every step counted once
            counts = [c for _, c in buckets]
            self.assertEqual(counts, sorted(counts), "buckets are cumulative")
            self.assertEqual(one(s, "zerod_rank_step_duration_seconds_count", **rank), STEPS)
            self.assertGreater(one(s, "zerod_rank_step_duration_seconds_sum", **rank), 0)
            # every step scattered and gathered both buckets through Gloo: bytes given to the
            # collectives = STEPS * (grad + param buffer bytes, padding included)
            st = self.clients[0].status_dict()[f"rank {r}"]
            total = int(st["total_elems"])
            self.assertEqual(one(s, "zerod_rank_collective_bytes_total", **rank),
                             STEPS * 2 * 4 * total + 4 * total)  # + the register's gather
            for phase in ("scatter", "update", "gather"):
                self.assertGreater(one(s, "zerod_rank_phase_seconds_total", phase=phase, **rank), 0)
            self.assertGreater(one(s, "zerod_rank_collective_seconds_total", **rank), 0)

    def test_checkpoint_values(self) -> None:
        # every 2nd step; the last one may still be being written when the scrape comes
        want = STEPS // 2 * 2
        deadline = time.monotonic() + 30
        while not os.path.exists(os.path.join(self.checkpoints, f"step-{want:012d}",
                                              "manifest.json")):
            self.assertLess(time.monotonic(), deadline, "the last checkpoint never completed")
            time.sleep(0.05)
        time.sleep(0.1)  # the finisher updates its counters right after the manifest
        _, s, _ = self.scrape()
        self.assertEqual(one(s, "zerod_checkpoints_total"), STEPS // 2)
        self.assertEqual(one(s, "zerod_checkpoint_failures_total"), 0)
        self.assertEqual(one(s, "zerod_checkpoint_last_step"), want)
        self.assertGreater(one(s, "zerod_checkpoint_bytes"), 2 * 3 * 4 * (30 * 40 + 40) // RANKS)
        self.assertGreaterEqual(one(s, "zerod_checkpoint_age_seconds"), 0)
        self.assertGreaterEqual(one(s, "zerod_checkpoint_snapshot_seconds"), 0)  # present

    def test_connected_not_attached(self) -> None:
        # Both ranks are taken: a client naming one connects, but is not attached until it
        # registers.
        c = zerod.Client(self.daemon.socket, local_rank=0)
        try:
            _, s, _ = self.scrape()
            self.assertEqual(one(s, "zerod_clients_connected"), RANKS + 1)
        finally:
            c.close()

    def test_dashboard_names_exist(self) -> None:
        with open(DASHBOARD) as f:
            dash = json.load(f)
        exprs: List[str] = []

        def walk(node: object) -> None:
            if isinstance(node, dict):
                for k, v in node.items():
                    if k in ("expr", "query", "definition") and isinstance(v, str):
                        exprs.append(v)
                    elif isinstance(v, dict) and k == "query" and isinstance(v.get("query"), str):
                        exprs.append(v["query"])
                    walk(v)
            elif isinstance(node, list):
                for v in node:
                    walk(v)

        walk(dash)
        self.assertGreater(len(exprs), 5, "the dashboard has no queries?")
        names = set()
        for e in exprs:
            names.update(re.findall(r"\bzerod_[a-z0-9_]+", e))
        types, _, _ = self.scrape()
        missing = sorted(n for n in names if n not in types)
        self.assertEqual(missing, [], f"dashboard queries metrics zerod does not export; "
                                      f"exported: {sorted(types)}")

    def test_http_edges(self) -> None:
        base = f"http://{self.address}"
        with self.assertRaises(urllib.error.HTTPError) as cm:
            urllib.request.urlopen(base + "/", timeout=10)
        self.assertEqual(cm.exception.code, 404)
        with self.assertRaises(urllib.error.HTTPError) as cm:
            urllib.request.urlopen(base + "/metrics", data=b"x=1", timeout=10)
        self.assertEqual(cm.exception.code, 405)
        self.assertEqual(cm.exception.headers["Allow"], "GET, HEAD")
        req = urllib.request.Request(self.url, method="HEAD")
        with urllib.request.urlopen(req, timeout=10) as r:
            self.assertEqual(r.status, 200)
            self.assertEqual(r.read(), b"")
        # Scrapes from several threads at once are all answered.
        errors: List[BaseException] = []

        def scrape_some() -> None:
            try:
                for _ in range(5):
                    self.scrape()
            except BaseException as e:  # noqa: B036 - reported below
                errors.append(e)

        threads = [threading.Thread(target=scrape_some) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        self.assertEqual(errors, [])

    def test_port_in_use(self) -> None:
        with self.assertRaises(zerod.testing.ZerodProcessError) as cm:
            zerod.testing.LocalZerod(["--metrics_address", self.address], log_level="info")
        self.assertIn(f"metrics_address '{self.address}'", cm.exception.log)
        self.assertIn("Address already in use", cm.exception.log)


if __name__ == "__main__":
    common.run(MetricsTest)
