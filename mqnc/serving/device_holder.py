"""The device holder: a pool of canonical chunks served over a device route
(``mqnc.transport.device_route``) with no host call per request (§3.1-§3.3, §6.3).

Two schedules. ``"pass"`` (the default): dense requests are served by the holder's pass
(``mqnc.triton_kernels.route.holder_pass``): a device-side take that packs every taken
request's rows, those asking one (chunk, layer) together, ``F`` to a query row; the package's
dense attention over them (the chunk read once per ``F`` rows, on the fast kernel where the
device has it); a reply copy. It is captured once in a CUDA graph and replayed back to back by a
thread (a host call per pass, none per request). Sparse requests are served by the resident
sparse holder kernel. ``"resident"``: both modes by the resident holder kernels
(``mqnc.triton_kernels.route.holder_loop``), one (token, head block, split) item at a time.

The host's part is set-up only (and, for ``"pass"``, the replay thread): chunks are copied
into a :class:`~mqnc.serving.pool.PagedPool` as :class:`~mqnc.serving.Holder` does, the
kernels' chunk table (each chunk's pool blocks and ``c_t``, indexed by chunk id) and split
tables are written, then the kernels are launched: once per :meth:`DeviceHolder.serve_once`
(one-shot: the requests already signalled; what the CPU's interpreter runs), or once for good
by :meth:`DeviceHolder.start` (persistent, until :meth:`DeviceHolder.stop` sets the stop
word).

The pass's answer to a dense request is ``mla_decode_partial``'s over the request's rows folded
at :attr:`DeviceHolder.fold` with the pass's split count (:attr:`DeviceHolder.num_splits`), bit
for bit: what the host-driven ``Holder`` answers with ``fold=`` and ``num_splits=`` set alike.

In the resident kernels, tiles and split counts are the host ops' for the same call planned at the
holder kernel's tile (``route.holder_loop.HOLDER_TILE``, one of ``mla.decode``'s own tiles, forced
with ``mla.plan.forced_tile``): one request of ``B`` tokens at the holder's heads over the chunk's
pages, or its selection width. The holder kernel's answer to a request is then the host-driven
holder's answer to it alone at that tile, bit for bit (its dispatcher batches concurrent requests
into one call, whose split count may differ: the same rows, another rounding). Chunk ids are
indices of the table (``0 <= chunk_id < max_chunks``).

A geometry whose ``cache_dtype`` is ``"fp8_e4m3"`` gets a pool of FP8 entries (DeepSeek-V3.2's
656-byte token, docs/fp8-cache.md), the chunks quantized or copied as entries as the host
``Holder`` keeps them; the holder kernel then reads them in place (its ``FP8`` variant, the
attention kernels' ``mla.tile._attend_tile_fp8``), at the same tile, and answers as the host
holder over the same entries, bit for bit under the interpreter.
"""

from __future__ import annotations

import torch
import triton

from mqnc.base.checks import check_int, check_number
from mqnc.model.geometry import MLAGeometry
from mqnc.serving.batching import HostedChunk
from mqnc.serving.pool import PagedPool
from mqnc.triton_kernels.mla.decode import plan_decode, plan_mla_decode
from mqnc.triton_kernels.mla.plan import forced_tile, meta_output
from mqnc.triton_kernels.mla.sparse import plan_sparse
from mqnc.triton_kernels.route.holder_loop import HolderTables, holder_loop_launch, holder_tiles
from mqnc.triton_kernels.route.holder_pass import (
    FOLD,
    PASS_WORDS,
    SERVED_WORD,
    pass_shape,
    route_gather_launch,
    route_reply_launch,
    route_take_launch,
)
from mqnc.triton_kernels.route.words import RouteBuffers

__all__ = ["DeviceHolder", "SCHEDULES"]

SCHEDULES = ("pass", "resident")


