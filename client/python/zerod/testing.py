"""Local zerod processes for tests and examples.

`LocalZerod` starts one zerod on a temporary socket (as redis' start_server and memcached's
new_memcached do), waits until it accepts connections, and stops it with SIGTERM, checking that
it exits with status 0. `LocalWorld` starts the daemons of a world of `world_size` ranks on this
machine: one daemon serving every rank (`daemons=1`, `--local_ranks W`), or one daemon per rank
(`daemons=W`, joined through daemon 0's control service).

The zerod binary comes from the `binary` argument, else $ZEROD_BIN, else `zerod` on PATH.
Each daemon gets its own directory under the system's temporary directory with its socket
(zerod.sock), control socket (control.sock) and log (zerod.log); the directory is removed when
the daemon stops cleanly or fails to start (the log then travels in the ZerodProcessError), and
kept, for its log, when a running daemon exits with a non-zero status.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket as _socket
import subprocess
import sys
import tempfile
import time
from typing import List, Optional, Sequence, Tuple

from .client import ANY_RANK, Client

__all__ = ["LocalWorld", "LocalZerod", "ZerodProcessError", "find_zerod"]


class ZerodProcessError(RuntimeError):
    """A local zerod failed to start or did not exit cleanly. `log` holds its log,
    `returncode` its exit status (None while running; negative: killed by that signal)."""

    def __init__(self, message: str, log: str = "", returncode: Optional[int] = None) -> None:
        super().__init__(message)
        self.log = log
        self.returncode = returncode


def find_zerod(binary: Optional[str] = None) -> str:
    """Path of the zerod executable: `binary`, else $ZEROD_BIN, else `zerod` on PATH."""
    path = binary or os.environ.get("ZEROD_BIN") or shutil.which("zerod")
    if not path:
        raise ZerodProcessError("zerod not found: set ZEROD_BIN to the daemon's path (a build "
                                "leaves it at build/daemon/zerod) or put zerod on PATH")
    if not os.access(path, os.X_OK):
        raise ZerodProcessError(f"zerod at {path!r} is not an executable file")
    return path


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    # PR_SET_PDEATHSIG: a test that crashes must not leave daemons behind.
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)
    except Exception:
        pass


class LocalZerod:
    """One zerod process on a temporary socket.

    Args:
        args: extra command-line settings ("--bucket_elems", "256", ...).
        binary: the zerod executable (default: find_zerod()).
        log_level: the daemon's --log_level.
        start: start at once (default) or leave it to start().
        timeout: seconds to wait for the socket to accept connections.
        keep_dir: keep the temporary directory (socket, log) after stopping.

    Use as a context manager: leaving the block stops the daemon with SIGTERM and raises
    ZerodProcessError unless it exits with status 0 (its log is printed to stderr when the block
    is left by an exception).
    """

    def __init__(self, args: Sequence[str] = (), *, binary: Optional[str] = None,
                 log_level: str = "debug", start: bool = True, timeout: float = 10.0,
                 keep_dir: bool = False) -> None:
        self.binary = find_zerod(binary)
        self.args = [str(a) for a in args]
        self.log_level = log_level
        self.timeout = timeout
        self.keep_dir = keep_dir
        self.dir = tempfile.mkdtemp(prefix="zerod-")
        self.socket = os.path.join(self.dir, "zerod.sock")
        self.control_address = "unix:" + os.path.join(self.dir, "control.sock")
        self.log_path = os.path.join(self.dir, "zerod.log")
        self.process: Optional[subprocess.Popen] = None
        self.returncode: Optional[int] = None
        if start:
            self.start()

    @property
    def pid(self) -> Optional[int]:
        return self.process.pid if self.process else None

    def command(self) -> List[str]:
        """The command line the daemon runs with."""
        base = [self.binary, "--socket", self.socket, "--log_level", self.log_level]
        if not any(a.lstrip("-").replace("-", "_").startswith("control_address")
                   for a in self.args):
            base += ["--control_address", self.control_address]
        # This package registers host buffers, which need zerod's CPU backend; on a machine with
        # GPUs, backend auto would pick the CUDA backend (device buffers only).
        if not any(a.lstrip("-").replace("-", "_").startswith("backend") for a in self.args):
            base += ["--backend", "cpu"]
        return base + self.args

    def start(self) -> "LocalZerod":
        """Spawns the daemon and waits until it accepts connections."""
        self.spawn()
        self.wait_ready()
        return self

    def spawn(self) -> None:
        """Spawns the daemon process."""
        if self.process is not None:
            raise RuntimeError("this zerod was started already")
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(self.command(), stdin=subprocess.DEVNULL, stdout=log,
                                            stderr=subprocess.STDOUT,
                                            preexec_fn=_die_with_parent)

    def wait_ready(self) -> None:
        """Waits until the socket accepts connections; raises ZerodProcessError (with the log)
        if the daemon exits first or the timeout passes."""
        assert self.process is not None
        deadline = time.monotonic() + self.timeout
        while True:
            s = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
            try:
                s.connect(self.socket)
                return
            except OSError:
                pass
            finally:
                s.close()
            rc = self.process.poll()
            if rc is not None:
                self.returncode = rc
                err = ZerodProcessError(
                    f"zerod exited during start-up with status {rc}: {self.last_log_line()}",
                    self.log(), rc)
                self._remove_dir()  # the log travels in the exception
                raise err
            if time.monotonic() > deadline:
                self.process.kill()
                self.process.wait()
                self.returncode = self.process.returncode
                err = ZerodProcessError(f"zerod did not accept connections on {self.socket} "
                                        f"within {self.timeout} s", self.log())
                self._remove_dir()
                raise err
            time.sleep(0.01)

    def _remove_dir(self) -> None:
        if not self.keep_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def log(self) -> str:
        """The daemon's log so far."""
        try:
            with open(self.log_path, "r", errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def last_log_line(self) -> str:
        lines = [l for l in self.log().splitlines() if l.strip()]
        return lines[-1] if lines else "(empty log)"

    def connect(self, local_rank: int = ANY_RANK, timeout_ms: int = 0) -> Client:
        """A Client attached to local_rank of this daemon."""
        return Client(self.socket, local_rank, timeout_ms)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0, check: bool = True) -> int:
        """Sends `sig`, waits up to `timeout` s (then SIGKILL) and returns the exit status
        (negative: killed by that signal). With check, raises ZerodProcessError unless the
        status is 0. Removes the directory when the status is 0 (unless keep_dir)."""
        if self.process is None:  # never started
            self._remove_dir()
            return 0
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
                self.returncode = self.process.returncode
                raise ZerodProcessError(f"zerod did not exit within {timeout} s of signal {sig}",
                                        self.log(), self.returncode)
        self.returncode = self.process.returncode
        if self.returncode == 0:
            self._remove_dir()
        elif check:
            raise ZerodProcessError(f"zerod exited with status {self.returncode} (log in "
                                    f"{self.log_path}): {self.last_log_line()}", self.log(),
                                    self.returncode)
        return self.returncode

    def __enter__(self) -> "LocalZerod":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            try:
                self.stop(check=False)
            finally:
                sys.stderr.write(f"---- zerod log {self.log_path} ----\n{self.log()}"
                                 f"---- end of log ----\n")
            return
        self.stop(check=True)


