"""The tile the MLA launchers choose (``mla.plan.tile_config``), its label, the tuning hook
that forces one (``forced_tile``), and the next sweep's candidates (``SWEEP_TILES``): the 64 x 64
ones run here against fp64 (interpreted without a GPU); nothing else launches a kernel.

Above 32 heads the choice depends on the triton in use (``_WIDE``, from a tile sweep on an
H200 under triton 3.6.0; other versions keep tiles that compile there without spills), so the
version is set per test.
"""

from __future__ import annotations

import math

import pytest
import torch
import triton

from mqnc.triton_kernels.mla.plan import (
    _DENSE,
    _FP32,
    _SPARSE,
    _WIDE,
    _WIDE_ELSE,
    SWEEP_TILES,
    TileConfig,
    forced_tile,
    tile_config,
)


@pytest.mark.parametrize(
    "version, wide",
    [
        ("3.6.0", _WIDE[(3, 6)]),
        ("3.6.1+git1a2b3c", _WIDE[(3, 6)]),
        ("3.6.0rc1", _WIDE[(3, 6)]),
        ("3.9.0", _WIDE_ELSE),
        ("3.10.0", _WIDE_ELSE),  # not read as 3.1
        ("3.5.1", _WIDE_ELSE),
    ],
)
def test_tiles_by_head_count_and_triton_version(monkeypatch, version, wide):
    monkeypatch.setattr(triton, "__version__", version)
    for sparse, table, k in ((False, _DENSE, 0), (True, _SPARSE, 1)):
        assert tile_config(1, sparse=sparse) == tile_config(16, sparse=sparse) == table[16]
        assert tile_config(17, sparse=sparse) == tile_config(32, sparse=sparse) == table[32]
        for heads in (33, 64, 128):
            for dtype in (torch.bfloat16, torch.float16):
                assert tile_config(heads, sparse=sparse, dtype=dtype) == wide[k]
            assert tile_config(heads, sparse=sparse, dtype=torch.float32) == _FP32
    assert wide[0].block_h in (32, 64) and wide[1].block_h in (16, 64)


def test_the_wide_tiles_are_the_measured_ones():
    """The table says what the H200 sweep chose (docs/kernels.md, "Tiles above 32 heads")."""
    assert [t.label for t in _WIDE[(3, 6)]] == ["64x64w8s2-tma", "64x32w8s2-pipe"]
    assert [t.label for t in _WIDE_ELSE] == ["32x32w8s5", "16x32w8s5"]


def test_label_and_parse_round_trip():
    for cfg in (*_DENSE.values(), *_SPARSE.values(), _FP32, *_WIDE[(3, 6)]):
        assert TileConfig.parse(cfg.label) == cfg
    assert TileConfig.parse(" 64x32w8s3 ") == TileConfig(64, 32, 8, 3)
    assert TileConfig(16, 16, 16, 5).reg_cap == 128 and TileConfig(64, 32, 8, 3).reg_cap == 255


@pytest.mark.parametrize(
    "text, exc, match",
    [
        (
            "64x32",
            ValueError,
            r"--tiles: expected 'HxNwWsS\[-pipe\|-tma\]\[-fused\]' such as '16x64w8s5', "
            "got '64x32'",
        ),
        ("48x32w8s3", ValueError, "powers of two >= 16, got '48x32w8s3'"),
        ("64x8w8s3", ValueError, "powers of two >= 16, got '64x8w8s3'"),
        ("64x32w32s3", ValueError, "1..16 warps .* got '64x32w32s3'"),
        ("64x32w8s0", ValueError, ">= 1 stage, got '64x32w8s0'"),
        (64, TypeError, "--tiles: expected a str such as '16x64w8s5', got int"),
    ],
)
def test_parse_names_the_argument(text, exc, match):
    with pytest.raises(exc, match=match):
        TileConfig.parse(text, "--tiles")


