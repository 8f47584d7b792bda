"""Benchmark the holder's partial absorbed-MLA attention (§6.3): dense paged, sparse top-k, and the
holder fan-in sweep.

``python -m perf.bench_mla [--goals | --tiny] [--only dense,sparse,fanin] [--kv-dtype
bf16|fp8|both]`` with the flags every benchmark takes (``--quick --reps --warmup --out FILE |
--record --check``, :mod:`mqnc.measure.options`).

- ``mla_decode``: B query tokens x H heads, each token over its own ct-entry cache (page 64):
  B in {1, 8, 64}, ct in {2048, 8192, 32768}, H in {16, 128};
- ``mla_sparse``: one query token, top-k in {512, 1024, 2048} entries drawn at random from a
  corpus of 2K..32K entries, H in {16, 128};
- ``mla_fanin`` (§6.3): N routed requesters (N in 1..256, one query token each) batched into one
  call over the same ct = 2048 chunk the holder holds, H in {16, 128}.

``--goals`` sweeps instead the production goal shapes (``mqnc.triton_kernels.sm90.variants.GOALS``:
dense H 16 / 128 x B 1..128 x c_t 2048..65536, sparse top-2048 at H 16 / 128, B 1 / 8), one
record per shape with ``extra.shape`` set to the shape's label, which
``mqnc/measure/kernel_report.py --measured`` joins to its predictions (one GPU run answers each
goal).
``--tiny`` (``perf/gpu_check.sh --dry-run``) takes the first goal shape of each op cut to
B <= 2 and 128 entries and runs the Triton kernels even without a GPU (interpreted).

Tile sweeps (kernel tuning): ``--tiles 32x32w8s5,64x16w16s5`` times every goal shape once per
tile (``HxNwWsS``: heads x entries per tile, warps, stages, optionally ``-pipe`` / ``-tma`` and
``-fused``, the restructured kernels of docs/kernel-schedule.md; ``mla.plan.forced_tile``), the
variant named ``H=..,B=..@<tile>`` and ``extra.tile`` set; each tile's output on the first input
set is first compared with the default tile's (``extra.vs_default``: max |o - o_default| over
max |o_default|, max |lse - lse_default|; a tile off by more than 2^-6 or 1e-3, or not finite,
is printed MISMATCH and recorded ``ok: false``). ``--shapes "H=128 B=8,H=128 B=64 ct=8192"``
keeps the goal shapes whose label contains one of the comma-separated parts;
``--dense-shapes "H=128 B=128 ct=4096"`` adds dense shapes that are not goal shapes. With
``--tiles`` each tile is also checked against fp64 once per op and head count on a small case
(``extra.vs_fp64``; ``ok`` is false when either check fails). Goal-shape records carry
``extra.flops`` (``2 B H c_t (576 + 512)``) and ``extra.tflops`` at their p50.

Timing (``mqnc.measure.time_kernel``, recorded as ``extra.timing``): on a GPU the kernel calls,
checks off (``check_inputs=False``), over enough input sets (pool, table, queries) that one pass
moves twice the 60 MB L2, captured in one CUDA graph and replayed between CUDA events; the
host cost of a call is recorded beside it (``extra.timing.host_us``).

Bytes read once (for GB/s): the distinct cache entries (``x 576 x elt``; the fan-in's N rows
share one chunk), the query rows and the written partials (``o`` + fp32 ``lse``). On a GPU it
times the Triton kernels in bf16 (the goals, perf/speed_targets.py: >= 80% of the copy ceiling for
memory-bound dense shapes, the fan-in partial at N <= 16 in <= 15 us (H 16) / <= 30 us (H 128),
the sparse top-2048 H 128 partial in <= 30 us). On the CPU it times a torch fp32 implementation
of the same math (``backend=torch-reference``; interpreter timings say nothing about the
kernel) and skips shapes whose gathered cache exceeds ~1 GiB.

The cache format (``--kv-dtype``): ``bf16`` (default; the CPU stand-in's fp32), ``fp8``
(DeepSeek-V3.2's 656-byte entries, docs/fp8-cache.md: the pool drawn as for bf16, then
quantized, by the Triton quantizer where the kernels run, else by its fp64 reference, the same
bytes; the kernels read it in place, the CPU stand-in dequantizes the gathered entries) or
``both`` (each point in bf16 and right after in FP8: the twins the FP8 goals compare,
perf/speed_targets.py ``FP8_TARGETS``). Every record carries ``extra.kv_dtype`` (``bf16``,
``fp32``, ``fp8``), ``extra.entry_bytes`` (1152, 2304, 656), ``extra.cache_tokens`` (distinct
entries a call reads: B x c_t, B x top-k, the fan-in's one chunk) and ``extra.tokens_per_s``
at the p50; its bytes count the cache at ``entry_bytes`` per entry. FP8 records' variants end
in ``,fp8`` and goal records' ``extra.shape`` is the FP8 shape's label (``... fp8``,
:func:`fp8_label`). ``--tiles`` sweeps bf16 only (refused with FP8: its tiles are not swept).
"""

