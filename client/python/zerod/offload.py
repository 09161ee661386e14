"""Offload: a model on a GPU trained by a zerod running its CPU backend.

ZeroOptimizer uses this module by itself when its parameters are on a CUDA device and the zerod it
attaches to runs its CPU backend (it says so in one log line): the fp32 master weights and Adam
moments then live in host memory, in zerod, and the GPU holds only the working parameters and
their gradients, as ZeRO-Offload does, with every step bit-identical to torch.optim.AdamW/Adam
stepping a CPU copy of the model with the same gradients (the CPU formula of the running torch,
as for a model on the CPU).

How. The parameters and gradients stay ordinary tensors on the GPU. zerod's two buffers are host
shared memory that libzerod page-locks for CUDA (ZD_MEMORY_HOST_PINNED), so copies between them
and the GPU are asynchronous DMA:
- backward: when the optimizer's hooks find a bucket complete (every gradient of it final), its
  gradients are copied device-to-host into the grad buffer on a side stream (`d2h`) that first
  waits for the stream autograd accumulated them on; an event recorded after the copies is handed
  to a sender thread, which waits on that event (not on the trainer's stream) and then sends the
  bucket's scatter. zerod may read a bucket's gradients from its scatter onwards (zd_scatter), and
  the scatter goes out only once they are in the buffer. Buckets go out in the hooks' order
  (descending, as ZeroOptimizer sends them), so every rank sends the same sequence.
- step(): waits for the sender, steps without gathering, then gathers bucket by bucket in
  ascending order; as each gather returns, that bucket's parameters are copied host-to-device on a
  second side stream (`h2d`), which first waits for the trainer's stream (backward may still read
  the parameters). step() ends by making the trainer's current stream wait for `h2d`: the next
  forward is ordered after the new parameters on the GPU, and the host never waits for the GPU.
- A gradient changed after its bucket was copied (clip_grad_norm_ between backward and step(), a
  second backward without no_sync()) is noticed by its version counter, as ZeroOptimizer notices
  it for its buffer views, and the bucket is copied and scattered again; the earlier requests are
  waited for first, since zerod may still be reading the buffer.
- A parameter whose .grad is None at step() (zero_grad(set_to_none=True) and no backward reached
  it: a head used on some steps only, an expert no token was routed to, a frozen layer) has its
  gradient zeroed in the grad buffer when its bucket is copied, and step() names it absent
  (absent(), zd_step_opts_t.absent), so that zerod skips it as torch's optimizers do (no weight
  decay, moments and its own step count untouched; at world size > 1 only where every rank
  lacks it, a rank's zeros counting where another has one).

The rehearsal. ``ZeroOptimizer(..., offload="rehearsal")`` with a model on the CPU runs this same
machinery (buckets, versions, the sender thread, the step without gather, the gathers bucket by
bucket) with its copies done by plain copy_ and no streams or events: a test switch, so that CPU
CI checks the bookkeeping bit for bit against a real zerod. It proves nothing about the streams and
events of the real path, which runs only with a GPU (tests/python/test_offload_cuda.py).

Memory, per parameter with fp32 params and grads: the GPU holds 8 bytes (the parameter and its
gradient; no optimizer state) where torch's AdamW on the GPU holds 16 (and the two moments); host
memory holds 20 (zerod's master weight and two moments, 12, and the two pinned buffers, 8, which
zerod maps too).
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import TYPE_CHECKING, Any, List, Optional, Tuple

import torch

if TYPE_CHECKING:
    from .client import Request
    from .torch import ZeroOptimizer

__all__ = ["Offload", "decide"]

_log = logging.getLogger("zerod.offload")

_MAX_SENT = 32  # scatters or gathers outstanding at once, below libzerod's 64


def check_arg(offload: Any, cuda_params: bool) -> None:
    """ValueError for an `offload` argument that cannot apply to these parameters."""
    if offload not in (None, True, False, "rehearsal"):
        raise ValueError(f"offload is {offload!r}; expected None (automatic), True, False or "
                         f"'rehearsal'")
    if offload is True and not cuda_params:
        raise ValueError("offload=True needs the parameters on a CUDA device (the CPU rehearsal "
                         "of the offload path, a test switch, is offload='rehearsal')")
    if offload == "rehearsal" and cuda_params:
        raise ValueError("offload='rehearsal' is the CPU rehearsal of the offload path and takes "
                         "parameters on the CPU; CUDA parameters offload with offload=None or "
                         "True")


def decide(offload: Any, cuda_params: bool, backend: str) -> Optional[str]:
    """"cuda" (the real path), "rehearsal" or None (no offload) for parameters on CUDA or not and
    a zerod running `backend`; ValueError where the choice cannot work."""
    if offload == "rehearsal":
        if backend != "cpu":
            raise ValueError(f"offload='rehearsal' needs a zerod running its CPU backend; this "
                             f"one runs {backend}")
        return "rehearsal"
    if not cuda_params or offload is False:
        return None
    if backend == "cpu":
        return "cuda"
    if offload is True:
        raise ValueError(f"offload=True needs a zerod running its CPU backend; this one runs "
                         f"{backend} (its CUDA backend takes the model's device buffers "
                         f"directly: leave offload unset)")
    return None


class Offload:
    """The offload machinery of one ZeroOptimizer (module docstring). Created by the optimizer
    once its client knows zerod's backend; the optimizer calls attach() after registering,
    start_scatter() for each complete bucket, flush() before its step request, after_step() once
    the step is answered, grads_changed()/reset() with its iteration bookkeeping, zero_grad() and
    close()."""

    def __init__(self, opt: "ZeroOptimizer", mode: str) -> None:
        self.opt = opt
        self.cuda = mode == "cuda"
        self.mode = mode
        self.device = opt.device
        if self.cuda:
            if self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
            self.d2h = torch.cuda.Stream(self.device)
            self.h2d = torch.cuda.Stream(self.device)
        self._queue: "queue.Queue[Optional[Tuple[int, Any]]]" = queue.Queue()
        self._sent: List["Request"] = []
        self._error: Optional[BaseException] = None
        self._thread: Optional[threading.Thread] = None
        self._pviews: List[torch.Tensor] = []
        self._gviews: List[torch.Tensor] = []
        self._seen: List[Optional[Tuple[torch.Tensor, int]]] = []
        self._copied: List[bool] = []
        self.copies = 0  # buckets copied and queued for their scatter, over the optimizer's life

    @property
    def memory(self) -> str:
        """The kind of buffers to lay out: pinned for the real path."""
        return "host_pinned" if self.cuda else "host"

    @property
    def device_index(self) -> Optional[int]:
        return self.device.index if self.cuda else None

    def announce(self) -> None:
        info = self.opt.client.info
        if self.cuda:
            _log.warning("zerod: the model is on %s and zerod (rank %d/%d) runs its CPU backend: "
                         "offloading (master weights and Adam state in host memory; gradients "
                         "copied to pinned host buffers per bucket during backward, parameters "
                         "copied back after each step)", self.device, info.rank, info.world_size)
        else:
            _log.info("zerod: offload rehearsal on the CPU (a test switch: plain copies, no "
                      "streams)")

    # ---- lifetime -------------------------------------------------------------------------------

    def attach(self, pviews: List[torch.Tensor], gviews: List[torch.Tensor]) -> None:
        """After registration: the host views of every parameter in the buffers, and the model's
        parameters set from the param buffer (zerod's weights when it resumed a model)."""
        self._pviews, self._gviews = pviews, gviews
        n = len(self.opt._params)
        self._seen = [None] * n
        self._copied = [False] * self.opt._nbuckets
        with torch.no_grad():
            for p, pv in zip(self.opt._params, pviews):
                p.copy_(pv)  # synchronous: the host buffer is read before this returns
        self._thread = threading.Thread(target=self._send_loop, name="zerod-offload-sender",
                                        daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stops the sender (after it sent what it had) and waits for the side streams, so that
        the buffers can be unregistered and unmapped."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None
        for req in self._sent:
            try:
                req.wait()
            except Exception:
                pass
        self._sent = []
        if self.cuda:
            self.d2h.synchronize()
            self.h2d.synchronize()
        self._pviews, self._gviews = [], []  # the buffers are unmapped next

    # ---- backward -------------------------------------------------------------------------------

    def start_scatter(self, bucket: int) -> None:
        """Copies the bucket's gradients into the grad buffer (device-to-host on the d2h stream,
        after the stream current here, the one autograd accumulated them on) and queues its
        scatter for the sender, which sends it once the copies are done."""
        opt = self.opt
        if self._copied[bucket]:
            # Copied before in this iteration: zerod may be reading the buffer (its scatter is
            # out). Everything sent so far is answered before the buffer is written again.
            self.flush(opt._inflight)
            opt._wait_inflight()
        event = None
        if self.cuda:
            current = torch.cuda.current_stream(self.device)
            self.d2h.wait_stream(current)
            with torch.no_grad(), torch.cuda.stream(self.d2h):
                for i in opt._bucket_params[bucket]:
                    self._copy_grad(i, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.d2h)
        else:
            with torch.no_grad():
                for i in opt._bucket_params[bucket]:
                    self._copy_grad(i, non_blocking=False)
        self._copied[bucket] = True
        self.copies += 1
        self._queue.put((bucket, event))

    def _copy_grad(self, i: int, non_blocking: bool) -> None:
        p, gv = self.opt._params[i], self._gviews[i]
        g = p.grad
        if g is None:  # no gradient: zeros, and step() names it absent (absent())
            gv.zero_()
            self._seen[i] = None
            return
        # A dtype conversion runs on the device first (torch would convert through an unpinned
        # host temporary, a synchronous copy); the temporary is made on this (the copy's) stream.
        src = g if g.dtype == gv.dtype else g.to(gv.dtype)
        gv.copy_(src, non_blocking=non_blocking)
        if non_blocking:
            g.record_stream(self.d2h)  # its memory is not reused before the copy ran
        self._seen[i] = (g, g._version)

    def _send_loop(self) -> None:
        client = self.opt.client
        if self.cuda:  # this thread's CUDA calls (the event waits) on the model's GPU, no other
            torch.cuda.set_device(self.device)
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                bucket, event = item
                if event is not None:
                    event.synchronize()  # the copies of this bucket only (releases the GIL)
                if self._error is None:
                    while len(self._sent) >= _MAX_SENT:
                        self._sent.pop(0).wait()
                    self._sent.append(client.scatter_start(bucket))
            except BaseException as e:  # reported by flush(); later buckets are not sent
                self._error = self._error or e
            finally:
                self._queue.task_done()

    def flush(self, into: List["Request"]) -> None:
        """Waits until the sender has sent every queued scatter and moves their requests to
        `into` (the optimizer's in-flight list); raises the sender's first error."""
        self._queue.join()
        into.extend(self._sent)
        self._sent = []
        error, self._error = self._error, None
        if error is not None:
            raise error

    def settle(self, into: List["Request"]) -> None:
        """After a failed step attempt: as flush(), keeping no error (the attempt's own is
        raised), so that nothing queued is sent into the next attempt."""
        try:
            self.flush(into)
        except Exception:
            pass

    def grads_changed(self) -> bool:
        """Whether a gradient copied in this iteration changed since (another tensor, or its
        version counter moved: an in-place write)."""
        params = self.opt._params
        for b, copied in enumerate(self._copied):
            if not copied:
                continue
            for i in self.opt._bucket_params[b]:
                seen, g = self._seen[i], params[i].grad
                if seen is None:
                    if g is not None:
                        return True
                elif g is not seen[0] or g._version != seen[1]:
                    return True
        return False

    def absent(self) -> List[int]:
        """The parameters without a gradient this step (torch's `p.grad is None`, on the model's
        device): what step() sends as absent. Their buffer views are zeroed by the bucket's copy
        (_copy_grad), which a bucket gets at the latest from step() itself, since its hooks never
        complete it, or again where a copied gradient was set to None since (grads_changed)."""
        return [i for i, p in enumerate(self.opt._params) if p.grad is None]

    def reset(self) -> None:
        self._copied = [False] * len(self._copied)
        self._seen = [None] * len(self._seen)

    def zero_grad(self, set_to_none: bool) -> None:
        with torch.no_grad():
            for p in self.opt._params:
                if set_to_none:
                    p.grad = None
                elif p.grad is not None:
                    p.grad.zero_()

    # ---- step -----------------------------------------------------------------------------------

    def after_step(self) -> None:
        """After the step (sent without its gather): gathers every bucket, in ascending order on
        every rank, and copies each bucket's parameters to the model as its gather returns; the
        trainer's current stream then waits for those copies (no host synchronisation)."""
        opt = self.opt
        nb = opt._nbuckets
        if self.cuda:
            current = torch.cuda.current_stream(self.device)
            self.h2d.wait_stream(current)  # backward's last reads of the parameters come first
        pending: List[Tuple[int, "Request"]] = []
        first: Optional[BaseException] = None
        b = 0
        while b < nb or pending:
            while b < nb and len(pending) < _MAX_SENT:
                pending.append((b, opt.client.gather_start(b)))
                b += 1
            bucket, req = pending.pop(0)
            try:
                req.wait()
            except Exception as e:  # wait for every gather once, then raise the first error
                first = first or e
                continue
            if first is None:
                self._copy_params(bucket)
        if self.cuda:
            current.wait_stream(self.h2d)
        if first is not None:
            raise first

    def _copy_params(self, bucket: int) -> None:
        opt = self.opt
        with torch.no_grad():
            if self.cuda:
                with torch.cuda.stream(self.h2d):
                    for i in opt._bucket_params[bucket]:
                        opt._params[i].copy_(self._pviews[i], non_blocking=True)
            else:
                for i in opt._bucket_params[bucket]:
                    opt._params[i].copy_(self._pviews[i])