def test_forced_tile_is_scoped_to_its_kind_and_block():
    dense_default, sparse_default = tile_config(128), tile_config(128, sparse=True)
    with forced_tile("16x64w8s5") as cfg:
        assert cfg == TileConfig(16, 64, 8, 5)
        assert tile_config(128) == tile_config(16) == cfg
        assert tile_config(128, sparse=True) == sparse_default  # the other kind keeps its own
        assert tile_config(128, dtype=torch.float32) == _FP32  # fp32 caches keep theirs
        with forced_tile(TileConfig(64, 16, 8, 5)):
            assert tile_config(128) == TileConfig(64, 16, 8, 5)
        assert tile_config(128) == cfg  # the outer block's tile again
    assert tile_config(128) == dense_default
    with forced_tile("32x16w8s5", sparse=True):
        assert tile_config(16, sparse=True) == TileConfig(32, 16, 8, 5)
        assert tile_config(16) == _DENSE[16]
    assert tile_config(128, sparse=True) == sparse_default
    with pytest.raises(TypeError, match="tile: expected a TileConfig or its label, got tuple"):
        with forced_tile((64, 32, 8, 3)):
            pass


def test_the_sweep_candidates_include_64x64_and_every_default_wide_tile():
    """The next sweep's candidates (``SWEEP_TILES``, read by perf/gpu_tiles.sh) hold the 64 x 64
    dense tile and every tile the launcher may choose above 32 heads; none that spills under
    triton 3.6.0 (64x64w8s2, sparse 64 x 64: test_compile_sm90 compiles each candidate)."""
    dense = [t.label for t in SWEEP_TILES["dense"]]
    sparse = [t.label for t in SWEEP_TILES["sparse"]]
    assert "64x64w8s3" in dense and "64x64w8s2" not in dense
    for wide in (*_WIDE.values(), _WIDE_ELSE):
        assert wide[0].label in dense and wide[1].label in sparse
    assert not [t for t in sparse if t.startswith("64x64")]
    assert len(set(dense)) == len(dense) and len(set(sparse)) == len(sparse)


# DeepSeek-V2-Lite's scale with YaRN (factor 40, mscale_all_dim 0.707): 192^-0.5 * mscale^2.
SCALE = 192**-0.5 * (0.1 * 0.707 * math.log(40) + 1) ** 2