class DeviceHolder:
    """Serve route requests from device memory with the holder kernel.

    Parameters
    ----------
    buffers : RouteBuffers
        The route's slots (``mqnc.transport.device_route.allocate``).
    geometry : MLAGeometry
        Dims; ``geometry.heads`` must be the slots' heads. ``cache_dtype="fp8_e4m3"``: the
        pool keeps FP8 entries (656 B a token for 512 + 64; docs/fp8-cache.md) that the holder
        kernel reads in place, dequantized to the slots' dtype in registers.
    softmax_scale : float
    num_blocks, block_size : int
        Pool capacity in blocks of ``block_size`` tokens (per layer).
    ctas : int
        ``k``, each resident kernel's CTAs (leave the requesters SMs: a handful of the 132).
    schedule : {"pass", "resident"}
        How dense requests are served: the pass (a take, the dense attention over folded rows,
        a reply; docs/device-route.md) or the resident kernel.
    num_splits : int or None
        The pass's split-KV count (None: the dense plan's choice for the pass's shape, which
        fills the device: the route's latency first). With ``pass_rows`` it is the policy of
        how many SMs the pass takes: the attention launches ``G x num_splits`` programs (those
        of unused folded rows exit at once); a holder that also decodes its own requests
        passes fewer splits to leave it SMs, at the cost of a longer pass.
    fold, pass_rows : int or None
        The pass's query rows: ``fold`` (a power of two >= 16; default 128) rows a folded row,
        and at least ``pass_rows`` rows a pass (default: the larger of one full slot and
        1,024 on a GPU, one full slot elsewhere, where the interpreter runs every folded row's
        programs; never less than one full slot). Requests past it wait for the next pass.
    serve_sparse : bool
        ``"pass"``: run the resident sparse kernel beside the pass (False: no SM is held by
        it, and a sparse request is answered ``ERR_MODE``).
    max_chunks : int
        Chunk ids are ``0 .. max_chunks - 1``.
    max_rows : int or None
        Most rows ``B * heads`` a request may ask for (default: what a slot holds).
    nvshmem_lib : str or None
        NVSHMEM's device bitcode (the ``nvshmem`` backend); None: ``local``.
    slot_pe : list of int or None
        The requester PE of each slot (``nvshmem``; default all 0).
    """

    def __init__(self, buffers: RouteBuffers, geometry: MLAGeometry, *, softmax_scale: float,
                 num_blocks: int, block_size: int = 64, ctas: int = 4, max_chunks: int = 8,
                 max_rows: int | None = None, nvshmem_lib: str | None = None,
                 slot_pe: list[int] | None = None, schedule: str = "pass",
                 num_splits: int | None = None, serve_sparse: bool = True, fold: int = FOLD,
                 pass_rows: int | None = None) -> None:  # fmt: skip
        if not isinstance(buffers, RouteBuffers):
            raise TypeError(f"buffers: expected RouteBuffers, got {type(buffers).__name__}")
        if geometry.heads != buffers.heads or geometry.d_qk != buffers.in_q.shape[3]:
            raise ValueError(
                f"geometry: expected {buffers.heads} heads of width {buffers.in_q.shape[3]} "
                f"(the slots'), got {geometry.heads} of {geometry.d_qk}"
            )
        self.buffers = buffers
        self.geometry = geometry
        self.softmax_scale = check_number("softmax_scale", softmax_scale, positive=True)
        self.dtype = buffers.in_q.dtype
        self.device = buffers.in_q.device
        self.ctas = check_int("ctas", ctas, minimum=1)
        self.max_rows = buffers.max_batch * buffers.heads if max_rows is None else max_rows
        check_int("max_rows", self.max_rows, minimum=1)
        self.nvshmem_lib = nvshmem_lib
        self._schedule(schedule, num_splits, serve_sparse, fold, pass_rows)
        self.pages = PagedPool(geometry.layers, num_blocks, block_size, geometry.d_qk,
                               dtype=self.dtype, device=self.device,
                               fp8=geometry.fp8_layout)  # fmt: skip
        self.chunks: dict[int, HostedChunk] = {}
        n, dev, B = buffers.slots, self.device, buffers.max_batch
        max_chunks = check_int("max_chunks", max_chunks, minimum=1)
        self._dense_tile, self._sparse_tile = holder_tiles(
            buffers.heads,
            self.dtype,
            nvshmem=nvshmem_lib is not None,
            fp8=self.pages.fp8 is not None,
        )
        sparse_tiles = triton.cdiv(buffers.max_topk, self._sparse_tile.block_n)
        pe = torch.tensor(slot_pe if slot_pe is not None else [0] * n, dtype=torch.int32)
        self._t = dict(
            kv=self.pages.kv,
            chunk_blocks=torch.zeros(max_chunks, num_blocks, dtype=torch.int32, device=dev),
            chunk_tokens=torch.full((max_chunks,), -1, dtype=torch.int32, device=dev),
            splits_dense=torch.ones(max_chunks, B + 1, dtype=torch.int32, device=dev),
            splits_sparse=self._sparse_splits(B, sparse_tiles).to(dev),
            slot_pe=pe.to(dev),
            stop=torch.zeros(1, dtype=torch.int64, device=dev),
        )
        # the dense kernel's and the sparse kernel's own state (each serves its requests)
        self._state = [
            dict(
                seen=torch.zeros(self.ctas, n, dtype=torch.int64, device=dev),
                arrive=torch.zeros(n, dtype=torch.int32, device=dev),
                err=torch.zeros(n, dtype=torch.int64, device=dev),
            )
            for _ in range(2)
        ]
        self._resize_workspace()
        # the pass's own state: the take's last numbers, the pass record, the reply's counters
        self._pass_state = dict(
            seen=torch.zeros(n, dtype=torch.int64, device=dev),
            record=torch.zeros(n, PASS_WORDS, dtype=torch.int64, device=dev),
            deferred=torch.zeros(1, dtype=torch.int64, device=dev),
            arrive=torch.zeros(n, dtype=torch.int32, device=dev),
        )
        self._pass = None  # the pass's plan, table and staging (made when first served)
        self._streams: list | None = None
        self._replayer = None
        self.launches = 0  # kernel launches (a pass's replays count once each)

    def _schedule(self, schedule, num_splits, serve_sparse, fold, pass_rows) -> None:
        """The schedule's arguments, checked (each error naming its argument), and the pass's
        shape (:func:`~mqnc.triton_kernels.route.holder_pass.pass_shape`)."""
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule: expected one of {SCHEDULES}, got {schedule!r}")
        self.schedule = schedule
        if num_splits is not None:
            check_int("num_splits", num_splits, minimum=1)
        self._num_splits = num_splits
        if not isinstance(serve_sparse, bool):
            raise TypeError(f"serve_sparse: expected a bool, got {type(serve_sparse).__name__}")
        self.serve_sparse = serve_sparse or schedule == "resident"
        fold = check_int("fold", fold, minimum=16)
        if fold & (fold - 1):
            raise ValueError(f"fold: expected a power of two >= 16, got {fold}")
        if pass_rows is not None:
            check_int("pass_rows", pass_rows, minimum=1)
        elif self.device.type != "cuda":  # the interpreter runs every folded row's programs
            pass_rows = 1
        buf = self.buffers
        self.groups, self.fold = pass_shape(buf.heads, buf.max_batch, buf.slots, fold, pass_rows)

    # ---- the pool and the tables ------------------------------------------------------------
    def add_chunk(self, chunk_id: int, kv: torch.Tensor, position: int = 0) -> HostedChunk:
        """Copy a chunk's cache ``kv [L, c_t, d_qk]`` (canonical positions from ``position``)
        into free pool blocks and enter it in the kernel's tables (not while it runs). An FP8
        geometry's pool quantizes such rows (``fp8_quantize``), or takes FP8 entries
        ``[L, c_t, b_KV]`` uint8 bit for bit after :meth:`PagedPool.check_entries`, as
        :meth:`mqnc.serving.Holder.add_chunk` does."""
        g = self.geometry
        check_int("chunk_id", chunk_id, minimum=0, below=self._t["chunk_tokens"].shape[0])
        position = check_int("position", position, minimum=0)
        if self._streams is not None:
            raise RuntimeError("device holder: add chunks before start() or after stop()")
        kv = self.pages.checked_chunk(kv, g.layers, g.d_qk, self.dtype)
        if chunk_id in self.chunks:
            raise ValueError(f"chunk_id: chunk {chunk_id} is already hosted")
        blocks = self.pages.alloc(kv.shape[1])
        self.pages.write(blocks, kv)
        c = HostedChunk(chunk_id, kv.shape[1], position, torch.tensor(blocks, dtype=torch.int32))
        self.chunks[chunk_id] = c
        self._t["chunk_blocks"][chunk_id, : len(blocks)] = c.blocks.to(self.device)
        self._t["chunk_tokens"][chunk_id] = c.tokens
        if self.schedule == "resident":  # (the pass plans its own split count)
            self._t["splits_dense"][chunk_id] = self._dense_splits(len(blocks)).to(self.device)
            self._resize_workspace()
        self._pass = None  # the pass's table is as wide as the widest chunk
        return c

    def _plan_q(self, B: int) -> torch.Tensor:
        return torch.empty(B, self.geometry.heads, self.geometry.d_qk, dtype=self.dtype,
                           device=self.device)  # fmt: skip

    def _dense_splits(self, blocks: int) -> torch.Tensor:
        """``[max_batch + 1]``: the dense plan's split count for B tokens over ``blocks``."""
        out = torch.ones(self.buffers.max_batch + 1, dtype=torch.int32)
        layer = self.pages.kv[0]
        for B in range(1, self.buffers.max_batch + 1):
            table = torch.zeros(B, max(blocks, 1), dtype=torch.int32, device=self.device)
            lens = torch.zeros(B, dtype=torch.int32, device=self.device)
            with forced_tile(self._dense_tile):
                plan = plan_decode(self._plan_q(B), layer, table, lens, self.softmax_scale,
                                   self.geometry.d_v, None, alloc=meta_output)  # fmt: skip
            out[B] = plan.num_splits
        return out

    def _sparse_splits(self, max_batch: int, tiles: int) -> torch.Tensor:
        """``[max_batch + 1, tiles + 1]``: the sparse plan's split count for B tokens of a
        selection ``t`` tiles wide."""
        out = torch.ones(max_batch + 1, tiles + 1, dtype=torch.int32)
        layer = self.pages.kv[0]
        bn = self._sparse_tile.block_n
        for B in range(1, max_batch + 1):
            q = self._plan_q(B)
            for t in range(1, tiles + 1):
                idx = torch.zeros(B, t * bn, dtype=torch.int32, device=self.device)
                with forced_tile(self._sparse_tile, sparse=True):
                    plan = plan_sparse(q, layer, idx, self.softmax_scale, self.geometry.d_v,
                                       None, alloc=meta_output)  # fmt: skip
                out[B, t] = plan.num_splits
        return out

    def _resize_workspace(self) -> None:
        """The split partials' workspace: the most ``B * S`` any split call of the tables
        writes, per slot."""
        B = torch.arange(self.buffers.max_batch + 1, dtype=torch.int32)
        d = self._t["splits_dense"].cpu()
        s = self._t["splits_sparse"].cpu()
        rows = max(
            int((torch.where(d > 1, d, 0) * B).max()),
            int((torch.where(s > 1, s, 0) * B[:, None]).max()),
            1,
        )
        n, H, dev = self.buffers.slots, self.buffers.heads, self.device
        if "ws_o" not in self._t or self._t["ws_o"].shape[1] < rows:
            self._t["ws_o"] = torch.zeros(n, rows, H, self.geometry.d_v, device=dev)
            self._t["ws_lse"] = torch.zeros(n, rows, H, device=dev)

    def tables(self, sparse: bool = False) -> HolderTables:
        """What the dense (``sparse``: the sparse) kernel reads: the shared tables, its state."""
        return HolderTables(**self._t, **self._state[int(sparse)])

    # ---- the pass ---------------------------------------------------------------------------
    def _pass_parts(self) -> dict:
        """The pass's plan over its ``G`` folded rows of ``F`` query rows (``q [G, F, d_qk]``,
        filled by the gather) and the layer-flattened pool (``[L * blocks, page, entry]``:
        layer ``l``'s block ``b`` is ``l * blocks + b``), its table (as wide as the widest
        hosted chunk), lengths and staging outputs; made once after the chunks."""
        if self._pass is not None:
            return self._pass
        buf, g = self.buffers, self.geometry
        G, F = self.groups, self.fold
        width = max([int(c.blocks.numel()) for c in self.chunks.values()] + [1])
        kv = self.pages.kv
        pool = kv.view(kv.shape[0] * kv.shape[1], *kv.shape[2:])
        q = torch.zeros(G, F, buf.in_q.shape[3], dtype=self.dtype, device=self.device)
        table = torch.zeros(G, width, dtype=torch.int32, device=self.device)
        lens = torch.zeros(G, dtype=torch.int32, device=self.device)
        plan = plan_mla_decode(q, pool, table, lens, softmax_scale=self.softmax_scale,
                               d_v=g.d_v, num_splits=self._num_splits)  # fmt: skip
        o = torch.empty(G, F, g.d_v, dtype=self.dtype, device=self.device)
        lse = torch.empty(G, F, dtype=torch.float32, device=self.device)
        self._pass = dict(plan=plan, q=q, pool=pool, table=table, lens=lens, o=o, lse=lse)
        return self._pass

    @property
    def num_splits(self) -> int:
        """The pass's split-KV count (the plan's choice unless given)."""
        return self._pass_parts()["plan"].num_splits

    def pass_launches(self, persistent: bool = False, max_idle: int = 1 << 30):
        """The pass: ``(take, gather, attend, reply)``, each a callable launching on the
        current stream (``attend`` the dense plan's run into the staging outputs)."""
        parts, buf, t = self._pass_parts(), self.buffers, self._t
        st = self._pass_state
        take = route_take_launch(
            buf, stop=t["stop"], seen=st["seen"], record=st["record"], deferred=st["deferred"],
            chunk_blocks=t["chunk_blocks"], chunk_tokens=t["chunk_tokens"],
            table=parts["table"], lens=parts["lens"], layers=self.geometry.layers,
            num_blocks=self.pages.kv.shape[1], max_rows=self.max_rows, fold=self.fold,
            take_sparse=not self.serve_sparse, persistent=persistent, max_idle=max_idle,
            nvshmem=self.nvshmem_lib is not None,
        )  # fmt: skip
        gather = route_gather_launch(
            buf, record=st["record"], q=parts["q"].view(-1, buf.in_q.shape[3])
        )
        reply = route_reply_launch(
            buf, record=st["record"], o=parts["o"].view(-1, self.geometry.d_v),
            lse=parts["lse"].view(-1), arrive=st["arrive"], slot_pe=t["slot_pe"],
            nvshmem_lib=self.nvshmem_lib,
        )  # fmt: skip
        plan = parts["plan"]

        def attend():
            plan.run(parts["q"], parts["pool"], parts["table"], parts["lens"],
                     out=(parts["o"], parts["lse"]))  # fmt: skip

        return take, gather, attend, reply

    def _run_pass(self, persistent: bool = False, max_idle: int = 1 << 30) -> None:
        """One pass, eagerly. Off a GPU (the interpreter) the gather and the attention are
        skipped when the take packed no rows (a host read; they would only write rows nobody
        reads), which changes no answer."""
        take, gather, attend, reply = self.pass_launches(persistent, max_idle)
        take()
        rows = self.device.type == "cuda" or bool(self._pass_state["record"][:, SERVED_WORD].any())
        for step in (gather, attend) if rows else ():
            step()
        reply()
        self.launches += 4 if rows else 2

    # ---- serving ----------------------------------------------------------------------------
    def launch(self, sparse: bool = False, persistent: bool = False, max_idle: int = 1 << 30):
        """The dense (``sparse``: the sparse) resident holder kernel's launch
        (``mqnc.triton_kernels._core.launch.Launch``)."""
        return holder_loop_launch(self.buffers, self.tables(sparse),
                                  softmax_scale=self.softmax_scale, max_rows=self.max_rows,
                                  sparse=sparse, persistent=persistent, max_idle=max_idle,
                                  nvshmem_lib=self.nvshmem_lib)  # fmt: skip

    def serve_once(self) -> None:
        """One-shot: serve the requests already signalled, then return (``"pass"``: one pass,
        then the sparse kernel's launch; ``"resident"``: the dense kernel's launch, then the
        sparse one's)."""
        if self.schedule == "pass":
            self._run_pass()
            while int(self._pass_state["deferred"][0]):  # (a host read: one-shot only)
                self._run_pass()
        else:
            self.launch(False)()
            self.launches += 1
        if self.serve_sparse:
            self.launch(True)()
            self.launches += 1

    def start(self, max_idle: int = 1 << 30, ahead: int = 4) -> DeviceHolder:
        """Serve until :meth:`stop` (a GPU). ``"resident"``: the two persistent kernels, each on
        its own stream. ``"pass"``: the pass captured once in a CUDA graph (its take waits on
        the device, at most ``max_idle`` empty polls), replayed back to back on its own stream
        by a thread that keeps ``ahead`` passes enqueued (a host call per pass, none per
        request), and the persistent sparse kernel beside it (``serve_sparse``). While they
        run, synchronize streams, never the device (``torch.cuda.synchronize``, and
        ``torch.cuda.graph``, which calls it when a capture begins, would wait for them
        forever): stop the holder around a capture."""
        if self.device.type != "cuda":
            raise RuntimeError("device holder: a persistent kernel needs a GPU (use serve_once)")
        if self._streams is not None:
            raise RuntimeError("device holder: already started")
        check_int("ahead", ahead, minimum=1)
        self._t["stop"].zero_()
        torch.cuda.synchronize(self.device)
        self._streams = []
        if self.schedule == "pass":
            self._replayer = _PassReplayer(self, max_idle, ahead)
            self._streams.append(self._replayer.stream)
        kinds = [sparse for sparse in (False, True) if sparse or self.schedule == "resident"]
        for sparse in kinds:
            if sparse and not self.serve_sparse:
                continue
            stream = torch.cuda.Stream(self.device)
            with torch.cuda.stream(stream):
                self.launch(sparse, persistent=True, max_idle=max_idle)()
            self._streams.append(stream)
            self.launches += 1
        if self._replayer is not None:
            self._replayer.begin()
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        """Set the stop word (from another stream) and wait for the kernels (and the pass's
        replays) to return."""
        if self._streams is None:
            return
        import time

        side = torch.cuda.Stream(self.device)  # beside the kernels' streams, not after them
        with torch.cuda.stream(side):
            self._t["stop"].fill_(1)
        deadline = time.monotonic() + check_number("timeout_s", timeout_s, positive=True)
        if self._replayer is not None:
            self._replayer.end(timeout_s)
            self.launches += self._replayer.replays
            self._replayer = None
        while not all(s.query() for s in self._streams):
            if time.monotonic() > deadline:
                raise TimeoutError(f"device holder: kernels did not stop within {timeout_s} s")
            time.sleep(1e-3)
        self._streams = None


