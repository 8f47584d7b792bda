"""The production shapes (the goal shapes the kernels are held to on an H200, and the layouts
the ecosystem adapters launch) and the launches the kernels make there.

One list of goal shapes serves the sm_90 compile test, the checked-in occupancy table
(``sm90.table``), ``mqnc/measure/kernel_report.py`` and the benchmarks' ``--goals`` sweeps, so that
what is compiled, predicted and measured is the same thing. The launches are planned by the
launchers' own planning functions (``plan_decode``, ``plan_sparse``, ``merge_launch``,
``splice_launch``) on real tensors of the production geometry (DeepSeek-V2-Lite: bf16,
576 = 512 + 64 entries, pages of 64, 27 layers); only the cache pools are cut to a few blocks
(their strides, all that the compile sees of them, do not depend on the block count).

:data:`ECOSYSTEM` adds the layouts of the FlashMLA / FlashInfer / SGLang / vLLM adapters (page
size 1 and CSR page tables, split ``ckv`` / ``kpe`` caches, ``s_q`` query tokens per sequence,
causal, per-layer splice, masked base-2 merge) at production sizes, :data:`FP8` the FP8 cache's
shapes (``Shape.fp8``: DeepSeek-V3.2's 656-byte entries): compiled and checked for spills with
the goals (:data:`COMPILED`), not predicted or benchmarked as goals.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from mqnc.triton_kernels._core.launch import Launch

__all__ = [
    "Shape",
    "GOALS",
    "ECOSYSTEM",
    "FP8",
    "COMPILED",
    "shape_launches",
    "Variant",
    "production_variants",
]

D_QK, D_V, PAGE, LAYERS = 576, 512, 64, 27
DTYPE = torch.bfloat16
# DeepSeek-V2-Lite's softmax scale with YaRN (factor 40, mscale 0.707): 192^-0.5 * mscale^2.
SCALE = 192**-0.5 * (0.1 * 0.707 * math.log(40) + 1) ** 2


@dataclasses.dataclass(frozen=True)
class Shape:
    """One goal shape. ``op``: ``mla_decode`` (B tokens x H heads over ``ct`` entries each),
    ``mla_sparse`` (top-``ct``), ``merge`` (M partials of B x H rows), ``splice`` (``L`` layers
    x ``ct`` tokens), ``rotate`` (B x H query rows); ``delta``: ``int`` or ``[T]`` (per token).

    Layouts (the adapters'; the goals use the defaults): ``page`` size, ``csr`` page table,
    ``split`` latent / rope tensors, ``s_q`` query tokens per sequence (``B`` sequences),
    ``causal``; a splice into ``layers="list"`` (one cache per layer); a merge with a ``mask``
    and base-2 lse (``base2``); an MLA cache and query ``dtype`` other than bf16 (a torch dtype
    name); ``fp8``: the cache holds FP8 entries (656 B, ``mqnc.model.kv_format``; the query
    stays ``dtype``)."""

    op: str
    B: int = 1
    H: int = 16
    ct: int = 0
    M: int = 0
    L: int = 0
    delta: str = "int"
    goal: str = ""
    page: int = PAGE
    csr: bool = False
    split: bool = False
    s_q: int = 1
    causal: bool = False
    layers: str = "stacked"
    mask: bool = False
    base2: bool = False
    dtype: str = "bfloat16"
    fp8: bool = False

    @property
    def label(self) -> str:
        extra = "".join(
            f" {flag}"
            for flag, on in (
                (f"page={self.page}", self.page != PAGE),
                ("csr", self.csr),
                ("split", self.split),
                (f"s_q={self.s_q}", self.s_q > 1),
                ("causal", self.causal),
                ("layers=list", self.layers != "stacked"),
                ("mask", self.mask),
                ("base2", self.base2),
                (self.dtype, self.dtype != "bfloat16"),
                ("fp8", self.fp8),
            )
            if on
        )
        if self.op in ("mla_decode", "mla_sparse"):
            what = "ct" if self.op == "mla_decode" else "topk"
            return f"{self.op} H={self.H} B={self.B} {what}={self.ct}{extra}"
        if self.op == "merge":
            return f"merge M={self.M} rows={self.B * self.H}{extra}"
        if self.op == "splice":
            return f"splice L={self.L} ct={self.ct} delta={self.delta}{extra}"
        return f"rotate rows={self.B * self.H} delta={self.delta}{extra}"


def _goals() -> tuple[Shape, ...]:
    shapes = []
    for H in (16, 128):
        for B in (1, 2, 4, 8, 16, 32, 64, 128):
            for ct in (2048, 8192, 32768, 65536):
                goal = ">= 80% of the copy ceiling"
                if (H, B, ct) == (16, 1, 2048):
                    goal = "holder partial <= 15 us"
                shapes.append(Shape("mla_decode", B=B, H=H, ct=ct, goal=goal))
    for H in (16, 128):
        for B in (1, 8):
            goal = "<= 30 us" if (H, B) == (128, 1) else ""
            shapes.append(Shape("mla_sparse", B=B, H=H, ct=2048, goal=goal))
    shapes.append(Shape("merge", B=16, H=16, M=8, goal="<= 8 us"))
    shapes.append(Shape("merge", B=16, H=16, M=2, goal="two-way fold"))
    shapes.append(Shape("splice", ct=2048, L=LAYERS, delta="int", goal="<= 60 us"))
    shapes.append(Shape("splice", ct=2048, L=LAYERS, delta="[T]"))
    shapes.append(Shape("rotate", B=16, H=16, delta="int"))
    shapes.append(Shape("rotate", B=16, H=16, delta="[T]"))
    return tuple(shapes)


GOALS = _goals()


def _ecosystem() -> tuple[Shape, ...]:
    dense = dict(op="mla_decode", ct=2048)
    return (
        # SGLang's token pool (page 1) and FlashInfer's CSR table, fused cache
        Shape(**dense, B=8, H=16, page=1, csr=True),
        # FlashInfer's MLA layout: CSR, page 1, split ckv / kpe and q_nope / q_pe
        Shape(**dense, B=8, H=16, page=1, csr=True, split=True),
        Shape(**dense, B=8, H=128, page=1, csr=True, split=True),
        # split caches behind a padded table (vLLM-style pages of 16)
        Shape(**dense, B=8, H=16, page=16, split=True),
        # FlashMLA's MTP: s_q = 2 tokens per sequence, causal, pages of 64
        Shape(**dense, B=4, H=16, s_q=2, causal=True),
        Shape(**dense, B=4, H=128, s_q=2, causal=True),
        # sparse over a split cache
        Shape("mla_sparse", B=1, H=128, ct=2048, split=True),
        # fp32 caches (their own tile: the 16-bit ones exceed sm_90's shared memory or spill)
        Shape(**dense, B=4, H=16, dtype="float32"),
        Shape(**dense, B=4, H=128, dtype="float32"),
        Shape("mla_sparse", B=1, H=128, ct=2048, dtype="float32"),
        # FlashInfer's merge_state_in_place: masked, base-2 lse
        Shape("merge", B=16, H=16, M=2, mask=True, base2=True),
        # the splice into one cache per layer (vLLM / SGLang)
        Shape("splice", ct=2048, L=LAYERS, delta="int", layers="list"),
    )


ECOSYSTEM = _ecosystem()


def _fp8() -> tuple[Shape, ...]:
    """The FP8 cache's shapes (DeepSeek-V3.2's 656-byte entries, bf16 queries): dense at 16, 64
    and 128 heads, sparse top-2048 at 64 and 128 (the FP8 GPU goals' shapes among them: H 16
    B 16 c_t 32768, sparse H 128 B 8), and the adapters' layouts over FP8 entries."""
    dense = dict(op="mla_decode", fp8=True)
    sparse = dict(op="mla_sparse", ct=2048, fp8=True)
    return (
        Shape(**dense, B=1, H=16, ct=2048),
        Shape(**dense, B=16, H=16, ct=32768),
        Shape(**dense, B=8, H=64, ct=8192),
        Shape(**dense, B=8, H=128, ct=32768),
        Shape(**dense, B=64, H=128, ct=8192),
        Shape(**sparse, B=1, H=64),
        Shape(**sparse, B=1, H=128),
        Shape(**sparse, B=8, H=128),
        # FlashInfer's split ckv (latent + scales, uint8) / kpe (bf16), CSR, page 1
        Shape(**dense, B=8, H=16, ct=2048, page=1, csr=True, split=True),
        # FlashMLA's MTP over its FP8 cache: s_q = 2, causal
        Shape(**dense, B=4, H=128, ct=2048, s_q=2, causal=True),
        Shape(**sparse, B=1, H=128, split=True),
    )