class LocalWorld:
    """The zerod daemons of a world of `world_size` ranks on this machine.

    Args:
        world_size: ranks in the world.
        daemons: 1 (one daemon with --local_ranks world_size) or world_size (one daemon per
            rank, --world_size/--first_rank, joined through daemon 0's control service).
        args: extra settings for every daemon.
        binary, log_level, timeout, keep_dir: as LocalZerod.

    `endpoint(rank)` says where a trainer of that global rank attaches: (socket, local_rank).
    """

    def __init__(self, world_size: int = 1, *, daemons: int = 1, args: Sequence[str] = (),
                 binary: Optional[str] = None, log_level: str = "debug", timeout: float = 30.0,
                 keep_dir: bool = False) -> None:
        if world_size < 1:
            raise ValueError(f"world_size is {world_size}; expected at least 1")
        if daemons not in (1, world_size):
            raise ValueError(f"daemons is {daemons}; expected 1 or world_size ({world_size})")
        self.world_size = world_size
        self.daemons: List[LocalZerod] = []
        self._endpoints: List[Tuple[str, int]] = []
        try:
            if daemons == 1:
                extra = ["--local_ranks", str(world_size)] if world_size > 1 else []
                d = LocalZerod(list(extra) + list(args), binary=binary, log_level=log_level,
                               start=False, timeout=timeout, keep_dir=keep_dir)
                self.daemons.append(d)
                self._endpoints = [(d.socket, r) for r in range(world_size)]
            else:
                first: Optional[LocalZerod] = None
                for r in range(world_size):
                    d = LocalZerod([], binary=binary, log_level=log_level, start=False,
                                   timeout=timeout, keep_dir=keep_dir)
                    first = first or d
                    d.args = ["--world_size", str(world_size), "--first_rank", str(r),
                              "--local_ranks", "1", "--rendezvous_address",
                              first.control_address] + [str(a) for a in args]
                    self.daemons.append(d)
                    self._endpoints.append((d.socket, 0))
            for d in self.daemons:
                d.spawn()
            for d in self.daemons:
                d.wait_ready()
        except BaseException:
            self.stop(check=False)
            raise

    def endpoint(self, rank: int) -> Tuple[str, int]:
        """(socket path, local rank) a trainer of global rank `rank` attaches to."""
        return self._endpoints[rank]

    def connect(self, rank: int, timeout_ms: int = 0) -> Client:
        """A Client attached to global rank `rank`."""
        path, local = self.endpoint(rank)
        return Client(path, local, timeout_ms)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0, check: bool = True) -> List[int]:
        """Stops every daemon (see LocalZerod.stop); raises the first failure when check."""
        codes, first_error = [], None
        for d in self.daemons:
            try:
                codes.append(d.stop(sig, timeout, check))
            except ZerodProcessError as e:
                codes.append(d.returncode if d.returncode is not None else -1)
                first_error = first_error or e
        if first_error is not None:
            raise first_error
        return codes

    def log(self) -> str:
        """Every daemon's log, one after the other."""
        return "".join(f"---- zerod {i} ({d.log_path}) ----\n{d.log()}"
                       for i, d in enumerate(self.daemons))

    def __enter__(self) -> "LocalWorld":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            try:
                self.stop(check=False)
            finally:
                sys.stderr.write(self.log() + "---- end of logs ----\n")
            return
        self.stop(check=True)