class _PassReplayer:
    """The pass captured in a CUDA graph and replayed back to back by a thread, ``ahead``
    passes enqueued at most (each replay's event waited on ``ahead`` replays later)."""

    def __init__(self, holder: DeviceHolder, max_idle: int, ahead: int) -> None:
        import threading

        self.stream = torch.cuda.Stream(holder.device)
        self.ahead = ahead
        self.replays = 0
        self._halt = threading.Event()
        self.failure: BaseException | None = None
        steps = holder.pass_launches(persistent=True, max_idle=max_idle)
        holder._t["stop"].fill_(1)  # compiled (and the plan's workspaces made) with no wait
        self.stream.wait_stream(torch.cuda.current_stream(holder.device))
        with torch.cuda.stream(self.stream):
            for step in steps:
                step()
        self.stream.synchronize()
        holder._t["stop"].zero_()
        torch.cuda.synchronize(holder.device)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, stream=self.stream):
            for step in steps:
                step()
        self._thread = threading.Thread(target=self._loop, name="device-holder-pass", daemon=True)

    def begin(self) -> None:
        self._thread.start()

    def _loop(self) -> None:
        from collections import deque

        pending: deque = deque()
        try:
            with torch.cuda.device(self.stream.device), torch.cuda.stream(self.stream):
                while not self._halt.is_set():
                    if len(pending) >= self.ahead:
                        pending.popleft().synchronize()
                    self.graph.replay()
                    ev = torch.cuda.Event()
                    ev.record(self.stream)
                    pending.append(ev)
                    self.replays += 1
        except BaseException as exc:  # noqa: BLE001  (reported by end())
            self.failure = exc

    def end(self, timeout_s: float) -> None:
        self._halt.set()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise TimeoutError(f"device holder: the pass did not stop within {timeout_s} s")
        if self.failure is not None:
            raise RuntimeError(f"device holder: the pass failed: {self.failure}") from self.failure