FP8 = _fp8()
COMPILED = GOALS + ECOSYSTEM + FP8


@dataclasses.dataclass(frozen=True)
class _Rope:
    """DeepSeek's plain RoPE frequencies (the compile sees only the table's dtype)."""

    rope_dim: int = 64
    layout: str = "interleaved"

    @property
    def inv_freq(self) -> tuple[float, ...]:
        return tuple(10000.0 ** (-2 * i / self.rope_dim) for i in range(self.rope_dim // 2))


def _mla_inputs(shape: Shape, device):
    """Query rows and a (fused or split) cache of the shape's layout, as a launcher takes them:
    ``(q, kv_pool, q_pe, kpe_pool)``."""
    rows = shape.B * shape.s_q
    dtype = getattr(torch, shape.dtype)
    page = shape.page
    blocks = max(2, 128 // page)  # a few pages (the compile sees strides only)
    if shape.fp8:  # FP8 entries (uint8): latent + scales, and the bf16 RoPE part (fused or kpe)
        latent = D_V + 4 * (D_V // 128)
        width = latent if shape.split else latent + 2 * (D_QK - D_V)
        kv = torch.zeros(blocks, page, width, dtype=torch.uint8, device=device)
        if not shape.split:
            return torch.zeros(rows, shape.H, D_QK, dtype=dtype, device=device), kv, None, None
        kpe = torch.zeros(blocks, page, D_QK - D_V, dtype=torch.bfloat16, device=device)
        q = torch.zeros(rows, shape.H, D_V, dtype=dtype, device=device)
        return q, kv, torch.zeros(rows, shape.H, D_QK - D_V, dtype=dtype, device=device), kpe
    if not shape.split:
        q = torch.zeros(rows, shape.H, D_QK, dtype=dtype, device=device)
        return q, torch.zeros(blocks, page, D_QK, dtype=dtype, device=device), None, None
    q = torch.zeros(rows, shape.H, D_V, dtype=dtype, device=device)
    q_pe = torch.zeros(rows, shape.H, D_QK - D_V, dtype=dtype, device=device)
    ckv = torch.zeros(blocks, page, D_V, dtype=dtype, device=device)
    kpe = torch.zeros(blocks, page, D_QK - D_V, dtype=dtype, device=device)
    return q, ckv, q_pe, kpe


def _operands(q, kv, q_pe, kpe):
    from mqnc.triton_kernels.mla.plan import mla_operands

    return mla_operands(q, kv, D_V, q_pe=q_pe, kpe_pool=kpe)


def _decode_launches(shape: Shape, occupancy, device) -> list[Launch]:
    """``mla_decode``: the attention launch, then the combine when split."""
    from mqnc.triton_kernels.mla.decode import PagedLayout, plan_decode

    q, kv, q_pe, kpe = _mla_inputs(shape, device)
    ops = _operands(q, kv, q_pe, kpe)
    lens = torch.full((shape.B,), shape.ct, dtype=torch.int32, device=device)
    pages = math.ceil(shape.ct / shape.page)
    layout = PagedLayout(csr=shape.csr, s_q=shape.s_q, causal=shape.causal)
    if shape.csr:
        table = torch.zeros(shape.B * pages, dtype=torch.int32, device=device)
        indptr = torch.arange(0, shape.B + 1, dtype=torch.int32, device=device) * pages
    else:
        table = torch.zeros(shape.B, pages, dtype=torch.int32, device=device)
        indptr = None
    plan = plan_decode(
        q,
        kv,
        table,
        lens,
        SCALE,
        D_V,
        None,
        occupancy,
        ops=ops,
        indptr=indptr,
        layout=layout,
        max_kv_len=shape.ct,
    )
    return list(plan.launches)


def _sparse_launches(shape: Shape, occupancy, device) -> list[Launch]:
    """``mla_sparse``: the attention launch over top-``ct`` indices, then the combine when split."""
    from mqnc.triton_kernels.mla.sparse import plan_sparse

    q, kv, q_pe, kpe = _mla_inputs(shape, device)
    idx = torch.zeros(shape.B, shape.ct, dtype=torch.int32, device=device)
    ops = _operands(q, kv, q_pe, kpe)
    return list(plan_sparse(q, kv, idx, SCALE, D_V, None, occupancy, ops=ops).launches)


def _merge_launches(shape: Shape, device) -> list[Launch]:
    """``merge``: one launch folding M partials."""
    from mqnc.triton_kernels.merge.partials import merge_launch

    o = torch.zeros(shape.M, shape.B, shape.H, D_V, dtype=DTYPE, device=device)
    lse = torch.zeros(shape.M, shape.B, shape.H, device=device)
    mask = torch.ones(shape.B, dtype=torch.bool, device=device) if shape.mask else None
    out = (o[0].clone(), lse[0].clone())
    return [merge_launch(o, lse, *out, mask=mask, base2=shape.base2)]


def _splice_launches(shape: Shape, rope: _Rope, freq, device) -> list[Launch]:
    """``splice``: one launch into a stacked cache or one cache per layer."""
    from mqnc.triton_kernels.splice.rotate import layer_align, splice_launch

    T, L = shape.ct, shape.L
    chunk = torch.zeros(L, T, D_QK, dtype=DTYPE, device=device)
    nb = 2 * math.ceil(T / PAGE)
    slots = torch.arange(T, device=device)
    delta = torch.zeros(T, dtype=torch.int64, device=device) if shape.delta != "int" else 7
    if shape.layers == "list":
        caches = [torch.zeros(nb, PAGE, D_QK, dtype=DTYPE, device=device) for _ in range(L)]
        dst, offsets = caches[0], torch.zeros(L, dtype=torch.int64, device=device)
        strides_dst = (0, dst.stride(0), dst.stride(1))
        unit = layer_align(dst, caches)
    else:
        dst = torch.zeros(L, nb, PAGE, D_QK, dtype=DTYPE, device=device)
        offsets, strides_dst = None, (dst.stride(0), dst.stride(1), dst.stride(2))
        unit = 1
    launch = splice_launch(
        chunk,
        dst,
        slots,
        delta,
        freq,
        T,
        L,
        PAGE,
        (chunk.stride(0), chunk.stride(1)),
        strides_dst,
        rope,
        layer_offsets=offsets,
        layer_unit=unit,
    )
    return [launch]


def _rotate_launches(shape: Shape, rope: _Rope, freq, device) -> list[Launch]:
    """``rotate``: the splice kernel rotating B x H query rows in place of a cache."""
    from mqnc.triton_kernels.splice.rotate import splice_launch

    x = torch.zeros(shape.B * shape.H, D_QK, dtype=DTYPE, device=device)
    out = torch.empty_like(x)
    n = x.shape[0]
    delta = torch.zeros(n, dtype=torch.int64, device=device) if shape.delta != "int" else -7
    return [
        splice_launch(
            x, out, None, delta, freq, n, 1, 1, (0, x.stride(0)), (0, out.stride(0), 0), rope
        )
    ]


def shape_launches(shape: Shape, occupancy=None, device="cpu") -> list[Launch]:
    """The launches the op makes at ``shape``, in order (an MLA call: attention, then the
    combine when split), planned at ``occupancy`` (default: the launchers' own, see
    ``_core.grid.kernel_occupancy``)."""
    device = torch.device(device)
    if shape.op == "mla_decode":
        return _decode_launches(shape, occupancy, device)
    if shape.op == "mla_sparse":
        return _sparse_launches(shape, occupancy, device)
    if shape.op == "merge":
        return _merge_launches(shape, device)
    rope = _Rope()
    freq = torch.tensor(rope.inv_freq, dtype=torch.float64, device=device)
    if shape.op == "splice":
        return _splice_launches(shape, rope, freq, device)
    return _rotate_launches(shape, rope, freq, device)


@dataclasses.dataclass(frozen=True)
class Variant:
    """A compiled variant: its name, one launch that compiles it, and every goal shape that
    launches it."""

    name: str
    launch: Launch
    shapes: tuple[str, ...]

    def describe(self) -> dict:
        return {"grid": list(self.launch.grid), "shapes": list(self.shapes)}


def production_variants(occupancy=None) -> list[Variant]:
    """Every variant the goal and ecosystem shapes launch (:data:`COMPILED`), once each, in
    first-seen order; a variant's launch is its first shape's."""
    first: dict[str, Launch] = {}
    shapes: dict[str, list[str]] = {}
    for shape in COMPILED:
        for launch in shape_launches(shape, occupancy):
            first.setdefault(launch.name, launch)
            shapes.setdefault(launch.name, []).append(shape.label)
    return [Variant(name, first[name], tuple(shapes[name])) for name in first]