from __future__ import annotations

import dataclasses
import itertools
import math

from mqnc.base.runtime import use_interpreter_without_cuda
from mqnc.measure.options import bench_parser, choice_list, finish, parse_bench_args
from mqnc.model.kv_format import kv_bytes_per_token
from perf.speed_targets import TARGETS

D_QK, D_V = 576, 512
FP8_ENTRY = kv_bytes_per_token("fp8_e4m3", D_V, D_QK - D_V)  # 656 B: DeepSeek-V3.2's entry
KV_DTYPES = {"bf16": ("bf16",), "fp8": ("fp8",), "both": ("bf16", "fp8")}
SCALE = 192**-0.5 * (0.1 * 0.707 * math.log(40) + 1) ** 2  # DeepSeek-V2-Lite with YaRN
CPU_MAX_GATHER = 1 << 30  # bytes of gathered fp32 cache the CPU path may build
TINY_B, TINY_CT = 2, 128  # --tiny: the dry run's cut of a goal shape


def tiny_goals(ops) -> list:
    """The first goal shape of each op in ``ops``, cut to B <= 2 and ct <= 128 (--tiny)."""
    from mqnc.triton_kernels.sm90.variants import GOALS

    out = {}
    for s in GOALS:
        if s.op in ops and s.op not in out:
            out[s.op] = dataclasses.replace(s, B=min(s.B, TINY_B), ct=min(s.ct, TINY_CT))
    return list(out.values())


def _torch_partial(q, kv, valid):
    """fp32 torch partial attention: ``q [B, H, d]``, ``kv [B, N, d]`` (or FP8 entries
    ``[B, N, 656]`` uint8, dequantized first), ``valid [B, N]``."""
    import torch

    kv = _rows(kv)
    s = torch.einsum("bhd,bnd->bhn", q.float(), kv) * SCALE
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None])
    return torch.einsum("bhn,bnd->bhd", p, kv[..., :D_V]).to(q.dtype), lse


def _randn(shape, dev, dtype, gen):
    """N(0, 1) in ``dtype`` on ``dev``: drawn on the device there (goal pools reach ~10 GB)."""
    import torch

    if str(dev) != "cpu":
        return torch.empty(shape, device=dev, dtype=dtype).normal_()
    return torch.randn(shape, generator=gen).to(dtype)


def _as_cache(pool, kv: str, kernel: bool):
    """The pool in cache format ``kv``: as drawn (``"bf16"``: the 16-bit path, fp32 on the CPU
    stand-in), or its rows quantized to FP8 entries (``"fp8"``: ``[..., 656]`` uint8, by the
    Triton quantizer when the kernels run, else by its torch backend, bit-identical)."""
    if kv != "fp8":
        return pool
    if kernel:
        from mqnc.triton_kernels.fp8.quant import fp8_quantize

        return fp8_quantize(pool, D_V)
    from mqnc.reference.fp8_ref import fp8_quantize_reference

    return fp8_quantize_reference(pool, D_V)


