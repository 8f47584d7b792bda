"""The split / grid policy (``_core.grid``) at given occupancy numbers: no GPU, no kernel.

Occupancy (CTAs per SM from registers, threads and shared memory), the cost search (the chosen
split count is the cheapest of every allowed one), the worked examples at the goal
shapes (whole waves, >= 64 tokens per split, short contexts spread over the SMs), and the grid
order that schedules the head blocks of one token together.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from mqnc.triton_kernels._core.grid import (
    MAX_SPLITS,
    MIN_TOKENS_PER_SPLIT,
    SM90,
    Occupancy,
    choose_num_splits,
    split_cost,
)
from mqnc.triton_kernels.mla.plan import _DENSE, _WIDE, TileConfig, split_bytes, tile_config
from mqnc.triton_kernels.sm90.variants import GOALS, shape_launches


@pytest.mark.parametrize(
    "regs, threads, shared, ctas",
    [
        (190, 256, 168960, 1),  # dense 16 x 64, 3.9.0: the KV ring's shared memory
        (205, 256, 168960, 1),  # the same under 3.6.0
        (119, 256, 93952, 2),  # sparse 16 x 32, 3.9.0: 2 by registers and by shared memory
        (173, 256, 93952, 1),  # the same under 3.6.0: 173 x 256 > 65536 / 2 registers
        (128, 256, 0, 2),  # exactly half the register file
        (40, 128, 0, 12),  # splice: 40 -> 1280 per warp, 4 warps: 65536 / 5120
        (190, 32, 0, 10),  # merge, one warp of 190 (-> 6144 per warp) registers
        (16, 32, 0, 32),  # tiny CTAs: the 32-CTA limit
    ],
)
def test_ctas_per_sm_from_registers_threads_and_shared_memory(regs, threads, shared, ctas):
    assert Occupancy(regs, threads, shared).ctas_per_sm(SM90) == ctas


# The worked examples are for explicit tiles (the launcher's choice above 32 heads depends on the
# triton version, ``mla.plan._WIDE``): 16 heads x 64 entries, 32 x 32, and triton 3.6's 64 x 32.
TILE_16, TILE_32, TILE_64 = _DENSE[16], _DENSE[32], _WIDE[(3, 6)][0]


def _bytes(H, cfg: TileConfig | None = None):
    return split_bytes(cfg or tile_config(H), 576, 512, 2, H)


@given(
    programs=st.integers(1, 600),
    tiles=st.integers(1, 1100),
    heads=st.sampled_from([16, 128]),
    slots=st.sampled_from([132, 264]),
)
def test_choice_is_the_cheapest_allowed_split(programs, tiles, heads, slots):
    """Brute force over the rule as stated, not the search's own bound: a split count is
    allowed when it is 1, or at most ``MAX_SPLITS`` and every split keeps at least
    ``MIN_TOKENS_PER_SPLIT`` tokens of the capacity (``tiles // k`` tiles of ``block_n``); the
    choice is the cheapest allowed, the fewest splits among ties."""
    b = _bytes(heads)
    s = choose_num_splits(programs, tiles, slots=slots, **b)
    b.pop("min_tiles")
    block_n = tile_config(heads).block_n
    allowed = [
        k
        for k in range(1, MAX_SPLITS + 1)
        if k == 1 or (tiles // k) * block_n >= MIN_TOKENS_PER_SPLIT
    ]
    assert s in allowed
    cost = {k: split_cost(k, programs=programs, tiles=tiles, slots=slots, **b) for k in allowed}
    assert cost[s].cost_bytes == min(c.cost_bytes for c in cost.values())
    assert all(cost[k].cost_bytes > cost[s].cost_bytes for k in allowed if k < s)  # ties: fewer
    if s > 1:  # every split keeps at least 64 tokens of the capacity
        assert tiles // s * tile_config(heads).block_n >= MIN_TOKENS_PER_SPLIT


def _dense(H, B, ct, slots=132, cfg: TileConfig | None = None):
    cfg = cfg or (TILE_16 if H <= 16 else TILE_32)
    programs = B * math.ceil(H / cfg.block_h)
    tiles = math.ceil(ct / cfg.block_n)
    b = _bytes(H, cfg)
    s = choose_num_splits(programs, tiles, slots=slots, **b)
    b.pop("min_tiles")
    return split_cost(s, programs=programs, tiles=tiles, slots=slots, **b)


@pytest.mark.parametrize("H", [16, 128])
@pytest.mark.parametrize("B", [1, 2, 4, 8, 16, 32, 64, 128])
@pytest.mark.parametrize("ct", [2048, 8192, 32768, 65536])
def test_goal_shapes_fill_whole_waves(H, B, ct):
    """The dense goal shapes at one CTA per SM (every production variant under 3.6.0):
    every wave at least 96% full, except at c_t 2048 with B < 4, where 64-entry splits cannot
    fill one at H 16 (32 and 64 CTAs), and at H 128 the 64 KB fp32 partial each extra split
    writes and the combine reads back costs more than the SMs it would add (64 and 104 CTAs)."""
    c = _dense(H, B, ct)
    print(f"H={H} B={B} ct={ct}: S={c.num_splits} {c.ctas} CTAs, {c.waves} waves, {c.fill:.2f}")
    if H == 16 and ct == 2048 and B < 4:
        assert c.num_splits == 2048 // 64 and c.ctas == 32 * B
    elif H == 128 and ct == 2048 and B < 4:
        assert c.ctas >= 64
    else:
        assert c.fill >= 0.96


def test_issue_examples():
    """The tail-wave cases (H 16, B 8 / 16 / 32 / 64 gave 136 / 144 / 160 / 192 CTAs)
    are one full wave now; B 1 at c_t 2048 uses 32 SMs (64 entries per split), not 8."""
    for B in (8, 16, 32, 64):
        c = _dense(16, B, 8192)
        assert (c.ctas, c.waves) == (128, 1)
    assert _dense(16, 1, 2048).ctas == 32
    assert _dense(16, 1, 65536).ctas == 128
    # Two CTAs per SM (a leaner variant) double the slots: the policy fills those instead.
    assert _dense(16, 1, 65536, slots=264).ctas == 256


@pytest.mark.parametrize("B", [1, 2, 4, 8, 16, 32, 64, 128])
@pytest.mark.parametrize("ct", [2048, 8192, 32768, 65536])
def test_goal_shapes_at_64_head_tiles(B, ct):
    """H 128 at triton 3.6's 64 x 32 tile (2 head blocks a token): every wave at least 96% full
    from B x c_t = 16k entries up; below, the fp32 partials each split adds (64 KB a token) cost
    more than the SMs they would fill, yet a third of the SMs or more still work (44, 64 and
    104 CTAs)."""
    c = _dense(128, B, ct, cfg=TILE_64)
    print(f"B={B} ct={ct}: S={c.num_splits} {c.ctas} CTAs, {c.waves} waves, {c.fill:.2f}")
    if B * ct < 16384:
        assert c.ctas >= 44 and c.waves == 1
    else:
        assert c.fill >= 0.96


def test_split_kv_merge_traffic_stays_small_at_long_contexts():
    """B 1, c_t 65536: the partials the combine reads back are a small fraction of the cache
    read (H 16: 128 splits, 5.6%; H 128: 33 splits of 4 head blocks, 11.5%; at 64-head tiles,
    64 splits of 2 head blocks, 22%: the split count doubles for the same CTAs and the 64 KB
    of fp32 partial per split and token stays)."""
    for H, frac, cfg in ((16, 0.06, TILE_16), (128, 0.12, TILE_32), (128, 0.23, TILE_64)):
        c = _dense(H, 1, 65536, cfg=cfg)
        assert c.merge_bytes < frac * c.kv_bytes


def test_head_blocks_of_one_token_are_scheduled_together():
    """H 128: the grid is (tokens x head blocks, splits): the head blocks of a token (four of 32
    heads, or two of 64) are consecutive programs on axis 0 (which varies fastest), so they run
    in the same wave and read the token's tiles from DRAM once; the rows on axis 0, not on axis
    2 (65,535 at most)."""
    shape = next(s for s in GOALS if s.op == "mla_decode" and (s.H, s.B) == (128, 64))
    attend = shape_launches(shape)[0]
    assert len(attend.grid) == 2 and attend.grid[0] == 64 * (128 // tile_config(128).block_h)


def test_launch_names_identify_the_split_variant():
    shape = next(s for s in GOALS if s.op == "mla_decode" and (s.H, s.B, s.ct) == (16, 1, 2048))
    attend, combine = shape_launches(shape)
    assert attend.name.endswith("out=fp32-split]") and attend.grid == (1, 32)
    assert combine.name.startswith("merge[float32->bfloat16,M<=32")
    assert attend.args[0].dtype == torch.bfloat16


def test_gpu_occupancy_is_read_from_the_jits_compiled_kernel(monkeypatch):
    """On a GPU the occupancy comes from Triton's compiled variant (``warmup``, then its
    ``n_regs``, ``num_warps`` and ``shared``), once per (device, variant); stood in for here
    by a kernel object with the same interface."""
    import types

    from mqnc.triton_kernels._core import grid
    from mqnc.triton_kernels._core.launch import Launch

    calls = []

    class Compiled:
        n_regs = 200
        metadata = types.SimpleNamespace(num_warps=8, shared=168960)

        def _init_handles(self):
            calls.append("init")

    class Kernel:
        def warmup(self, *args, grid, **kwargs):
            calls.append(("warmup", args, grid, kwargs))
            return Compiled()

    monkeypatch.setattr(grid, "_GPU_OCCUPANCY", {})
    launch = Launch("v", Kernel(), (1, 2, 3), (1, 2), {"BLOCK": 4, "num_warps": 8})
    cuda = torch.device("cuda", 0)
    occ = grid.kernel_occupancy("v", cuda, lambda: launch)
    assert occ == Occupancy(200, 256, 168960) and occ.ctas_per_sm() == 1
    assert calls[0] == ("warmup", (1, 2), (1, 2, 3), {"BLOCK": 4, "num_warps": 8})
    assert grid.kernel_occupancy("v", cuda, lambda: 1 / 0) is occ  # cached: not rebuilt
    assert len(calls) == 2
    # Off a GPU the checked-in table answers, and make_launch is never called.
    from mqnc.triton_kernels.sm90.table import SM90_VARIANTS

    name = next(iter(SM90_VARIANTS))
    row = SM90_VARIANTS[name]
    got = grid.kernel_occupancy(name, torch.device("cpu"), lambda: 1 / 0)
    assert got == Occupancy(row["registers"], 32 * row["num_warps"], row["shared"])


@pytest.mark.parametrize("op", ["decode", "sparse"])
@pytest.mark.parametrize("heads", [16, 128])
def test_grids_of_many_query_rows_fit_cudas_limits(op, heads):
    """70,000 query rows (a long sparse prefill, or ``B * s_q`` decode rows) launch: the rows
    are on grid axis 0 (2**31 - 1 programs), not on axis 2, whose 65,535 a launch would exceed
    ("invalid argument" from the driver; the interpreter accepts any grid). Planned on meta
    tensors: only shapes and strides are read."""
    from mqnc.triton_kernels.mla.decode import plan_decode
    from mqnc.triton_kernels.mla.sparse import plan_sparse

    rows, meta = 70_000, dict(dtype=torch.bfloat16, device="meta")
    q = torch.empty(rows, heads, 576, **meta)
    kv = torch.empty(8, 64, 576, **meta)
    if op == "decode":
        table = torch.empty(rows, 2, dtype=torch.int32, device="meta")
        lens = torch.empty(rows, dtype=torch.int32, device="meta")
        plan = plan_decode(q, kv, table, lens, 0.1, 512, 2)
    else:
        plan = plan_sparse(
            q, kv, torch.empty(rows, 64, dtype=torch.int32, device="meta"), 0.1, 512, 2
        )
    attend = plan.launches[0]
    block_h = tile_config(heads, sparse=op == "sparse").block_h
    assert attend.grid[0] == rows * -(-heads // block_h)
    for launch in plan.launches:
        x, *rest = launch.grid
        assert x <= 2**31 - 1 and all(n <= 65_535 for n in rest), (launch.name, launch.grid)


def test_a_view_whose_inner_offsets_overflow_32_bits_is_refused():
    """The kernels offset within a page (and within a row's heads) in 32-bit arithmetic: a
    permuted view whose ``(shape[1] - 1) * stride(1)`` passes 2**31 (a token-major pool of 60K
    blocks transposed) is a ValueError naming it, not a wrapped address on the GPU. Meta
    tensors: nothing is allocated."""
    from mqnc.triton_kernels.mla.plan import mla_operands

    meta = dict(dtype=torch.bfloat16, device="meta")
    q = torch.empty(4, 16, 576, **meta)
    token_major = torch.empty(64, 60_000, 576, **meta).transpose(0, 1)  # [blocks, page, d]
    with pytest.raises(ValueError, match=r"kv_pool: expected \(shape\[1\] - 1\) \* stride\(1\)"):
        mla_operands(q, token_major, 512)
    head_major = torch.empty(16, 300_000, 576, **meta).transpose(0, 1)  # [rows, H, d]
    with pytest.raises(ValueError, match=r"q: expected \(shape\[1\] - 1\)"):
        mla_operands(head_major, torch.empty(8, 64, 576, **meta), 512)
    ops = mla_operands(q, torch.empty(8, 64, 576, **meta), 512)  # contiguous: fine
    assert ops.kv.shape == (8, 64, 576)
