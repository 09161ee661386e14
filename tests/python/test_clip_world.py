"""Clipping at world size > 1 bit for bit as torch.nn.utils.clip_grad_norm_ on the averaged gradient.

W trainers (threads of this process) on one zerod of W local ranks, or on W zerods of one rank
each (Gloo between them), step ZeroOptimizers with max_grad_norm set and every gradient handed in
by the test: rank r's gradients differ from every other rank's. The reference is one copy of the
parameters whose gradient is the ranks' sum (fp32, rank order) times 1/W, as DDP averages it
(each rank's gradient / W, summed: the same bits where W is a power of two), then
clip_grad_norm_ and torch's AdamW. Every rank's parameters must equal the reference's bit for bit
after every step, and zerod's reported total norm and clip coefficient must equal torch's, with
a max_norm that clips every step and one that never does, with overlap_update on and off.

The buckets are small (--bucket_elems) and the parameters of odd sizes, so that parameters are
split across the ranks' slices: the test computes zerod's layout (common/layout.c's rules) and
checks that some parameter is split between two ranks, that at W=4 one spans more than two
(a chain of several rounds), and that one is split exactly where its 8 lanes end (the next rank
holds only its tail). At W=4 the gradients are multiples of 2^-12 below 2^-2, so that the ranks'
sum is exact in any order. Forcing zerod's double norm instead must differ from torch's on some
step (the comparison can fail), and ranks that clip by different norms fail the step together.
"""

from __future__ import annotations

import threading
import unittest
from typing import Any, Dict, List, Tuple

import common

torch = common.require_torch()

import zerod.testing  # noqa: E402
from zerod.torch import ZeroOptimizer, _clip_norm_for_torch  # noqa: E402

ALIGN = 64  # common/layout.h ZD__ALIGN
BUCKET = 300
# numel of each parameter: 1 and 3 (a tail alone), 64 * 2 + 3 (lanes end on a 64 boundary),
# sizes that fill a bucket's slices, and one that spans most of a bucket.
SHAPES: List[Tuple[int, ...]] = [(3,), (1,), (13, 17), (64 * 2 + 3,), (7, 11), (1000,), (5,),
                                 (64 * 3 + 3,), (129,), (33, 9), (1,), (64 * 4 + 5,)]
STEPS = 6


