"""The device route: a request and its reply moved by kernels through device memory, with no host
call per request (§3.1-§3.3; the host-driven engines of this package stay as they are, this is a
path beside them).

Layout (every word int64; ``docs/device-route.md`` draws it): ``slots`` inbox slots on the
holder's side, one per requester lane, each a header of ``HEADER_WORDS`` words (sequence, layer,
chunk, tokens, heads, mode, top-k), query rows ``[max_batch, H, d_qk]``, a selection
``[max_batch, max_topk]`` int32 and a signal word; as many reply slots on the requester's side,
each a header of ``REPLY_WORDS`` words (sequence, status, detail, rows, heads), the partial ``o
[max_batch, H, d_v]`` and ``lse [max_batch, H]`` (natural log, float32) and a signal word. A
signal is raised to the request's sequence number after its payload (release), and read with an
acquire. Status codes and word indices are ``mqnc.triton_kernels.route.words``'.

Two memory backends behind one interface (:class:`LocalBackend`, :class:`NvshmemBackend`): who
allocates the slots and how a kernel delivers into them.

- ``local``: inbox and replies in one device's memory (one process, the holder kernel resident
  beside the requester's kernels): stores, then a release on the signal word;
- ``nvshmem``: the slots in NVSHMEM's symmetric heap, each PE holding a copy at the same
  address; a sender writes its own copy, then a device-initiated put-with-signal (NVSHMEM's
  device bitcode, ``nvshmemx_putmem_signal_nbi_block``) delivers it to the receiver's copy (PE
  to itself on one GPU, PE to PE across GPUs and nodes).

The requester's side is :class:`RouteClient` (a put kernel per request, a wait-then-merge kernel
per step, the sequence numbers in device memory: a step captured in a CUDA graph replays with
no host call); the holder's is ``mqnc.serving.device_holder.DeviceHolder`` (the resident kernel).
Sequence numbers belong to the slot, not to a client object: a put numbers its request after
the slot's last (the inbox header's sequence word), so a second client on a slot, or one
restarted, is never answered with another request's reply; the merge takes a reply only if
its header echoes the awaited number and it answered every row the merge reads.
"""

from __future__ import annotations

import dataclasses

import torch

from mqnc.base.checks import check_int
from mqnc.triton_kernels.route import words
from mqnc.triton_kernels.route.put import route_put_launch
from mqnc.triton_kernels.route.wait_merge import route_merge_launch, route_wait_launch
from mqnc.triton_kernels.route.words import HEADER_WORDS, REPLY_WORDS, STATUS_NAMES, RouteBuffers

__all__ = [
    "RouteLayout",
    "RouteBuffers",
    "LocalBackend",
    "NvshmemBackend",
    "BACKENDS",
    "allocate",
    "RouteClient",
    "RouteFailed",
    "STATUS_NAMES",
    "MODES",
]

MODES = {"dense": int(words.MODE_DENSE), "sparse": int(words.MODE_SPARSE), "probe": 2}


class RouteFailed(RuntimeError):
    """A routed step whose replies were not all ``OK`` (named per slot)."""


@dataclasses.dataclass(frozen=True)
class RouteLayout:
    """The slots' sizes: ``slots`` requester lanes, at most ``max_batch`` query tokens of
    ``heads`` heads (``d_qk`` wide; partials ``d_v`` wide) and ``max_topk`` selected entries a
    request, in ``dtype`` (the cache's)."""

    slots: int
    max_batch: int
    heads: int
    d_qk: int = 576
    d_v: int = 512
    max_topk: int = 64
    dtype: torch.dtype = torch.bfloat16

    def __post_init__(self) -> None:
        for name in ("slots", "max_batch", "heads", "max_topk"):
            check_int(name, getattr(self, name), minimum=1)
        if self.d_v != 512 or self.d_qk - self.d_v not in (64,):
            raise ValueError(
                f"d_qk, d_v: expected the MLA latent 512 + rope 64, got {self.d_qk}, {self.d_v}"
            )
        if self.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise TypeError(f"dtype: expected bfloat16, float16 or float32, got {self.dtype}")

    @property
    def slot_bytes(self) -> int:
        """Bytes of one inbox plus one reply slot (headers, rows, selection, partial)."""
        e = torch.empty((), dtype=self.dtype).element_size()
        rows = self.max_batch * self.heads
        return (
            8 * (HEADER_WORDS + REPLY_WORDS + 2)
            + rows * (self.d_qk + self.d_v) * e
            + rows * 4
            + self.max_batch * self.max_topk * 4
        )


