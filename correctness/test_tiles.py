"""The tile the MLA launchers choose (``_mla_launch.tile_config``), its label, and the tuning
hook that forces one (``forced_tile``): no kernel runs here.

Above 32 heads the choice depends on the triton in use (``_WIDE``, from a tile sweep on an
H200 under triton 3.6.0; other versions keep tiles that compile there without spills), so the
version is set per test.
"""

from __future__ import annotations

import pytest
import torch
import triton

from mqnc.triton_kernels._mla_launch import (
    _DENSE,
    _FP32,
    _SPARSE,
    _WIDE,
    _WIDE_ELSE,
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
    """The table says what the H200 sweep chose (README "Tiles above 32 heads")."""
    assert [t.label for t in _WIDE[(3, 6)]] == ["64x32w8s3", "64x16w8s5"]
    assert [t.label for t in _WIDE_ELSE] == ["32x32w8s5", "16x32w8s5"]


def test_label_and_parse_round_trip():
    for cfg in (*_DENSE.values(), *_SPARSE.values(), _FP32, *_WIDE[(3, 6)]):
        assert TileConfig.parse(cfg.label) == cfg
    assert TileConfig.parse(" 64x32w8s3 ") == TileConfig(64, 32, 8, 3)
    assert TileConfig(16, 16, 16, 5).reg_cap == 128 and TileConfig(64, 32, 8, 3).reg_cap == 255


@pytest.mark.parametrize(
    "text, exc, match",
    [
        ("64x32", ValueError, r"--tiles: expected 'HxNwWsS' such as '16x64w8s5', got '64x32'"),
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