def layout(world: int) -> List[Tuple[int, int, int, int]]:
    """(first rank, last rank, offset within its bucket, slice size) of every parameter, as
    zerod's layout places them (common/layout.c: parameters at multiples of ALIGN, a bucket closes
    once it holds BUCKET elements, padded to ALIGN * world and cut into world equal slices)."""
    out: List[Tuple[int, int, int, int]] = []
    starts: List[Tuple[int, int]] = []
    used = 0
    numels = [int(torch.Size(s).numel()) for s in SHAPES]
    for i, n in enumerate(numels):
        start = -(-used // ALIGN) * ALIGN
        starts.append((start, n))
        used = start + n
        if used >= BUCKET or i + 1 == len(numels):
            se = -(-max(used, 1) // (ALIGN * world)) * (ALIGN * world) // world
            out += [(st // se, (st + m - 1) // se, st, se) for st, m in starts]
            starts, used = [], 0
    return out


def split_at_lanes_end(world: int) -> bool:
    """Some parameter is split where its lanes end: the next rank holds its tail alone."""
    for (fr, lr, start, se), shape in zip(layout(world), SHAPES):
        n = int(torch.Size(shape).numel())
        if n % 8 and any(k * se - start == n - n % 8 for k in range(fr + 1, lr + 1)):
            return True
    return False


def gradients(world: int, steps: int) -> List[List[List[Any]]]:
    """grads[step][rank][param]: random, different on every rank; at W > 2 multiples of 2^-12
    below 2^-2 (their sum is exact in any order)."""
    g = torch.Generator().manual_seed(world)
    out = []
    for _ in range(steps):
        per_rank = []
        for _ in range(world):
            if world <= 2:
                per_rank.append([torch.randn(s, generator=g) * 0.3 for s in SHAPES])
            else:
                per_rank.append([torch.randint(-1024, 1024, s, generator=g).float() * 2.0 ** -12
                                 for s in SHAPES])
        out.append(per_rank)
    return out


def initial() -> List[Any]:
    g = torch.Generator().manual_seed(7)
    return [torch.randn(s, generator=g) for s in SHAPES]


HP = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05)


def reference(world: int, grads: List[List[List[Any]]], max_norm: float,
              mean: bool = True) -> List[Dict[str, Any]]:
    """The parameters after every step, torch's total and coefficient of every step."""
    params = [torch.nn.Parameter(t.clone()) for t in initial()]
    opt = torch.optim.AdamW(params, **HP)
    out = []
    for per_rank in grads:
        for i, p in enumerate(params):
            s = per_rank[0][i].clone()
            for r in range(1, world):
                s = s + per_rank[r][i]
            p.grad = s * (1.0 / world) if mean else s
        total = torch.nn.utils.clip_grad_norm_(params, max_norm)
        coef = float(torch.clamp(max_norm / (total + 1e-6), max=1.0))
        opt.step()
        out.append({"params": [p.detach().clone() for p in params], "total": float(total),
                    "coef": coef})
    return out


def zerod_run(world: int, daemons: int, grads: List[List[List[Any]]], max_norm: float,
              overlap: bool, clip_norm: Any, mean: bool = True) -> List[List[Dict[str, Any]]]:
    """Every rank's parameters, norm and coefficient after every step. clip_norm: one for every
    rank, or a list of each rank's."""
    results: List[List[Dict[str, Any]]] = [[] for _ in range(world)]
    errors: List[BaseException] = []
    with zerod.testing.LocalWorld(world, daemons=daemons,
                                  args=["--bucket_elems", str(BUCKET)], log_level="info") as w:
        def run(r: int) -> None:
            try:
                params = [torch.nn.Parameter(t.clone()) for t in initial()]
                sock, local = w.endpoint(r)
                opt = ZeroOptimizer(params, socket=sock, local_rank=local, overlap=overlap,
                                    max_grad_norm=max_norm, grad_mean=mean, **HP)
                opt._clip_norm = clip_norm[r] if isinstance(clip_norm, list) else clip_norm
                try:
                    for per_rank in grads:
                        for p, g in zip(params, per_rank[r]):
                            p.grad = g.clone()
                        opt.step()
                        res = opt.last_result
                        results[r].append({"params": [p.detach().clone() for p in params],
                                           "total": res.grad_norm, "coef": res.clip_coef})
                finally:
                    opt.close()
            except BaseException as e:  # reported by the main thread
                errors.append(e)

        threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=240)
            if t.is_alive():
                raise AssertionError(f"a trainer hung: {w.log()[-3000:]}")
    if errors:
        raise errors[0]
    return results


def differences(want: List[Dict[str, Any]], got: List[List[Dict[str, Any]]]) -> List[str]:
    out = []
    for r, steps in enumerate(got):
        for k, (g, x) in enumerate(zip(steps, want)):
            if (g["total"], g["coef"]) != (x["total"], x["coef"]):
                out.append(f"rank {r} step {k + 1}: norm {g['total']!r} coef {g['coef']!r}, "
                           f"torch's {x['total']!r} and {x['coef']!r}")
            for i, (a, b) in enumerate(zip(g["params"], x["params"])):
                if not torch.equal(a, b):
                    out.append(f"rank {r} step {k + 1} parameter {i} {tuple(a.shape)}: max |diff| "
                               f"{float((a - b).abs().max()):.3g}")
    return out


class ClipWorldTest(unittest.TestCase):
    def setUp(self) -> None:
        self.order = _clip_norm_for_torch()
        if self.order == "double":
            self.skipTest(f"torch {torch.__version__}: zerod has no model of its norm's order")

    def test_layout_splits_parameters(self) -> None:
        for world in (2, 4):
            spans = [lr - fr for fr, lr, _, _ in layout(world)]
            self.assertGreater(sum(s > 0 for s in spans), 2, f"W={world}: too few split")
        self.assertGreaterEqual(max(lr - fr for fr, lr, _, _ in layout(4)), 2, "no chain of 3 ranks")
        self.assertTrue(any(split_at_lanes_end(w) for w in (2, 4)), "no split at a lanes' end")

    def check(self, world: int, daemons: int, overlap: bool, mean: bool = True) -> None:
        grads = gradients(world, STEPS)
        want_free = reference(world, grads, 1e4, mean)
        typical = min(x["total"] for x in want_free)
        for max_norm in (0.3 * typical, 1e4):  # clips every step; never clips
            want = want_free if max_norm == 1e4 else reference(world, grads, max_norm, mean)
            clipped = sum(x["coef"] < 1.0 for x in want)
            self.assertEqual(clipped, STEPS if max_norm < 1e4 else 0)
            got = zerod_run(world, daemons, grads, max_norm, overlap, self.order, mean)
            diffs = differences(want, got)
            print(f"\n    W={world} daemons={daemons} overlap={overlap} mean={mean} "
                  f"max_norm {max_norm:.4g} "
                  f"({clipped} of {STEPS} steps clipped), {self.order}: "
                  f"{len(diffs)} differences", flush=True)
            self.assertEqual(diffs, [], f"W={world} max_norm {max_norm}")

    def test_w2_local_ranks(self) -> None:
        self.check(2, 1, overlap=True)

    def test_w2_two_daemons(self) -> None:
        self.check(2, 2, overlap=False)

    def test_w2_summed(self) -> None:
        # grad_mean=False: the norm of the ranks' sum itself (no scaling of the elements)
        self.check(2, 1, overlap=True, mean=False)

    def test_w4_chains(self) -> None:
        self.check(4, 1, overlap=True)

    def test_ranks_disagree_on_the_order(self) -> None:
        # the torch order is in the step records' hash: ranks that clip by different norms fail
        # the step together at the commit point (nothing applied), never enter the norm's
        # collective apart
        grads = gradients(2, 1)
        with self.assertRaises(zerod.ZerodError) as cm:
            zerod_run(2, 1, grads, 0.1, False, [self.order, "double"])
        self.assertEqual(cm.exception.name, "ZD_EHPARAM", str(cm.exception))

    def test_double_norm_differs(self) -> None:
        # the comparison can fail: zerod's double norm over the shards is not torch's fp32 total
        grads = gradients(2, STEPS)
        want = reference(2, grads, 1e4)
        got = zerod_run(2, 1, grads, 1e4, True, "double")
        self.assertNotEqual([d for d in differences(want, got) if "norm" in d], [],
                            "the double norm equalled torch's on every step")


if __name__ == "__main__":
    common.run(ClipWorldTest)
