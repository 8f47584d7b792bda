"""Every op at the production goal shapes (DeepSeek-V2-Lite: bf16, 576 = 512 + 64, pages of 64)
against the fp64 references: the kernel part of the GPU tier (``correctness/conftest.py``,
``GPU_TIER``), which a GPU run executes on the variants ``perf/warmup.py`` compiled.

Each test launches the very variant its goal shape launches (``sm90.variants.GOALS``): the same
dtypes, tiles and argument specialisation (a splice of 64 tokens compiles to the kernel of 2048,
whose token count is not specialised), so on a GPU nothing here compiles once the cache is
warm. Under the interpreter the sizes that are not specialised (entries, tokens, layers, rows)
shrink to keep the CPU suite short (:func:`_size`); the variants stay the same.
"""

from __future__ import annotations

import math

import pytest
import torch

from mqnc.model import RopeSpec
from mqnc.reference import (
    merge_reference,
    mla_decode_reference,
    mla_sparse_reference,
    rope_rotate_reference,
    rope_splice_reference,
)
from mqnc.testing import assert_close, default_device, tolerance
from mqnc.triton_kernels import (
    merge_partials,
    mla_decode_partial,
    mla_sparse_partial,
    rope_rotate,
    rope_splice,
)

D_QK, PAGE = 576, 64
SCALE = 192**-0.5 * (0.1 * 0.707 * math.log(40) + 1) ** 2  # DeepSeek-V2-Lite with YaRN
DEVICE = default_device()
BF16 = torch.bfloat16


def _size(gpu: int, cpu: int) -> int:
    """The goal's size on a GPU, a smaller one of the same specialisation interpreted."""
    return gpu if DEVICE.type == "cuda" else cpu


def _randn(gen, *shape, std=1.0):
    return (std * torch.randn(*shape, generator=gen)).to(device=DEVICE, dtype=BF16)


@pytest.mark.parametrize("H, B, ct", [(16, 1, 2048), (128, 2, 2048)], ids=str)
def test_dense_goal_shape(H, B, ct):
    """The holder partial (H 16, one token over 2048 entries: 32 splits + the combine) and the
    32-head tile (H 128), each token's pages shuffled through one pool."""
    gen = torch.Generator().manual_seed(H + B)
    ct = ct if H == 16 else _size(ct, 256)
    pages = ct // PAGE
    pool = _randn(gen, B * pages + 2, PAGE, D_QK)
    table = torch.randperm(B * pages + 2, generator=gen)[: B * pages].view(B, pages)
    table = table.to(device=DEVICE, dtype=torch.int32)
    lens = torch.full((B,), ct, dtype=torch.int32, device=DEVICE)
    q = _randn(gen, B, H, D_QK)
    o, lse = mla_decode_partial(q, pool, table, lens, softmax_scale=SCALE)
    o_ref, lse_ref = mla_decode_reference(q, pool, table, lens, SCALE)
    assert_close(o, o_ref, tolerance("mla", BF16), name="o")
    assert_close(lse, lse_ref, tolerance("mla_lse", "float32"), name="lse")


@pytest.mark.parametrize("H, B", [(128, 1), (16, 2)], ids=str)
def test_sparse_goal_shape(H, B):
    """Top-2048 out of a 4096-entry pool (the <= 30 us goal at H 128)."""
    gen = torch.Generator().manual_seed(H + B + 1)
    topk = _size(2048, 256)
    pool = _randn(gen, 2 * topk // PAGE, PAGE, D_QK)
    idx = torch.stack([torch.randperm(2 * topk, generator=gen)[:topk] for _ in range(B)])
    idx = idx.to(device=DEVICE, dtype=torch.int32)
    q = _randn(gen, B, H, D_QK)
    o, lse = mla_sparse_partial(q, pool, idx, softmax_scale=SCALE)
    o_ref, lse_ref = mla_sparse_reference(q, pool, idx, SCALE)
    assert_close(o, o_ref, tolerance("mla", BF16), name="o")
    assert_close(lse, lse_ref, tolerance("mla_lse", "float32"), name="lse")


@pytest.mark.parametrize("M", [8, 2])
def test_merge_goal_shape(M):
    """M bf16 partials of 16 tokens x 16 heads x 512 (M 8: the <= 8 us goal; M 2: the fold)."""
    gen = torch.Generator().manual_seed(M)
    B = _size(16, 2)
    o = (torch.rand(M, B, 16, 512, generator=gen) * 8 - 4).to(device=DEVICE, dtype=BF16)
    lse = (3 * torch.randn(M, B, 16, generator=gen)).to(DEVICE)
    lse[0, 0, :4] = -math.inf  # empty partials among them
    o_out, lse_out = merge_partials(o, lse, layout="MBHD")
    o_ref, lse_ref = merge_reference(o, lse)
    assert_close(o_out, o_ref, tolerance("merge", BF16), name="o")
    assert_close(lse_out, lse_ref, tolerance("merge_lse", "float32"), name="lse")


@pytest.mark.parametrize("per_token", [False, True], ids=["delta=int", "delta=[T]"])
def test_splice_goal_variants(per_token):
    """All 27 layers in one launch into scattered pool slots (64 tokens: the kernel of the
    2048-token goal, whose token count is not specialised)."""
    gen = torch.Generator().manual_seed(int(per_token))
    rope = RopeSpec.from_preset("deepseek-v2-lite")
    L, ct = _size(27, 3), _size(64, 16)
    chunk = _randn(gen, L, ct, D_QK).clamp(-4, 4)
    pool = torch.full((L, 2, PAGE, D_QK), float("nan"), dtype=BF16, device=DEVICE)  # 2 pages
    slots = torch.randperm(2 * PAGE, generator=gen)[:ct].to(DEVICE)
    delta = torch.randint(-100_000, 100_000, (ct,), generator=gen).to(DEVICE)
    delta = delta if per_token else 1000
    expected = rope_splice_reference(chunk, pool, slots, delta, rope)
    rope_splice(chunk, pool, slots, delta, rope)
    assert_close(pool, expected, tolerance("rope", BF16), name="pool")


@pytest.mark.parametrize("per_token", [False, True], ids=["delta=int", "delta=[T]"])
def test_rotate_goal_variants(per_token):
    """The requester's query rotation of 16 tokens x 16 heads."""
    gen = torch.Generator().manual_seed(2 + int(per_token))
    rope = RopeSpec.from_preset("deepseek-v2-lite")
    B = _size(16, 2)
    q = _randn(gen, B, 16, D_QK).clamp(-4, 4)
    delta = torch.randint(-(2**20), 2**20, (B,), generator=gen).to(DEVICE)
    delta = delta if per_token else -777
    out = rope_rotate(q, delta, rope)
    assert_close(out, rope_rotate_reference(q, delta, rope), tolerance("rope", BF16), name="q")
