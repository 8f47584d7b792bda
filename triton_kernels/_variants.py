"""The production shapes (issue 13's goals on an H200) and the launches the kernels make there.

One list of shapes serves the sm_90 compile test, the checked-in occupancy table
(``_sm90_table``), ``perf/kernel_report.py`` and the benchmarks' ``--goals`` sweeps, so that
what is compiled, predicted and measured is the same thing. The launches are planned by the
launchers' own planning functions (``plan_decode``, ``plan_sparse``, ``merge_launch``,
``splice_launch``) on real tensors of the production geometry (DeepSeek-V2-Lite: bf16,
576 = 512 + 64 entries, pages of 64, 27 layers); only the cache pools are cut to a few blocks
(their strides, all that the compile sees of them, do not depend on the block count).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from mqnc.triton_kernels._launch import Launch

__all__ = ["Shape", "GOALS", "shape_launches", "Variant", "production_variants"]

D_QK, D_V, PAGE, LAYERS = 576, 512, 64, 27
DTYPE = torch.bfloat16
# DeepSeek-V2-Lite's softmax scale with YaRN (factor 40, mscale 0.707): 192^-0.5 * mscale^2.
SCALE = 192**-0.5 * (0.1 * 0.707 * math.log(40) + 1) ** 2


@dataclasses.dataclass(frozen=True)
class Shape:
    """One goal shape. ``op``: ``mla_decode`` (B tokens x H heads over ``ct`` entries each),
    ``mla_sparse`` (top-``ct``), ``merge`` (M partials of B x H rows), ``splice`` (``L`` layers
    x ``ct`` tokens), ``rotate`` (B x H query rows); ``delta``: ``int`` or ``[T]`` (per token)."""

    op: str
    B: int = 1
    H: int = 16
    ct: int = 0
    M: int = 0
    L: int = 0
    delta: str = "int"
    goal: str = ""

    @property
    def label(self) -> str:
        if self.op in ("mla_decode", "mla_sparse"):
            what = "ct" if self.op == "mla_decode" else "topk"
            return f"{self.op} H={self.H} B={self.B} {what}={self.ct}"
        if self.op == "merge":
            return f"merge M={self.M} rows={self.B * self.H}"
        if self.op == "splice":
            return f"splice L={self.L} ct={self.ct} delta={self.delta}"
        return f"rotate rows={self.B * self.H} delta={self.delta}"


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


@dataclasses.dataclass(frozen=True)
class _Rope:
    """DeepSeek's plain RoPE frequencies (the compile sees only the table's dtype)."""

    rope_dim: int = 64
    layout: str = "interleaved"

    @property
    def inv_freq(self) -> tuple[float, ...]:
        return tuple(10000.0 ** (-2 * i / self.rope_dim) for i in range(self.rope_dim // 2))


def _mla_inputs(shape: Shape, device):
    q = torch.zeros(shape.B, shape.H, D_QK, dtype=DTYPE, device=device)
    pool = torch.zeros(2, PAGE, D_QK, dtype=DTYPE, device=device)
    return q, pool


def shape_launches(shape: Shape, occupancy=None, device="cpu") -> list[Launch]:
    """The launches the op makes at ``shape``, in order (an MLA call: attention, then the
    combine when split), planned at ``occupancy`` (default: the launchers' own, see
    ``_grid.kernel_occupancy``)."""
    from mqnc.triton_kernels.merge import merge_launch
    from mqnc.triton_kernels.mla_decode import plan_decode
    from mqnc.triton_kernels.mla_sparse import plan_sparse
    from mqnc.triton_kernels.splice import splice_launch

    device = torch.device(device)
    if shape.op == "mla_decode":
        q, pool = _mla_inputs(shape, device)
        table = torch.zeros(shape.B, math.ceil(shape.ct / PAGE), dtype=torch.int32, device=device)
        lens = torch.full((shape.B,), shape.ct, dtype=torch.int32, device=device)
        return list(plan_decode(q, pool, table, lens, SCALE, D_V, None, occupancy).launches)
    if shape.op == "mla_sparse":
        q, pool = _mla_inputs(shape, device)
        idx = torch.zeros(shape.B, shape.ct, dtype=torch.int32, device=device)
        return list(plan_sparse(q, pool, idx, SCALE, D_V, None, occupancy).launches)
    if shape.op == "merge":
        o = torch.zeros(shape.M, shape.B, shape.H, D_V, dtype=DTYPE, device=device)
        lse = torch.zeros(shape.M, shape.B, shape.H, device=device)
        return [merge_launch(o, lse, o[0].clone(), lse[0].clone())]
    rope = _Rope()
    freq = torch.tensor(rope.inv_freq, dtype=torch.float64, device=device)
    if shape.op == "splice":
        T, L = shape.ct, shape.L
        chunk = torch.zeros(L, T, D_QK, dtype=DTYPE, device=device)
        pool = torch.zeros(L, 2 * math.ceil(T / PAGE), PAGE, D_QK, dtype=DTYPE, device=device)
        slots = torch.arange(T, device=device)
        delta = torch.zeros(T, dtype=torch.int64, device=device) if shape.delta != "int" else 7
        return [
            splice_launch(
                chunk,
                pool,
                slots,
                delta,
                freq,
                T,
                L,
                PAGE,
                (chunk.stride(0), chunk.stride(1)),
                (pool.stride(0), pool.stride(1), pool.stride(2)),
                rope,
            )
        ]
    x = torch.zeros(shape.B * shape.H, D_QK, dtype=DTYPE, device=device)
    out = torch.empty_like(x)
    n = x.shape[0]
    delta = torch.zeros(n, dtype=torch.int64, device=device) if shape.delta != "int" else -7
    return [
        splice_launch(
            x, out, None, delta, freq, n, 1, 1, (0, x.stride(0)), (0, out.stride(0), 0), rope
        )
    ]


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
    """Every variant the goal shapes launch, once each, in first-seen order; a variant's launch
    is its first shape's."""
    first: dict[str, Launch] = {}
    shapes: dict[str, list[str]] = {}
    for shape in GOALS:
        for launch in shape_launches(shape, occupancy):
            first.setdefault(launch.name, launch)
            shapes.setdefault(launch.name, []).append(shape.label)
    return [Variant(name, first[name], tuple(shapes[name])) for name in first]