def _nan_paged_cache(lengths, gen, device, page=64):
    """A bf16 pool holding ``lengths[b]`` N(0, 1) entries per row in shuffled pages of 64, every
    slot no row holds NaN (a read past a row's length or through a wrong page fails), and its
    table (-1 past a row's pages) and lengths."""
    pages = [-(-n // page) for n in lengths]
    blocks = sum(pages) + 2
    pool = torch.full((blocks, page, 576), float("nan"))
    perm = torch.randperm(blocks, generator=gen)
    table = torch.full((len(lengths), max(max(pages), 1)), -1, dtype=torch.int32)
    used = 0
    for b, n in enumerate(lengths):
        v = torch.randn(n, 576, generator=gen)
        for j in range(pages[b]):
            table[b, j] = blk = int(perm[used])
            used += 1
            chunk = v[j * page : (j + 1) * page]
            pool[blk, : chunk.shape[0]] = chunk
    lens = torch.tensor(lengths, dtype=torch.int32)
    return pool.to(device, torch.bfloat16), table.to(device), lens.to(device)


# The 64 x 64 candidates and the restructured ones ("pipe" / "tma") run in the interpreter at
# those block shapes (the compiled ones HGMMA).
# The restructured wide tiles run at 40 heads on a row of full tiles and a tail and an empty row
# (the unmasked loop, the masked tail; split and split-cache TMA run at 16 heads, below: the
# interpreter's cost of a 64 x 64 tile).
NEW_DENSE = [t.label for t in SWEEP_TILES["dense"] if t.block_n == 64 and t.block_h == 64]
_CASES = [(40, [70, 0, 129], None), (128, [96], 3)]
_WIDE_CASES = [
    (tile, *case)
    for t in SWEEP_TILES["dense"]
    for tile in [t.label]
    for case in (_CASES if not t.kernel else [(40, [70, 0], None)])
    if tile in NEW_DENSE or t.kernel
]


@pytest.mark.parametrize("tile,heads,lengths,num_splits", _WIDE_CASES)
def test_64x64_candidates_match_fp64(tile, heads, lengths, num_splits):
    """Each 64 x 64 candidate at more than 32 heads (a partial head block at 40; a row with no
    entries; partial last tiles; split and unsplit), in bf16 against fp64, as the launcher's
    wide tiles are in test_mla_decode. Triton 3.6's interpreter (``make compat``) runs none of
    the MLA kernels (its ``__index__`` of a block fails: test_mla_decode fails there alike), so
    there it runs on a GPU only."""
    from mqnc.base.env import interpreting

    if interpreting() and triton.__version__.startswith("3.6."):
        pytest.skip("triton 3.6's interpreter cannot run the MLA kernels (a GPU can)")
    from mqnc.reference import mla_decode_reference
    from mqnc.testing import assert_close, default_device, tolerance
    from mqnc.triton_kernels import mla_decode_partial
    from mqnc.triton_kernels.mla.decode import plan_decode

    gen = torch.Generator().manual_seed(heads)
    pool, table, lens = _nan_paged_cache(lengths, gen, default_device())
    q = torch.randn(len(lengths), heads, 576, generator=gen).to(pool.device, torch.bfloat16)
    with forced_tile(tile):
        plan = plan_decode(q, pool, table, lens, SCALE, 512, num_splits)
        assert TileConfig.of_launch(plan.launches[0]).label == tile
        o, lse = mla_decode_partial(
            q, pool, table, lens, softmax_scale=SCALE, num_splits=num_splits
        )
    o_ref, lse_ref = mla_decode_reference(q, pool, table, lens, SCALE)
    assert_close(o, o_ref, tolerance("mla", torch.bfloat16), name="o")
    assert_close(lse, lse_ref, tolerance("mla_lse", "float32"), name="lse")


@pytest.mark.parametrize(
    "tile", [t.label for t in SWEEP_TILES["dense16"] if t != _DENSE[16]] + ["16x32w4s2-tma"]
)
@pytest.mark.parametrize(
    "lengths,num_splits,page,split_kv",
    [([70, 0], None, 64, False), ([96], 3, 64, True), ([45, 33], None, 16, False)],
)
def test_16_head_and_restructured_candidates_match_fp64(tile, lengths, num_splits, page, split_kv):
    """The 16-head candidates (``SWEEP_TILES["dense16"]``) and the restructured loop at 16
    heads (TMA boxes of a page; pages of 16, smaller than the tile, fall back to per-entry page
    ids without TMA) against fp64: rows of 0, partial last tiles, one full tile, split and
    unsplit, a fused and a split (``q_pe`` / ``kpe_pool``) cache, NaN in every slot no row
    holds."""
    from mqnc.base.env import interpreting

    if interpreting() and triton.__version__.startswith("3.6."):
        pytest.skip("triton 3.6's interpreter cannot run the MLA kernels (a GPU can)")
    from mqnc.reference import mla_decode_reference
    from mqnc.testing import assert_close, default_device, tolerance
    from mqnc.triton_kernels import mla_decode_partial

    gen = torch.Generator().manual_seed(len(lengths) + page)
    pool, table, lens = _nan_paged_cache(lengths, gen, default_device(), page=page)
    q = torch.randn(len(lengths), 16, 576, generator=gen).to(pool.device, torch.bfloat16)
    kw = {}
    if split_kv:
        kw = dict(q_pe=q[..., 512:].contiguous(), kpe_pool=pool[..., 512:].contiguous())
    with forced_tile(tile) as cfg:
        o, lse = mla_decode_partial(
            q[..., :512] if split_kv else q, pool[..., :512] if split_kv else pool, table, lens,
            softmax_scale=SCALE, num_splits=num_splits, **kw,
        )  # fmt: skip
    o_ref, lse_ref = mla_decode_reference(q, pool, table, lens, SCALE)
    assert_close(o, o_ref, tolerance("mla", torch.bfloat16), name=f"{cfg.label} o")
    assert_close(lse, lse_ref, tolerance("mla_lse", "float32"), name=f"{cfg.label} lse")


def test_restructured_kernel_names_and_labels():
    """A restructured tile runs the pipelined kernel and says so in its variant name (``pipe``,
    or ``tma`` where a tile lies within a page); its label round-trips through the launch."""
    from mqnc.triton_kernels.mla.decode import plan_decode

    pool = torch.zeros(4, 64, 576, dtype=torch.bfloat16)
    table = torch.zeros(1, 4, dtype=torch.int32)
    lens = torch.tensor([256], dtype=torch.int32)
    q = torch.zeros(1, 16, 576, dtype=torch.bfloat16)
    for tile, feature in (("16x32w4s2-tma", ",tma]"), ("16x32w4s2-pipe", ",pipe]")):
        with forced_tile(tile) as cfg:
            launch = plan_decode(q, pool, table, lens, SCALE, 512, 1).launches[0]
        assert launch.name.endswith(feature) and TileConfig.of_launch(launch) == cfg
    small = torch.zeros(16, 16, 576, dtype=torch.bfloat16)  # pages of 16 < 32 entries: no TMA
    with forced_tile("16x32w4s2-tma"):
        launch = plan_decode(q, small, table, lens, SCALE, 512, 1).launches[0]
    assert launch.name.endswith(",page=16,pipe]") and not launch.kwargs["TMA"]
    with pytest.raises(ValueError, match="kernel: expected one of"):
        TileConfig(16, 32, 4, 2, kernel="warp")


@pytest.mark.parametrize("tile", [t.label for t in SWEEP_TILES["dense16"] if t.fused])
@pytest.mark.parametrize("lengths,num_splits", [([200, 0, 70], 4), ([0], 3), ([64], 1), ([130], 2)])
def test_fused_combine_matches_fp64_run_after_run(tile, lengths, num_splits):
    """The combine fused into the attention launch (``-fused``: the split that draws a row's
    last ticket merges its partials) against fp64: rows of different lengths and an empty one,
    an all-empty row (o = 0, lse = -inf), one split (no ticket: the plain launch) and two; one
    launch per plan, and a second run of the same plan (its tickets back at 0) as exact."""
    from mqnc.base.env import interpreting

    if interpreting() and triton.__version__.startswith("3.6."):
        pytest.skip("triton 3.6's interpreter cannot run the MLA kernels (a GPU can)")
    from mqnc.reference import mla_decode_reference
    from mqnc.testing import assert_close, default_device, tolerance
    from mqnc.triton_kernels import plan_mla_decode

    gen = torch.Generator().manual_seed(7)
    pool, table, lens = _nan_paged_cache(lengths, gen, default_device())
    q = torch.randn(len(lengths), 16, 576, generator=gen).to(pool.device, torch.bfloat16)
    with forced_tile(tile):
        plan = plan_mla_decode(q, pool, table, lens, softmax_scale=SCALE, num_splits=num_splits)
    names = [launch.name for launch in plan.launches]
    assert len(names) == 1 and names[0].endswith(",fused]" if num_splits > 1 else ",pipe]")
    o_ref, lse_ref = mla_decode_reference(q, pool, table, lens, SCALE)
    for run in range(2):
        o, lse = plan.run(q, pool, table, lens)
        assert_close(o, o_ref, tolerance("mla", torch.bfloat16), name=f"run {run} o")
        assert_close(lse, lse_ref, tolerance("mla_lse", "float32"), name=f"run {run} lse")
    with pytest.raises(ValueError, match="fused: expected a restructured kernel"):
        TileConfig(16, 32, 8, 2, fused=True)


def test_the_split_policy_prices_a_fused_combine_as_one_cta():
    """A fused combine merges a program's partials in the one CTA that draws its last ticket:
    the policy prices it so (``merge_ctas`` 1) and, for the one-row holder partial (H 16, B 1,
    c_t 2048), plans fewer splits than for the same tile with the merge kernel's 64 CTAs."""
    from mqnc.triton_kernels._core.grid import choose_num_splits
    from mqnc.triton_kernels.mla.plan import split_bytes

    plain, fused = TileConfig.parse("16x32w8s2-pipe"), TileConfig.parse("16x32w8s2-pipe-fused")
    assert split_bytes(fused, 576, 512, 2, 16)["merge_ctas"] == 1
    assert split_bytes(plain, 576, 512, 2, 16)["merge_ctas"] == 16 * 4

    def splits(cfg):
        return choose_num_splits(1, 64, **split_bytes(cfg, 576, 512, 2, 16), slots=132, sms=132)

    assert splits(fused) < splits(plain) == 32


@pytest.mark.parametrize(
    "tile", [t.label for t in SWEEP_TILES["sparse"] if t.kernel and t.block_h == 16]
)
@pytest.mark.parametrize("num_splits", [None, 2])
def test_restructured_sparse_candidates_match_fp64(tile, num_splits):
    """The restructured sparse kernel (``-pipe``) against fp64: a full tile and a partial last
    one per split, ``-1`` slots in a full tile and filling a tail, split and unsplit (its
    64-head candidates share the code; the interpreter's cost of a 64-row tile keeps them to
    the sm_90 compile). A TMA or fused tile is refused for the sparse kernel."""
    from mqnc.base.env import interpreting

    if interpreting() and triton.__version__.startswith("3.6."):
        pytest.skip("triton 3.6's interpreter cannot run the MLA kernels (a GPU can)")
    from mqnc.reference.attention_ref import mla_sparse_reference
    from mqnc.testing import assert_close, default_device, tolerance
    from mqnc.triton_kernels import mla_sparse_partial

    gen = torch.Generator().manual_seed(3)
    pool = torch.randn(6, 64, 576, generator=gen).to(default_device(), torch.bfloat16)
    idx = torch.randperm(6 * 64, generator=gen)[:140].view(2, 70).to(torch.int32)
    idx[0, 5], idx[1, 40:] = -1, -1
    idx = idx.to(pool.device)
    q = torch.randn(2, 16, 576, generator=gen).to(pool.device, torch.bfloat16)
    with forced_tile(tile, sparse=True):
        o, lse = mla_sparse_partial(q, pool, idx, softmax_scale=SCALE, num_splits=num_splits)
    o_ref, lse_ref = mla_sparse_reference(q.double(), pool.double(), idx, SCALE)
    assert_close(o, o_ref, tolerance("mla", torch.bfloat16), name=f"{tile} o")
    assert_close(lse, lse_ref, tolerance("mla_lse", "float32"), name=f"{tile} lse")
    for bad in ("16x32w8s5-tma", "16x32w8s5-pipe-fused"):
        with forced_tile(bad, sparse=True), pytest.raises(ValueError, match="sparse kernel"):
            mla_sparse_partial(q, pool, idx, softmax_scale=SCALE)


def test_a_tma_launch_on_a_gpu_gets_an_allocator():
    """Device-side TMA descriptors need Triton's per-launch scratch: planning a ``-tma`` launch
    on a CUDA device installs ``mla.decode._scratch`` (torch's allocator) where none is set,
    keeps one that is, and does nothing for the interpreter's CPU tensors (no CUDA call here)."""
    from triton.runtime import _allocation

    from mqnc.triton_kernels.mla.decode import _scratch, ensure_allocator

    before = _allocation._allocator.get()
    try:
        _allocation._allocator.set(_allocation.NullAllocator())
        ensure_allocator(torch.device("cpu"))
        assert isinstance(_allocation._allocator.get(), _allocation.NullAllocator)
        ensure_allocator(torch.device("cuda"))
        assert _allocation._allocator.get() is _scratch
        mine = lambda size, alignment, stream: None  # noqa: E731
        _allocation._allocator.set(mine)
        ensure_allocator(torch.device("cuda"))
        assert _allocation._allocator.get() is mine
    finally:
        _allocation._allocator.set(before)
