"""Tensor-parallel instances (§8): how the latent is column-partitioned over an instance's ``N``
ranks, and the holder group's reduction inside the instance.

:class:`TPPartition` fixes the columns rank ``r`` of a TP-``N`` instance keeps of every
``d_qk``-wide cache entry and query row (DeepSeek: 512 latent + 64 RoPE dims):

- latent dims ``[r d_c / N, (r + 1) d_c / N)``: the rank's share of the scores' dot product and
  its slice of the value (``o``);
- RoPE dims: the rank's ``d_r / (2N)`` rotation **pairs**, ``[r P / N, (r + 1) P / N)`` of the
  ``P = d_r / 2`` pairs, both elements of each pair (interleaved layout: dims ``2i, 2i + 1``;
  half layout: dims ``i`` and ``i + P``, kept as the slice's own halves). The RoPE part is
  split, not replicated: a replicated part would be counted ``N`` times in the summed score
  (or need one rank to zero it) and would cost every rank ``d_r`` dims of query and cache
  (``2 d_r (N - 1) / N`` bytes more per rank, ``2 d_r (N - 1)`` over the instance, per row and
  per cached entry, bf16); split by pairs, each
  rank's slice is itself a RoPE vector in the model's layout with its pairs' frequencies, so
  a re-homing rotation (the splice, the query's ``-delta``) stays rank-local.

So a rank's slice row is ``d_qk / N`` wide (``d_c / N`` latent, then ``d_r / N`` RoPE dims):
a requester rank ships ``M_q x d_qk / N`` query values, the paper's rank pairing. The wire
checks each rank's messages against :attr:`TPPartition.slice_geometry` (``d_c / N``,
``d_r / N``), so a slice of another width is refused by its header.

The reduction (:class:`GroupReduce`): the holder group sums its ranks' fp32 partial scores with
one all-reduce per batch, inside the instance. Engines: :class:`GlooGroup` (a
``torch.distributed`` gloo group of the instance's ranks, built directly on a store: CPU
processes), :class:`NcclGroup` (the same over NCCL, CUDA tensors) and :class:`ThreadGroup` (the
ranks as threads of one process, for the loopback engine). Each collective is bounded by the
group's timeout; a lost member fails it with :class:`GroupLost` (a ``TransportError``), never a
hang.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import threading

import torch

from mqnc.base.checks import check_int, check_number
from mqnc.model.geometry import MLAGeometry
from mqnc.transport.protocol import Transport, TransportError

__all__ = [
    "GroupLost",
    "GroupReduce",
    "GlooGroup",
    "NcclGroup",
    "ThreadGroup",
    "TPPartition",
    "ROPE_LAYOUTS",
]

ROPE_LAYOUTS = ("interleaved", "half")
_SLICE_FORMATS = ("bf16", "fp16", "fp32")  # cache formats a rank's column slice keeps


class GroupLost(TransportError):
    """A member of a holder group was lost (or stalled past the timeout) during a reduction."""


@dataclasses.dataclass(frozen=True)
class TPPartition:
    """The column partition of one TP-``degree`` instance (see the module docstring).

    Parameters
    ----------
    geometry : MLAGeometry
        The model's dims (``d_c``, ``d_r``; values read from the latent, ``d_v = d_c``); a
        16-bit (or fp32) ``cache_dtype``: an FP8 geometry (``"fp8_e4m3"``) is refused by name
        (its rank slices are not built; the untensor-parallel holders serve it).
    degree : int
        ``N``, the instance's tensor-parallel ranks (1, 2, 4, ...): ``N`` must divide ``d_c``
        and the ``d_r / 2`` RoPE pairs.
    rope_layout : {"interleaved", "half"}
        The model's RoPE pair convention (DeepSeek's reference: interleaved).
    """

    geometry: MLAGeometry
    degree: int
    rope_layout: str = "interleaved"

    def __post_init__(self) -> None:
        g = self.geometry
        if not isinstance(g, MLAGeometry):
            raise TypeError(f"geometry: expected an MLAGeometry, got {type(g).__name__}")
        n = check_int("degree", self.degree, minimum=1)
        if g.cache_dtype not in _SLICE_FORMATS:
            raise ValueError(
                f"geometry.cache_dtype: a tensor-parallel instance keeps 16-bit cache slices, "
                f"expected one of {_SLICE_FORMATS}, got {g.cache_dtype!r}: an FP8 rank slice "
                f"would be a new entry format (its d_c / N e4m3 bytes with their groups' "
                f"scales, a 128-wide scale group split across ranks once d_c / N < 128, and its "
                f"bf16 RoPE pairs) that the TP kernels do not read (not built); serve an FP8 "
                f"cache with the untensor-parallel Holder or DeviceHolder"
            )
        if self.rope_layout not in ROPE_LAYOUTS:
            raise ValueError(
                f"rope_layout: expected one of {ROPE_LAYOUTS}, got {self.rope_layout!r}"
            )
        if g.d_v != g.d_c:
            raise ValueError(
                f"geometry: TP partitions the latent, whose first d_c dims are the value; "
                f"{g.name!r} reads {g.d_v}-wide values from {g.d_qk}-wide entries"
            )
        if g.d_c % n:
            raise ValueError(
                f"degree: a TP degree must divide the latent width d_c = {g.d_c}, got {n}"
            )
        if (g.d_r // 2) % n:
            raise ValueError(
                f"degree: a TP degree must divide the {g.d_r // 2} RoPE pairs (d_r = {g.d_r}), "
                f"got {n}"
            )

    @property
    def slice_geometry(self) -> MLAGeometry:
        """The geometry of one rank's slice (``d_c / N``, ``d_r / N``): what its wire messages
        are checked against."""
        g, n = self.geometry, self.degree
        if n == 1:
            return g
        return dataclasses.replace(g, name=f"{g.name}/tp{n}", d_c=g.d_c // n, d_r=g.d_r // n)

    @property
    def slice_width(self) -> int:
        """``d_qk / N``: the width of a rank's query row and cache entry."""
        return self.geometry.d_qk // self.degree

    @property
    def slice_latent(self) -> int:
        """``d_c / N``: a rank's latent (value) dims."""
        return self.geometry.d_c // self.degree

    def columns(self, rank: int) -> torch.Tensor:
        """``[d_qk / N]`` int64: the columns of a full row that rank ``rank`` keeps, in the
        slice's order (latent, then RoPE)."""
        check_int("rank", rank, minimum=0, below=self.degree)
        g, n = self.geometry, self.degree
        w, pairs = g.d_c // n, g.d_r // 2 // n
        latent = torch.arange(rank * w, (rank + 1) * w)
        first = rank * pairs
        if self.rope_layout == "interleaved":
            rope = torch.arange(2 * first, 2 * (first + pairs))
        else:
            half = torch.arange(first, first + pairs)
            rope = torch.cat([half, half + g.d_r // 2])
        return torch.cat([latent, g.d_c + rope])

    def slice(self, x: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank ``rank``'s columns of full rows ``x [..., d_qk]`` (a query batch or a chunk),
        contiguous."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x: expected a torch.Tensor, got {type(x).__name__}")
        if x.dim() < 1 or x.shape[-1] != self.geometry.d_qk:
            raise ValueError(
                f"x: expected rows of the full width {self.geometry.d_qk}, got shape "
                f"{tuple(x.shape)}"
            )
        return x[..., self.columns(rank).to(x.device)].contiguous()

    def join_values(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """The ``N`` ranks' ``o`` slices ``[..., d_c / N]`` side by side: the full ``o``."""
        if len(parts) != self.degree:
            raise ValueError(f"parts: expected {self.degree} slices, got {len(parts)}")
        return torch.cat(parts, dim=-1)


def check_tp_fabric(transport: Transport, partition: TPPartition) -> int:
    """Check that a TP rank's ``transport`` spans whole TP-``degree`` instances.

    Parameters
    ----------
    transport : mqnc.transport.protocol.Transport
        The fabric every rank of every instance is on.
    partition : TPPartition
        The instance's column partition.

    Returns
    -------
    int
        The TP degree ``N`` (``partition.degree``).

    Raises
    ------
    TypeError
        ``transport`` is not a Transport or ``partition`` not a TPPartition.
    ValueError
        The fabric's world size is not a multiple of ``N``.
    """
    if not isinstance(transport, Transport):
        raise TypeError(f"transport: expected a Transport, got {type(transport).__name__}")
    if not isinstance(partition, TPPartition):
        raise TypeError(f"partition: expected a TPPartition, got {type(partition).__name__}")
    n = partition.degree
    if transport.world_size % n:
        raise ValueError(
            f"transport: a fabric of whole TP-{n} instances needs a world size divisible by "
            f"{n}, got {transport.world_size}"
        )
    return n


class GroupReduce:
    """A holder group's reduction: ``all_reduce_sum`` of one tensor over the group's ranks.

    Every rank gets the same sum (the engines' all-reduce hands each rank the same reduced
    values), in place; a member lost or stalled past ``timeout_s`` raises :class:`GroupLost`
    and leaves the group broken (every later call raises at once)."""

    rank: int
    size: int
    broken: str | None = None
    device = torch.device("cpu")  # where the reduced tensors live (NCCL: the rank's GPU)

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def leave(self) -> None:
        """This rank stops serving: members waiting in a reduction with it are released (a
        process group is released by the process's exit)."""

    def _refuse_if_broken(self) -> None:
        if self.broken is not None:
            raise GroupLost(f"holder group rank {self.rank}: group broken earlier ({self.broken})")


class _DistGroup(GroupReduce):
    """A ``torch.distributed`` process group of the instance's ranks, built directly on a store
    (no global default group)."""

    def __init__(self, pg, rank: int, size: int, timeout_s: float) -> None:
        self._pg, self.rank, self.size = pg, rank, size
        self.timeout = datetime.timedelta(
            seconds=check_number("timeout_s", timeout_s, positive=True)
        )

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        self._refuse_if_broken()
        if self.size == 1:
            return t
        try:
            work = self._pg.allreduce([t])
            work.wait(self.timeout)
        except Exception as exc:  # noqa: BLE001 - gloo / NCCL raise RuntimeError subclasses
            self.broken = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            raise GroupLost(
                f"holder group rank {self.rank}: the score reduction over {self.size} ranks "
                f"failed (a rank lost or stalled past {self.timeout.total_seconds():g} s): "
                f"{self.broken}"
            ) from None
        return t


class GlooGroup(_DistGroup):
    """The holder group over gloo (CPU tensors): ranks ``0 .. size - 1`` of the instance,
    meeting on ``store`` under ``prefix``; its pairs listen on ``host`` (None: torch's
    default, ``GLOO_SOCKET_IFNAME`` or the host name's address)."""

    def __init__(
        self,
        rank: int,
        size: int,
        store,
        *,
        prefix: str,
        timeout_s: float = 30.0,
        host: str | None = "127.0.0.1",
    ):
        import torch.distributed as dist

        check_int("size", size, minimum=1)
        check_int("rank", rank, minimum=0, below=size)
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = datetime.timedelta(seconds=timeout_s)
        opts._devices = [_gloo_device(host)]
        pg = dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, size, opts)
        super().__init__(pg, rank, size, timeout_s)


def _gloo_device(host: str | None):
    """A gloo device bound to ``host``; None: ``GLOO_SOCKET_IFNAME``'s interface when set, else
    torch's default (the host name's address)."""
    import torch.distributed as dist

    pg = dist.ProcessGroupGloo
    if host is not None:
        return pg.create_device(hostname=host)
    ifname = os.environ.get("GLOO_SOCKET_IFNAME")
    return pg.create_device(interface=ifname) if ifname else pg.create_default_device()


class NcclGroup(_DistGroup):
    """The holder group over NCCL (CUDA tensors, one GPU per rank, the current device): the
    reduction a GPU deployment runs over NVLink. Its bound on a stalled member is NCCL's own
    (the group's timeout through its watchdog; ``TORCH_NCCL_BLOCKING_WAIT=1`` makes the host
    wait raise). Not yet run on GPUs."""

    def __init__(self, rank: int, size: int, store, *, prefix: str, timeout_s: float = 30.0):
        import torch.distributed as dist

        check_int("size", size, minimum=1)
        check_int("rank", rank, minimum=0, below=size)
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = datetime.timedelta(seconds=timeout_s)
        pg = dist.ProcessGroupNCCL(dist.PrefixStore(prefix, store), rank, size, opts)
        super().__init__(pg, rank, size, timeout_s)
        self.device = torch.device("cuda", torch.cuda.current_device())


class ThreadGroup:
    """A holder group whose ranks are threads of this process (for the loopback engine):
    ``ThreadGroup(size).member(r)`` is rank ``r``'s :class:`GroupReduce`. The sum is taken in
    rank order on every member (the same bits everywhere)."""

    def __init__(self, size: int, timeout_s: float = 30.0) -> None:
        self.size = check_int("size", size, minimum=1)
        self.timeout_s = check_number("timeout_s", timeout_s, positive=True)
        self._barrier = threading.Barrier(size)
        self._parts: list[torch.Tensor | None] = [None] * size

    def member(self, rank: int) -> GroupReduce:
        return _ThreadMember(self, check_int("rank", rank, minimum=0, below=self.size))

    def abort(self) -> None:
        """Break the group (what a lost rank does to a real one)."""
        self._barrier.abort()


class _ThreadMember(GroupReduce):
    def __init__(self, group: ThreadGroup, rank: int) -> None:
        self.group, self.rank, self.size = group, rank, group.size

    def leave(self) -> None:
        self.group.abort()

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        self._refuse_if_broken()
        g = self.group
        try:
            g._parts[self.rank] = t.clone()
            g._barrier.wait(g.timeout_s)
            total = g._parts[0].clone()
            for p in g._parts[1:]:
                total += p
            g._barrier.wait(g.timeout_s)
        except threading.BrokenBarrierError:
            self.broken = "a member left or stalled"
            raise GroupLost(
                f"holder group rank {self.rank}: the score reduction over {self.size} ranks "
                f"failed (a rank lost or stalled past {g.timeout_s:g} s)"
            ) from None
        t.copy_(total)
        return t