class LocalBackend:
    """Slots in one device's memory (``torch.zeros``); kernels deliver by stores and a
    release on the signal word. ``nvshmem_lib`` is None; every slot's peer is PE 0."""

    name = "local"
    nvshmem_lib: str | None = None

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)

    def alloc(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype, device=self.device)

    @property
    def rank(self) -> int:
        return 0


class NvshmemBackend:
    """Slots in NVSHMEM's symmetric heap (nvshmem4py's ``interop.torch.tensor``, zeroed);
    kernels deliver with device-initiated put-with-signal from NVSHMEM's device bitcode. Needs
    an initialised NVSHMEM instance (``mqnc.transport.nvshmem``) and a GPU; imported lazily."""

    name = "nvshmem"

    def __init__(self, device: torch.device | str | None = None) -> None:
        from mqnc.transport import nvshmem

        if not torch.cuda.is_available():
            raise RuntimeError("nvshmem backend: needs a CUDA device")
        import nvshmem.core as core  # noqa: F401  (the instance must be initialised)

        self.device = torch.device(device or "cuda")
        self.nvshmem_lib = nvshmem.device_library_path()
        self._core = core

    def alloc(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        t = self._core.interop.torch.tensor(shape, dtype=dtype)
        t.zero_()
        return t

    @property
    def rank(self) -> int:
        return int(self._core.my_pe())


BACKENDS = ("local", "nvshmem")


def allocate(layout: RouteLayout, backend) -> RouteBuffers:
    """The inbox and reply slots of ``layout`` from ``backend`` (zeroed: signals 0, so the first
    sequence number is 1)."""
    n, B, H, k = layout.slots, layout.max_batch, layout.heads, layout.max_topk
    a = backend.alloc
    return RouteBuffers(
        in_sig=a((n,), torch.int64),
        in_hdr=a((n, HEADER_WORDS), torch.int64),
        in_q=a((n, B, H, layout.d_qk), layout.dtype),
        in_idx=a((n, B, k), torch.int32),
        rep_sig=a((n,), torch.int64),
        rep_hdr=a((n, REPLY_WORDS), torch.int64),
        rep_o=a((n, B, H, layout.d_v), layout.dtype),
        rep_lse=a((n, B, H), torch.float32),
    )


class RouteClient:
    """The requester's device side of a device route: puts requests, then waits for and merges
    their replies, all by kernels. Sequence numbers are the slot's: a put takes the slot's last
    number (its inbox header's ``H_SEQ`` word, which every put on the slot writes, whichever
    client made it) plus one, and records it in ``seq [slots]`` int64 (device memory); the
    merge waits for that number's reply. Several clients may use one set of buffers (one at a
    time on a slot: a request's reply is merged before the next request on its slot is put).

    Parameters
    ----------
    buffers : RouteBuffers
        The slots (:func:`allocate`).
    backend : LocalBackend or NvshmemBackend
    holder_pe : int
        The holder's PE (``nvshmem``; ``local``: unused).
    programs : int
        CTAs of a put.
    spins : int
        Bound of each reply wait, in polls (a missing reply is ``TIMEOUT``, never a hang).
    """

    def __init__(self, buffers: RouteBuffers, backend, *, holder_pe: int = 0, programs: int = 4,
                 spins: int = 1 << 24) -> None:  # fmt: skip
        self.buffers = buffers
        self.backend = backend
        self.holder_pe = check_int("holder_pe", holder_pe, minimum=0)
        self.programs = check_int("programs", programs, minimum=1)
        self.spins = check_int("spins", spins, minimum=0)
        dev = buffers.in_sig.device
        self.seq = torch.zeros(buffers.slots, dtype=torch.int64, device=dev)
        self._arrive = torch.zeros(buffers.slots, dtype=torch.int32, device=dev)
        self._slot_lists: dict[tuple[int, ...], torch.Tensor] = {}
        # (tokens, heads) of this client's last request on each slot; None: a probe
        self._puts: dict[int, tuple[int, int] | None] = {}
        self.launches = 0  # kernel launches made (a captured step's replays make none)

    def put(self, slot: int, q: torch.Tensor, *, layer: int, chunk: int,
            indices: torch.Tensor | None = None, probe: bool = False) -> None:  # fmt: skip
        """Put one request on ``slot``: ``q [B, heads, d_qk]`` (the cache dtype) for ``layer``
        of the holder's ``chunk``, dense, or sparse with ``indices [B, topk]`` int32
        chunk-local (-1 unused); ``probe``: a header-only request (the protocol probe: no row
        is copied, the header says 0 tokens, the reply carries no partial)."""
        buf = self.buffers
        check_int("slot", slot, minimum=0, below=buf.slots)
        _check_rows(buf, q, indices)
        mode = MODES["probe"] if probe else MODES["dense" if indices is None else "sparse"]
        launch = route_put_launch(
            buf, self.seq, self._arrive, slot, q if not probe else q[:0], indices,
            layer=check_int("layer", layer), chunk=check_int("chunk", chunk), mode=mode,
            programs=self.programs, pe=self.holder_pe, nvshmem_lib=self.backend.nvshmem_lib,
        )  # fmt: skip
        launch()
        self.launches += 1
        self._puts[slot] = None if probe else (int(q.shape[0]), int(q.shape[1]))

    def merge(self, slots: list[int], batch: int, heads: int, *,
              local: tuple[torch.Tensor, torch.Tensor] | None = None, out=None):  # fmt: skip
        """Wait for the replies on ``slots`` and merge them (and ``local``, merged last).

        Parameters
        ----------
        slots : list of int
            Slots this client put a request on (its last request on each is awaited).
        batch, heads : int
            The rows to merge: tokens ``0 .. batch - 1``, heads ``0 .. heads - 1`` of every
            reply, at most what each request carried (a ``ValueError`` naming the argument for
            this client's requests; a reply that answered fewer rows, a probe's among them, is
            ``UNANSWERED`` on the device).
        local : (o [batch, heads, d_v], lse [batch, heads]) or None
            A local partial (``o`` in the cache dtype, ``lse`` float32, natural log).
        out : (o, lse, status) or None
            The tensors to write (a captured step), as returned; each checked on the host
            (type, dtype, shape, device, contiguous) before the launch.

        Returns
        -------
        o : ``[batch, heads, d_v]`` in the cache dtype
        lse : ``[batch, heads]`` float32, natural log
        status : ``[len(slots)]`` int64 per slot, ``OK`` = 0, else :data:`STATUS_NAMES`'
            (the holder's error, ``sequence``: the reply's header answers another number,
            ``unanswered``, ``timeout``). A row of a step with any failed slot is NaN, and so
            is a row a holder answered NaN (keys, but no finite ``lse``).
        """
        buf = self.buffers
        dev = buf.rep_o.device
        check_int("batch", batch, minimum=1, below=buf.max_batch + 1)
        check_int("heads", heads, minimum=1, below=buf.heads + 1)
        if not slots:
            raise ValueError("slots: expected at least one slot to wait for, got none")
        key = tuple(check_int("slots", s, minimum=0, below=buf.slots) for s in slots)
        want = (batch, heads, buf.rep_o.shape[3])
        for name, t, shape, dtype in (
            ("local[0] (o)", None if local is None else local[0], want, buf.rep_o.dtype),
            ("local[1] (lse)", None if local is None else local[1], want[:2], torch.float32),
        ):
            bad = t is not None and (
                tuple(t.shape) != shape
                or t.dtype != dtype
                or not t.is_contiguous()
                or t.device != dev
            )
            if bad:
                raise ValueError(
                    f"{name}: expected a contiguous {shape} {dtype} tensor on {dev}, got "
                    f"{tuple(t.shape)} {t.dtype} on {t.device}"
                )
        if out is None:
            o = torch.empty(want, dtype=buf.rep_o.dtype, device=dev)
            lse = torch.empty(want[:2], dtype=torch.float32, device=dev)
            status = torch.empty(len(key), dtype=torch.int64, device=dev)
        else:
            if not isinstance(out, (tuple, list)) or len(out) != 3:
                got = f"{len(out)} items" if isinstance(out, (tuple, list)) else type(out).__name__
                raise TypeError(
                    f"out: expected a tuple of three tensors (o, lse, status), got {got}"
                )
            o, lse, status = out
            _check_tensor("out[0] (o)", o, want, buf.rep_o.dtype, dev)
            _check_tensor("out[1] (lse)", lse, want[:2], torch.float32, dev)
            _check_tensor("out[2] (status)", status, (len(key),), torch.int64, dev)
        for s in key:
            if s not in self._puts:
                raise ValueError(
                    "slots: expected slots with a request from this client, got one with no "
                    f"request from it: slot {s}"
                )
            carried = self._puts[s]
            if carried is not None and batch > carried[0]:
                raise ValueError(f"batch: expected at most what slot {s}'s request carried, "
                                 f"{carried[0]} token(s), got {batch}")  # fmt: skip
            if carried is not None and heads > carried[1]:
                raise ValueError(f"heads: expected at most what slot {s}'s request carried, "
                                 f"{carried[1]} heads, got {heads}")  # fmt: skip
        idx = self._slot_lists.get(key)  # made once, eagerly: a captured step copies nothing
        if idx is None:
            idx = self._slot_lists[key] = torch.tensor(key, dtype=torch.int64).to(dev)
        route_wait_launch(buf, self.seq, idx, status, batch, heads, spins=self.spins,
                          nvshmem=self.backend.nvshmem_lib is not None)()  # fmt: skip
        route_merge_launch(buf, idx, o, lse, status, local=local)()
        self.launches += 2
        return o, lse, status


def check_status(status: torch.Tensor, slots: list[int]) -> None:
    """Raise :class:`RouteFailed` naming each slot whose reply was not ``OK`` (one sync)."""
    got = status.tolist()
    bad = [f"slot {s}: {STATUS_NAMES.get(c, c)}" for s, c in zip(slots, got, strict=True) if c]
    if bad:
        raise RouteFailed("device route: " + "; ".join(bad))


def _check_tensor(name: str, t, shape: tuple, dtype: torch.dtype, device: torch.device) -> None:
    """A ``TypeError`` / ``ValueError`` naming ``name`` unless ``t`` is a contiguous ``shape``
    tensor of ``dtype`` on ``device`` (what a kernel writes through a flat pointer)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise TypeError(f"{name}: invalid dtype, expected {dtype}, got {t.dtype}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name}: expected a tensor on {device}, got one on {t.device}")
    if not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor, got strides {t.stride()}")


def _check_rows(buf: RouteBuffers, q: torch.Tensor, indices: torch.Tensor | None) -> None:
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"q: expected a torch.Tensor, got {type(q).__name__}")
    d_qk = buf.in_q.shape[3]
    if q.dim() != 3 or q.shape[2] != d_qk or q.stride(2) != 1:
        raise ValueError(f"q: expected [B, heads, {d_qk}] with unit last stride, got "
                         f"{tuple(q.shape)} strides {q.stride()}")  # fmt: skip
    if q.dtype != buf.in_q.dtype:
        raise TypeError(f"q: invalid dtype, expected {buf.in_q.dtype}, got {q.dtype}")
    if q.device != buf.in_q.device:
        raise ValueError(f"q: expected a tensor on {buf.in_q.device}, got {q.device}")
    if not (1 <= q.shape[0] <= buf.max_batch and 1 <= q.shape[1] <= buf.heads):
        raise ValueError(f"q: expected 1..{buf.max_batch} tokens of 1..{buf.heads} heads (the "
                         f"slot's), got {q.shape[0]} x {q.shape[1]}")  # fmt: skip
    if indices is not None:
        if indices.dtype != torch.int32 or indices.dim() != 2 or indices.shape[0] != q.shape[0]:
            raise ValueError(f"indices: expected [{q.shape[0]}, topk] int32, got "
                             f"{tuple(indices.shape)} {indices.dtype}")  # fmt: skip
        if indices.stride(1) != 1 or indices.device != q.device:
            raise ValueError("indices: expected unit last stride, on q's device")
        if not 1 <= indices.shape[1] <= buf.max_topk:
            raise ValueError(f"indices: expected 1..{buf.max_topk} entries a token (the "
                             f"slot's), got {indices.shape[1]}")  # fmt: skip


# ---- the sm_90 compile of the route's kernels ---------------------------------------------------


def device_route_launches(
    heads: int = 16, nvshmem_lib: str | None = None, fp8: bool = False
) -> dict:
    """The route's launches at production values (bf16, page 64, ``heads`` heads: the tiles
    ``mla.decode`` / ``mla.sparse`` launch there) on small CPU tensors (only dtypes, alignment
    and constexprs decide the compiled variant; every runtime int is unspecialised):
    ``{name: Launch}`` for the holder kernel (one-shot and persistent), the put (dense and
    sparse), the wait and the merge, and the pass's take (one-shot and persistent), gather and
    reply (the attention between them is ``mla.decode``'s, compiled with it). ``nvshmem_lib``:
    the NVSHMEM backend's variants. ``fp8``: only the
    holder kernel's four launches over an FP8 pool (uint8 656-byte entries; the put and the
    merge move bf16 rows whatever the cache keeps)."""
    from mqnc.triton_kernels.route.holder_loop import HolderTables, holder_loop_launch

    layout = RouteLayout(slots=2, max_batch=2, heads=heads, max_topk=64)
    buf = allocate(layout, LocalBackend("cpu"))
    i32, i64 = torch.int32, torch.int64
    z = torch.zeros
    tables = HolderTables(
        kv=z(2, 4, 64, 656, dtype=torch.uint8) if fp8 else z(2, 4, 64, 576, dtype=torch.bfloat16),
        chunk_blocks=z(2, 4, dtype=i32),
        chunk_tokens=z(2, dtype=i32), splits_dense=z(2, 3, dtype=i32),
        splits_sparse=z(3, 5, dtype=i32), slot_pe=z(2, dtype=i32), stop=z(1, dtype=i64),
        seen=z(4, 2, dtype=i64), arrive=z(2, dtype=i32), err=z(2, dtype=i64),
        ws_o=z(2, 2, heads, 512), ws_lse=z(2, 2, heads),
    )  # fmt: skip
    out = {}
    for sparse in (False, True):
        for persistent in (False, True):
            ln = holder_loop_launch(buf, tables, softmax_scale=0.1, max_rows=32, sparse=sparse,
                                    persistent=persistent, nvshmem_lib=nvshmem_lib)  # fmt: skip
            out[ln.name] = ln
    if fp8:
        return out
    q = z(2, heads, 576, dtype=torch.bfloat16)
    seq, arrive = z(2, dtype=i64), z(2, dtype=i32)
    for idx in (None, z(2, 64, dtype=i32)):
        ln = route_put_launch(buf, seq, arrive, 1, q, idx, layer=1, chunk=1, mode=1,
                              nvshmem_lib=nvshmem_lib)  # fmt: skip
        out[ln.name] = ln
    o, lse = z(2, heads, 512, dtype=torch.bfloat16), z(2, heads)
    ln = route_wait_launch(buf, seq, z(1, dtype=i64), z(1, dtype=i64), 2, heads,
                           nvshmem=nvshmem_lib is not None)  # fmt: skip
    out[ln.name] = ln
    ln = route_merge_launch(buf, z(1, dtype=i64), o, lse, z(1, dtype=i64))
    out[ln.name] = ln
    out.update(_pass_launches(buf, heads, nvshmem_lib))
    return out


def _pass_launches(buf: RouteBuffers, heads: int, nvshmem_lib: str | None) -> dict:
    """The holder's pass around the attention (its take, one-shot and persistent, its gather
    and its reply) at production values: 16 slots of 64 tokens, folded rows of 128
    (``holder_pass.pass_shape``)."""
    from mqnc.triton_kernels.route.holder_pass import (
        PASS_WORDS,
        pass_shape,
        route_gather_launch,
        route_reply_launch,
        route_take_launch,
    )

    i32, i64, z = torch.int32, torch.int64, torch.zeros
    buf = allocate(RouteLayout(slots=16, max_batch=64, heads=heads, max_topk=64),
                   LocalBackend("cpu"))  # fmt: skip
    groups, fold = pass_shape(heads, 64, 16)
    record, arrive = z(16, PASS_WORDS, dtype=i64), z(16, dtype=i32)
    out = {}
    for persistent in (False, True):
        ln = route_take_launch(
            buf, stop=z(1, dtype=i64), seen=z(16, dtype=i64), record=record,
            deferred=z(1, dtype=i64), chunk_blocks=z(4, 40, dtype=i32),
            chunk_tokens=z(4, dtype=i32), table=z(groups, 33, dtype=i32),
            lens=z(groups, dtype=i32), layers=4, num_blocks=40, max_rows=64 * heads, fold=fold,
            take_sparse=False, persistent=persistent, nvshmem=nvshmem_lib is not None,
        )  # fmt: skip
        out[ln.name] = ln
    rows = groups * fold
    ln = route_gather_launch(buf, record=record, q=z(rows, 576, dtype=torch.bfloat16))
    out[ln.name] = ln
    ln = route_reply_launch(buf, record=record, o=z(rows, 512, dtype=torch.bfloat16),
                            lse=z(rows), arrive=arrive, slot_pe=z(16, dtype=i32),
                            nvshmem_lib=nvshmem_lib)  # fmt: skip
    out[ln.name] = ln
    return out


def compile_device_route(
    arch: int = 90, *, heads: int = 16, nvshmem: bool = False, fp8: bool = False
) -> dict:
    """Compile :func:`device_route_launches` for ``sm_<arch>`` exactly as they launch (run with
    ``TRITON_INTERPRET=0``); ``nvshmem``: against NVSHMEM's device bitcode; ``fp8``: the
    holder kernel's FP8 variants. Returns, per
    launch, registers, stack and local bytes (spills), shared bytes, and the NVSHMEM device
    functions its PTX calls."""
    from mqnc.triton_kernels.sm90.compile import compile_launch, resources

    lib = None
    if nvshmem:
        from mqnc.transport.nvshmem import device_library_path

        lib = device_library_path(arch)
    names = ("nvshmemx_putmem_nbi_block", "nvshmemx_putmem_signal_nbi_block", "nvshmem_fence",
             "nvshmem_quiet")  # fmt: skip
    out = {}
    for name, ln in device_route_launches(heads, lib, fp8).items():
        k = compile_launch(ln.kernel, ln.args, ln.kwargs, grid=ln.grid, arch=arch)
        r = resources(name, k)
        calls = [n for n in names if n in k.asm["ptx"]]
        out[name] = dict(registers=r.registers, stack=r.stack, local=r.local, shared=r.shared,
                         calls=calls)  # fmt: skip
    return out