def _rows(kv):
    """The gathered cache ``kv [..., 576 | 656]`` as fp32 rows (FP8 entries dequantized)."""
    import torch

    if kv.dtype != torch.uint8:
        return kv.float()
    from mqnc.reference.fp8_ref import fp8_dequantize_reference

    return fp8_dequantize_reference(kv, D_V, D_QK - D_V, torch.float32)


def _dense_case(B, H, ct, dev, dtype, shared_chunk, gen, kv="bf16", kernel=True):
    """Pool (cache format ``kv``), table and lengths for B rows of ct entries (own caches, or
    one shared chunk)."""
    import torch

    page = 64
    pages = math.ceil(ct / page)
    nblocks = pages if shared_chunk else B * pages
    pool = _as_cache(_randn((nblocks, page, D_QK), dev, dtype, gen), kv, kernel)
    if shared_chunk:
        table = torch.arange(pages, dtype=torch.int32).repeat(B, 1)
    else:
        table = torch.randperm(nblocks, generator=gen).to(torch.int32).view(B, pages)
    lens = torch.full((B,), ct, dtype=torch.int32)
    q = torch.randn(B, H, D_QK, generator=gen).to(device=dev, dtype=dtype)
    return q, pool, table.to(dev), lens.to(dev)


def _dense_fn(q, pool, table, lens, kernel):
    import torch

    from mqnc.triton_kernels import mla_decode_partial

    if kernel:
        return lambda: mla_decode_partial(
            q, pool, table, lens, softmax_scale=SCALE, check_inputs=False
        )
    page = pool.shape[1]
    ct = int(lens.max())
    t = torch.arange(ct)
    slots = table.long()[:, t // page] * page + (t % page)[None, :]
    flat = pool.reshape(-1, pool.shape[-1])
    valid = t[None, :] < lens[:, None].long()
    return lambda: _torch_partial(q, flat[slots], valid)


def _sparse_case(B, H, topk, corpus, dev, dtype, gen, kv="bf16", kernel=True):
    """Pool (cache format ``kv``) of ``corpus`` entries, queries and B rows of top-k indices."""
    import torch

    pool = _as_cache(_randn((corpus // 64, 64, D_QK), dev, dtype, gen), kv, kernel)
    q = torch.randn(B, H, D_QK, generator=gen).to(dev, dtype)
    idx = torch.stack([torch.randperm(corpus, generator=gen)[:topk] for _ in range(B)])
    return q, pool, idx.to(torch.int32).to(dev)


def _sparse_fn(q, pool, idx, kernel):
    import torch

    from mqnc.triton_kernels import mla_sparse_partial

    if kernel:
        return lambda: mla_sparse_partial(q, pool, idx, softmax_scale=SCALE, check_indices=False)
    kv = pool.reshape(-1, pool.shape[-1])
    valid = torch.ones(idx.shape, dtype=torch.bool)
    return lambda: _torch_partial(q, kv[idx.long()], valid)


def _nbytes(distinct_entries, rows, elt, kv="bf16"):
    """Bytes one call moves once: the distinct cache entries (``576 x elt``, or 656 for an FP8
    entry), the query rows (``576 x elt``) and the outputs (``o`` + fp32 ``lse``)."""
    entry = FP8_ENTRY if kv == "fp8" else D_QK * elt
    return distinct_entries * entry + rows * D_QK * elt + rows * (D_V * elt + 4)


TILE_O_TOL, TILE_LSE_TOL = 2.0**-6, 1e-3  # --tiles: a tile against the default tile


def _vs_default(got, ref) -> dict:
    """How far a tile's ``(o, lse)`` is from the default tile's on the same inputs."""
    import torch

    (o, lse), (o_ref, lse_ref) = got, ref
    finite = bool(torch.isfinite(o).all() and torch.isfinite(lse).all())
    o_err = float((o.float() - o_ref.float()).abs().max() / o_ref.float().abs().max())
    lse_err = float((lse.float() - lse_ref.float()).abs().max())
    ok = finite and o_err <= TILE_O_TOL and lse_err <= TILE_LSE_TOL
    return {"o_rel_max": o_err, "lse_max_abs": lse_err, "finite": finite, "ok": ok}


# --tiles: every tile is also checked against fp64 on one small case per (op, H): B 2 (sparse
# B 1) rows, a partial last page and a partial last tile at every tile size up to 64 entries.
SMALL_CT, SMALL_TOPK, SMALL_CORPUS = 200, 100, 512


def _vs_fp64(bench: str, H: int, dev, dtype, gen, kv: str = "bf16") -> dict:
    """The tile in force (``forced_tile``) on a small case of cache format ``kv`` against the
    fp64 references at the tolerance table's bounds (an FP8 cache: the references over its
    dequantized rows, ``("mla_fp8", dtype)``): ``{"o_max_abs", "lse_max_abs", "ok"}`` (and
    ``error``)."""
    from mqnc.reference.attention_ref import (
        dequantized_cache,
        mla_decode_reference,
        mla_sparse_reference,
    )
    from mqnc.testing import assert_close, tolerance

    def rows(pool):
        return (dequantized_cache(pool, D_V, dtype) if kv == "fp8" else pool).double()

    if bench == "mla_sparse":
        q, pool, idx = _sparse_case(1, H, SMALL_TOPK, SMALL_CORPUS, dev, dtype, gen, kv)
        got = _sparse_fn(q, pool, idx, True)()
        ref = mla_sparse_reference(q.double(), rows(pool), idx, SCALE)
    else:
        q, pool, table, lens = _dense_case(2, H, SMALL_CT, dev, dtype, False, gen, kv)
        got = _dense_fn(q, pool, table, lens, True)()
        ref = mla_decode_reference(q.double(), rows(pool), table, lens, SCALE)
    out = {"o_max_abs": None, "lse_max_abs": None, "ok": True}
    try:
        key = "mla_fp8" if kv == "fp8" else "mla"
        so = assert_close(got[0], ref[0], tolerance(key, dtype), name="o")
        sl = assert_close(got[1], ref[1], tolerance("mla_lse", "float32"), name="lse")
        out.update(o_max_abs=so.max_abs, lse_max_abs=sl.max_abs)
    except AssertionError as exc:
        out.update(ok=False, error=str(exc).splitlines()[0][:300])
    return out


def _tflops(flops: int, p50_us: float) -> float:
    """TFLOP/s of ``flops`` done in ``p50_us``."""
    return flops / (p50_us * 1e6)


def mla_flops(B: int, H: int, n: int) -> int:
    """FLOPs of one MLA call: per query row ``2 n (576 + 512)`` (``QK^T`` over the 576-wide
    keys and ``PV`` over the 512-wide values, a multiply-add counted as 2) over ``B H`` rows
    attending ``n`` entries each."""
    return 2 * B * H * n * (D_QK + D_V)


SWEEPS = ("dense", "sparse", "fanin")


def _tile_list(text: str) -> list:
    """``--tiles``: comma-separated ``HxNwWsS`` tiles (``TileConfig.parse``)."""
    import argparse

    from mqnc.triton_kernels.mla.plan import TileConfig

    try:
        tiles = [TileConfig.parse(t, "--tiles") for t in text.split(",") if t.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if not tiles:
        raise argparse.ArgumentTypeError(f"expected at least one tile, got {text!r}")
    return tiles


def _dense_shapes(text: str) -> list:
    """``--dense-shapes``: comma-separated ``H=.. B=.. ct=..`` dense shapes (FlashMLA's benchmark
    shape, H 128 B 128 c_t 4096, is not a goal shape), as ``sm90.variants.Shape``."""
    import argparse
    import re

    from mqnc.triton_kernels.sm90.variants import Shape

    out = []
    for part in (t.strip() for t in text.split(",") if t.strip()):
        m = re.fullmatch(r"H=(\d+)\s+B=(\d+)\s+ct=(\d+)", part)
        if m is None or min(int(g) for g in m.groups()) < 1:
            raise argparse.ArgumentTypeError(
                f"expected 'H=<heads> B=<tokens> ct=<entries>' (each >= 1), got {part!r}"
            )
        H, B, ct = (int(g) for g in m.groups())
        out.append(Shape("mla_decode", B=B, H=H, ct=ct))
    if not out:
        raise argparse.ArgumentTypeError(f"expected at least one shape, got {text!r}")
    return out


def _parser():
    """The command line: every benchmark's flags, then the sweeps, goals, tiles and shapes."""
    ap = bench_parser(
        __doc__,
        reps="20 on a GPU, 5 on a CPU, 2 with --tiny",
        warmup="3 on a GPU, 1 on a CPU, 0 with --tiny",
        tiny=True,
    )
    ap.add_argument(
        "--only",
        type=choice_list(SWEEPS),
        default="dense,sparse,fanin",
        help="comma list of sweeps out of dense, sparse, fanin",
    )
    ap.add_argument("--goals", action="store_true", help="the production goal shapes instead")
    ap.add_argument(
        "--kv-dtype",
        choices=tuple(KV_DTYPES),
        default="bf16",
        help="the cache format: bf16 (the 16-bit path; fp32 on the CPU stand-in), fp8 "
        "(DeepSeek-V3.2's 656-byte entry, docs/fp8-cache.md) or both (each shape in bf16, then "
        "in fp8: the twins the FP8 goals compare)",
    )
    ap.add_argument(
        "--tiles",
        type=_tile_list,
        default=None,
        help="comma list of tiles HxNwWsS[-pipe|-tma][-fused] (e.g. 32x32w8s5,64x64w8s2-tma): "
        "each goal shape per tile",
    )
    ap.add_argument(
        "--dense-shapes",
        type=_dense_shapes,
        default=[],
        help='dense shapes besides the goal shapes, e.g. "H=128 B=128 ct=4096" (comma list)',
    )
    ap.add_argument(
        "--shapes",
        type=lambda t: [x.strip() for x in t.split(",") if x.strip()],
        default=None,
        help='goal shapes whose label contains one of these comma-separated parts ("H=128 B=8")',
    )
    return ap


class _Runner:
    """What every shape shares: the device, dtype and backend, the timing settings, and the
    measuring and recording step (with ``--tiles``: once per tile, after checking the tile's
    output against the default tile's). Built after the interpreter choice (imports torch)."""

    def __init__(self, args) -> None:
        import torch

        from mqnc.measure import l2_bytes

        self.args = args
        self.cuda = cuda = torch.cuda.is_available()
        self.kernel = cuda or args.tiny  # the Triton kernels: compiled on a GPU, else interpreted
        self.dev = "cuda" if cuda else "cpu"
        self.dtype = torch.bfloat16 if self.kernel else torch.float32
        self.elt = torch.empty((), dtype=self.dtype).element_size()
        self.backend = "triton" if cuda else ("interpreter" if self.kernel else "torch-reference")
        self.reps = args.reps or (20 if cuda else (2 if args.tiny else 5))
        self.warmup = args.warmup
        if self.warmup is None:
            self.warmup = 0 if args.tiny else (3 if cuda else 1)
        self.gen = torch.Generator().manual_seed(0)
        self.l2 = l2_bytes(self.dev)
        self.fp64: dict[tuple, dict] = {}  # --tiles: each tile against fp64, once per op and H
        self.formats = KV_DTYPES[args.kv_dtype]

    def kv_extra(self, kv: str, cache_tokens: int) -> dict:
        """The record fields of cache format ``kv``: ``kv_dtype`` (``"fp8"``, or the 16-bit
        path's dtype, ``"bf16"``; ``"fp32"`` on the CPU stand-in), ``entry_bytes`` (656, 1152)
        and ``cache_tokens``, the distinct entries a call reads (``timed`` adds
        ``tokens_per_s`` at the p50)."""
        if kv == "fp8":
            return {"kv_dtype": "fp8", "entry_bytes": FP8_ENTRY, "cache_tokens": cache_tokens}
        name = {2: "bf16", 4: "fp32"}[self.elt]
        return {"kv_dtype": name, "entry_bytes": D_QK * self.elt, "cache_tokens": cache_tokens}

    def too_big(self, entries) -> bool:
        """Whether the CPU path's gathered cache of ``entries`` would exceed its cap."""
        return not self.cuda and entries * D_QK * 4 > CPU_MAX_GATHER

    def run(self, bench, variant, x, x_name, make, nbytes, extra) -> None:
        """Time one shape over enough input sets (``make()`` each) and record it."""
        from mqnc.measure import input_sets

        calls = [make() for _ in range(input_sets(nbytes, self.l2))]
        if self.kernel and extra.get("kv_dtype") == "fp8":  # new kernels: checked before timing
            extra = {**extra, **self.fp8_check(bench, extra["H"])}
        if not self.args.tiles:
            return self.timed(bench, variant, x, x_name, calls, nbytes, extra)
        from mqnc.triton_kernels.mla.plan import forced_tile

        ref = calls[0]()  # the default tile's (the calls plan their tile at each call)
        for tile in self.args.tiles:
            with forced_tile(tile, sparse=bench == "mla_sparse"):
                vs = _vs_default(calls[0](), ref)
                key = (bench, extra.get("H"), tile.label)
                if key not in self.fp64:  # once per op, head count and tile
                    self.fp64[key] = _vs_fp64(bench, extra["H"], self.dev, self.dtype, self.gen)
                    if not self.fp64[key]["ok"]:
                        print(
                            f"MISMATCH vs fp64 {bench} H={key[1]} @{tile.label}: {self.fp64[key]}"
                        )
                fp64 = self.fp64[key]
                ok = vs["ok"] and fp64["ok"]
                more = {**extra, "tile": tile.label, "vs_default": vs, "vs_fp64": fp64, "ok": ok}
                self.timed(bench, f"{variant}@{tile.label}", x, x_name, calls, nbytes, more)
            if not vs["ok"]:
                print(f"MISMATCH {bench} {variant}@{tile.label}: {vs}")

    def fp8_check(self, bench: str, H: int) -> dict:
        """The FP8 kernel of ``bench`` at ``H`` heads on a small case against fp64 over the
        dequantized cache, once per op and head count: ``{"vs_fp64": ..., "ok": ...}`` for the
        records (printed MISMATCH when off; an FP8 goal is missed on a record not ``ok``)."""
        key = (bench, H, "fp8")
        if key not in self.fp64:
            self.fp64[key] = _vs_fp64(bench, H, self.dev, self.dtype, self.gen, "fp8")
            if not self.fp64[key]["ok"]:
                print(f"MISMATCH vs fp64 {bench} H={H} fp8: {self.fp64[key]}")
        return {"vs_fp64": self.fp64[key], "ok": self.fp64[key]["ok"]}

    def timed(self, bench, variant, x, x_name, calls, nbytes, extra) -> None:
        """Time ``calls`` and append the record to ``--out``."""
        from mqnc.measure import record, time_kernel

        t = time_kernel(
            calls, working_set_bytes=nbytes, warmup=self.warmup, reps=self.reps, cuda=self.cuda,
            checks="off" if self.kernel else "n/a",
        )  # fmt: skip
        if "flops" in extra:
            extra = {**extra, "tflops": _tflops(extra["flops"], t.p50)}
        if "cache_tokens" in extra:
            extra = {**extra, "tokens_per_s": extra["cache_tokens"] / (t.p50 * 1e-6)}
        rec = record(
            bench,
            variant,
            x,
            t.percentiles,
            x_name=x_name,
            nbytes=nbytes,
            backend=self.backend,
            path=self.args.out,
            extra={**extra, "dtype": str(self.dtype)[6:], "timing": t.how},
        )
        rate = f", {extra['tflops']:.1f} TFLOP/s" if "tflops" in extra else ""
        if "tokens_per_s" in extra:
            rate += f", {extra['tokens_per_s'] / 1e9:.3g} G cache tokens/s"
        print(f"{bench} {variant} {x_name}={x}: p50 {t.p50:.1f} us ({rec['gbps']:.1f} GB/s{rate})")


def fp8_label(shape) -> str:
    """The label an FP8 record of goal shape ``shape`` carries in ``extra.shape``: the FP8
    shape's (``Shape.fp8``: the goal's label with `` fp8``), as the kernel report's FP8 rows."""
    return dataclasses.replace(shape, fp8=True).label


def _goals(r: _Runner, only, shapes) -> None:
    """One record per goal shape of the dense and sparse ops (``sm90.variants.GOALS``) and cache
    format (``--kv-dtype``; FP8 records labelled :func:`fp8_label`, variant ``...,fp8``)."""
    sweep = {"mla_decode": "dense", "mla_sparse": "sparse"}
    for shape in shapes:
        if sweep.get(shape.op) not in only:
            continue
        if shape.op == "mla_decode" and r.too_big(shape.B * shape.ct):
            print(f"{shape.label}: skipped on CPU (gather too big)")
            continue
        for kv in r.formats:
            _goal(r, shape, kv)


def _goal(r: _Runner, shape, kv: str) -> None:
    """Time goal ``shape`` over a cache of format ``kv`` and record it."""
    from mqnc.triton_kernels.mla.plan import tile_config

    dev, dtype, elt, kernel, gen = r.dev, r.dtype, r.elt, r.kernel, r.gen
    B, H, n = shape.B, shape.H, shape.ct
    fp8 = kv == "fp8"
    label = fp8_label(shape) if fp8 else shape.label
    extra = {"B": B, "H": H, "page": 64, "shape": label, "goal": "" if fp8 else shape.goal}
    extra["flops"] = mla_flops(B, H, n)
    if kernel:  # the tile the launcher chose here (it depends on the triton version)
        sparse = shape.op == "mla_sparse"
        extra["launcher_tile"] = tile_config(H, sparse=sparse, dtype=dtype, fp8=fp8).label
    extra.update(r.kv_extra(kv, B * n))
    variant = f"H={H},B={B}{_suffix(kv)}"
    nbytes = _nbytes(B * n, B * H, elt, kv)
    if shape.op == "mla_decode":

        def make():
            return _dense_fn(*_dense_case(B, H, n, dev, dtype, False, gen, kv, kernel), kernel)

        r.run("mla_decode", variant, n, "ct", make, nbytes, extra)
        return
    corpus = max(32768 if kernel and dev != "cpu" else 4 * n, n)

    def make():
        return _sparse_fn(*_sparse_case(B, H, n, corpus, dev, dtype, gen, kv, kernel), kernel)

    extra["corpus"] = corpus
    r.run("mla_sparse", variant, n, "topk", make, nbytes, extra)


def _goal_shapes(ap, args) -> list:
    """The goal shapes to time: ``GOALS`` (``--tiny``: cut), kept by ``--shapes``."""
    from mqnc.triton_kernels.sm90.variants import GOALS

    shapes = tiny_goals(("mla_decode", "mla_sparse")) if args.tiny else GOALS
    if args.shapes:
        shapes = [s for s in shapes if any(part in s.label for part in args.shapes)]
        if not shapes:
            ap.error(f"--shapes: expected parts of goal shape labels, got {args.shapes}")
    return [*shapes, *args.dense_shapes]


def _dense_sweep(r: _Runner, heads, quick: bool) -> None:
    """``mla_decode``: B tokens x H heads, each over its own ct-entry cache (each format)."""
    Bs = [1, 8, 64] if not quick else [1, 8]
    cts = [2048, 8192, 32768] if not quick else [2048]
    for H, B, ct, kv in itertools.product(heads, Bs, cts, r.formats):
        if r.too_big(B * ct):
            print(f"mla_decode H={H} B={B} ct={ct}: skipped on CPU (gather too big)")
            continue

        def make(B=B, H=H, ct=ct, kv=kv):
            case = _dense_case(B, H, ct, r.dev, r.dtype, False, r.gen, kv, r.kernel)
            return _dense_fn(*case, r.kernel)

        extra = {"B": B, "H": H, "page": 64, **r.kv_extra(kv, B * ct)}
        nbytes = _nbytes(B * ct, B * H, r.elt, kv)
        r.run("mla_decode", f"H={H},B={B}{_suffix(kv)}", ct, "ct", make, nbytes, extra)


def _sparse_sweep(r: _Runner, heads, quick: bool) -> None:
    """``mla_sparse``: one token's top-k entries drawn from a corpus (each format)."""
    topks = [512, 1024, 2048] if not quick else [512, 2048]
    corpora = [2048, 8192, 32768] if not quick else [8192]
    for H, corpus, topk, kv in itertools.product(heads, corpora, topks, r.formats):
        if topk > corpus:
            continue

        def make(H=H, topk=topk, corpus=corpus, kv=kv):
            case = _sparse_case(1, H, topk, corpus, r.dev, r.dtype, r.gen, kv, r.kernel)
            return _sparse_fn(*case, r.kernel)

        extra = {"H": H, "corpus": corpus, "B": 1, **r.kv_extra(kv, topk)}
        nbytes = _nbytes(topk, H, r.elt, kv)
        variant = f"H={H},corpus={corpus}{_suffix(kv)}"
        r.run("mla_sparse", variant, topk, "topk", make, nbytes, extra)


def _fanin_sweep(r: _Runner, heads, quick: bool) -> None:
    """``mla_fanin`` (§6.3): N routed requesters batched into one call over one chunk (each
    format; the N rows read one chunk: ``cache_tokens`` is its ct entries)."""
    Ns = [1, 2, 4, 8, 16, 32, 64, 128, 256] if not quick else [1, 8, 64]
    ct = 2048
    for H, N, kv in itertools.product(heads, Ns, r.formats):
        if r.too_big(N * ct):
            print(f"mla_fanin H={H} N={N}: skipped on CPU (gather too big)")
            continue

        def make(N=N, H=H, kv=kv):
            case = _dense_case(N, H, ct, r.dev, r.dtype, True, r.gen, kv, r.kernel)
            return _dense_fn(*case, r.kernel)

        extra = {"H": H, "ct": ct, "page": 64, **r.kv_extra(kv, ct)}
        nbytes = _nbytes(ct, N * H, r.elt, kv)
        r.run("mla_fanin", f"H={H},ct={ct}{_suffix(kv)}", N, "N", make, nbytes, extra)


def _suffix(kv: str) -> str:
    """What a record's variant gains for cache format ``kv``: ``,fp8`` for FP8, else nothing."""
    return ",fp8" if kv == "fp8" else ""


def main(argv=None) -> int:
    ap = _parser()
    args = parse_bench_args(ap, argv)
    if (args.tiles or args.shapes or args.dense_shapes) and not (args.goals or args.tiny):
        ap.error("--tiles, --shapes and --dense-shapes: expected with --goals or --tiny")
    if args.tiles and args.kv_dtype != "bf16":
        ap.error(
            f"--tiles: expected --kv-dtype bf16 (FP8 tiles are not swept), got {args.kv_dtype}"
        )
    use_interpreter_without_cuda()
    r = _Runner(args)
    only = set(args.only)
    if args.goals or args.tiny:
        _goals(r, only, _goal_shapes(ap, args))
        return finish(args, TARGETS)
    heads = [16, 128] if not args.quick else [16]
    if "dense" in only:
        _dense_sweep(r, heads, args.quick)
    if "sparse" in only:
        _sparse_sweep(r, heads, args.quick)
    if "fanin" in only:
        _fanin_sweep(r, heads, args.quick)
    return finish(args, TARGETS)


if __name__ == "__main__":
    raise SystemExit(main())
