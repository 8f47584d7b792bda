"""The floors a host-side call is measured against (``perf/bench_host``): what the
machine's own primitives cost with no package software around them.

- :class:`ConditionPingPong`: one ``threading.Condition`` round trip between two threads (two
  thread hand-offs, the least any in-process request and reply can cost); with ``nbytes`` each
  side also copies that many bytes (the loopback engine's slot copies);
- :class:`SocketPairEcho`: a 1-byte round trip over a ``socket.socketpair`` to a child process
  (the kernel's own loopback IPC);
- :class:`GlooEcho`: a bare ``torch.distributed`` gloo send/recv round trip to a child process,
  its receive always posted (the best gloo does): 1 byte each way, or ``n`` bytes out and ``m``
  back (the payload floor, whose slope over bytes is the floor's bandwidth).

The child processes run ``python -m mqnc.measure.floors gloo|socket ...`` and end when their
parent closes them.
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import subprocess
import sys
import threading

import torch

__all__ = ["ConditionPingPong", "SocketPairEcho", "GlooEcho"]


class ConditionPingPong:
    """A partner thread answering each request through one ``threading.Condition``.

    Parameters
    ----------
    nbytes, reply_bytes : int
        Bytes the request and the answer copy (0: none), as a loopback put copies a message
        into a slot.
    """

    def __init__(self, nbytes: int = 0, reply_bytes: int = 0) -> None:
        self._cond = threading.Condition()
        self._state = 0  # 0 idle, 1 asked, 2 answered, 3 stop
        self._out = [torch.zeros(max(nbytes, 1), dtype=torch.uint8) for _ in range(2)]
        self._back = [torch.zeros(max(reply_bytes, 1), dtype=torch.uint8) for _ in range(2)]
        self._nbytes, self._reply_bytes = nbytes, reply_bytes
        self._thread = threading.Thread(target=self._serve, daemon=True, name="floor-cond")
        self._thread.start()

    def _serve(self) -> None:
        with self._cond:
            while True:
                while self._state not in (1, 3):
                    self._cond.wait()
                if self._state == 3:
                    return
                if self._reply_bytes:
                    self._back[1].copy_(self._back[0])
                self._state = 2
                self._cond.notify()

    def round_trip(self) -> None:
        """Hand a request to the partner and wait for its answer."""
        with self._cond:
            if self._nbytes:
                self._out[1].copy_(self._out[0])
            self._state = 1
            self._cond.notify()
            while self._state != 2:
                self._cond.wait()
            self._state = 0

    def close(self) -> None:
        with self._cond:
            self._state = 3
            self._cond.notify()
        self._thread.join(10)


class SocketPairEcho:
    """A child process echoing 1-byte messages over a ``socket.socketpair``."""

    def __init__(self) -> None:
        self._sock, child = socket.socketpair()
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "mqnc.measure.floors", "socket", f"--fd={child.fileno()}"],
            pass_fds=(child.fileno(),),
        )
        child.close()
        self.round_trip()  # the child is up

    def round_trip(self) -> None:
        """One byte there, one byte back."""
        self._sock.sendall(b"x")
        if not self._sock.recv(1):
            raise RuntimeError("socketpair floor: the echo process closed the socket")

    def close(self) -> None:
        self._sock.close()
        try:
            self._proc.wait(10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(10)


class GlooEcho:
    """A child process answering bare gloo messages (rank 1 of a 2-rank ``ProcessGroupGloo``).

    A message's byte 0 says what to answer: 0 one byte, 1 the number of bytes in its bytes
    8..16 (little-endian int64), 2 stop. The child keeps one receive posted; this side posts
    the reply's receive before it sends (the tightest round trip gloo allows).

    Parameters
    ----------
    max_bytes : int
        The largest message either way.
    timeout_s : float
        The process group's timeout (start-up included).
    """

    def __init__(self, max_bytes: int, timeout_s: float = 120.0) -> None:
        import torch.distributed as dist

        self.max_bytes = max(int(max_bytes), 16)
        store = dist.TCPStore(
            "127.0.0.1",
            0,
            2,
            is_master=True,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        env = dict(os.environ, GLOO_SOCKET_IFNAME="lo")
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "mqnc.measure.floors", "gloo", f"--port={store.port}",
             f"--max-bytes={self.max_bytes}", f"--timeout={timeout_s}"],
            env=env,
        )  # fmt: skip
        self._store = store
        self._pg = dist.ProcessGroupGloo(store, 0, 2, datetime.timedelta(seconds=timeout_s))
        self._one = torch.zeros(1, dtype=torch.uint8)
        self._back = torch.empty(self.max_bytes, dtype=torch.uint8)
        self._msgs: dict[tuple[int, int], torch.Tensor] = {}
        self.round_trip()

    def message(self, nbytes: int, reply_bytes: int) -> tuple[torch.Tensor, int]:
        """A message of ``nbytes`` asking for ``reply_bytes`` back (cached per size pair)."""
        key = (int(nbytes), int(reply_bytes))
        if key not in self._msgs:
            if max(key) > self.max_bytes or nbytes < 16:
                raise ValueError(f"nbytes: expected 16 <= n <= {self.max_bytes}, got {key}")
            msg = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
            msg[0] = 1
            msg[8:16] = torch.tensor([reply_bytes], dtype=torch.int64).view(torch.uint8)
            self._msgs[key] = msg
        return self._msgs[key], key[1]

    def round_trip(self, msg: torch.Tensor | None = None, reply_bytes: int = 1) -> None:
        """Send ``msg`` (default: one zero byte) and wait for the ``reply_bytes`` answer."""
        back = self._back[:reply_bytes]
        r = self._pg.recv([back], 1, 1)
        self._pg.send([self._one if msg is None else msg], 1, 0).wait()
        r.wait()

    def close(self) -> None:
        stop = torch.full((16,), 2, dtype=torch.uint8)
        try:
            self._pg.send([stop], 1, 0).wait()
            self._proc.wait(30)
        except Exception:
            self._proc.kill()
            self._proc.wait(10)


def _gloo_child(port: int, max_bytes: int, timeout_s: float) -> int:
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.TCPStore(
        "127.0.0.1", port, 2, is_master=False, timeout=datetime.timedelta(seconds=timeout_s)
    )
    pg = dist.ProcessGroupGloo(store, 1, 2, datetime.timedelta(seconds=timeout_s))
    bufs = [torch.zeros(max_bytes, dtype=torch.uint8) for _ in range(2)]
    reply = torch.zeros(max_bytes, dtype=torch.uint8)
    works = [pg.recv([b], 0, 0) for b in bufs]  # two receives always posted
    i = 0
    while True:
        works[i].wait()
        buf = bufs[i]
        op = int(buf[0])
        if op == 2:
            break
        n = 1 if op == 0 else int(buf[8:16].view(torch.int64)[0])
        works[i] = pg.recv([buf], 0, 0)
        pg.send([reply[:n]], 0, 1).wait()
        i ^= 1
    os._exit(0)  # no gloo destructor under a posted receive


def _socket_child(fd: int) -> int:
    s = socket.socket(fileno=fd)
    while True:
        b = s.recv(1)
        if not b:
            return 0
        s.sendall(b)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog="python -m mqnc.measure.floors")
    ap.add_argument("role", choices=["gloo", "socket"])
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--max-bytes", type=int, default=16)
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--fd", type=int, default=-1)
    a = ap.parse_args()
    if a.role == "gloo":
        raise SystemExit(_gloo_child(a.port, a.max_bytes, a.timeout))
    raise SystemExit(_socket_child(a.fd))
