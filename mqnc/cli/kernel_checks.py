"""The checks behind ``mqnc selfcheck``: every kernel once against its fp64 reference.

:data:`CHECKS` maps each check's name (``mqnc.cli.cmd_selfcheck.CHECKS``, the list its help
prints) to its function; :func:`run_checks` runs those names, each in float32 and bfloat16.
Small shapes, on the device that runs the kernels (:func:`mqnc.base.kernel_device`: the CPU
interpreter when no GPU exists; the caller chooses the kernel mode before importing this
module); each check raises ``AssertionError`` beyond its bound from
``mqnc.testing.TOLERANCES`` and otherwise says what it verified.
"""

from __future__ import annotations

import torch

from mqnc.base.runtime import kernel_device
from mqnc.model.rope import RopeSpec
from mqnc.reference import (
    merge_reference,
    mla_decode_reference,
    mla_sparse_reference,
    rope_rotate_reference,
    rope_splice_reference,
)
from mqnc.testing import assert_close, tolerance
from mqnc.triton_kernels import (
    merge_partials,
    mla_decode_partial,
    mla_sparse_partial,
    rope_rotate,
    rope_splice,
)

__all__ = ["CHECKS", "run_checks"]


def _dt(dtype: torch.dtype) -> str:
    return str(dtype)[6:]


def _check_merge(dtype):
    g = torch.Generator().manual_seed(0)
    M, B, H, D = 5, 2, 16, 512
    o = torch.randn(M, B, H, D, generator=g).clamp(-4, 4).to(dtype)
    lse = torch.randn(M, B, H, generator=g) * 3
    lse[1, 0, :4] = float("-inf")  # empty partials
    lse[:, 1, 0] = float("inf")  # an all-empty row, as FlashMLA marks it
    o, lse = o.to(kernel_device()), lse.to(kernel_device())
    o_ref, lse_ref = merge_reference(o, lse)
    o_out, lse_out = merge_partials(o, lse, layout="MBHD")
    s_o = assert_close(o_out, o_ref, tolerance("merge", dtype), name="o")
    s_l = assert_close(lse_out, lse_ref, tolerance("merge_lse", "float32"), name="lse")
    shape = f"M={M} B={B} H={H} Dv={D} {_dt(dtype)}"
    return f"merge_partials {shape}: o {s_o}; lse max_abs={s_l.max_abs:.2e}"


def _check_splice(dtype):
    g = torch.Generator().manual_seed(0)
    L, ct, block_size = 2, 24, 16
    rope = RopeSpec.from_preset("deepseek-v2-lite")
    chunk = torch.randn(L, ct, 576, generator=g).clamp(-4, 4).to(dtype)
    pool = torch.full((L, 3, block_size, 576), float("nan"), dtype=dtype)
    slots = torch.randperm(3 * block_size, generator=g)[:ct]
    delta = torch.randint(-100_000, 100_000, (ct,), generator=g)
    chunk, pool, slots, delta = (x.to(kernel_device()) for x in (chunk, pool, slots, delta))
    expected = rope_splice_reference(chunk, pool, slots, delta, rope)
    rope_splice(chunk, pool, slots, delta, rope)
    if not torch.equal(pool.view(L, -1, 576)[:, slots, :512], chunk[..., :512]):
        raise AssertionError("rope_splice: the latent dims were not copied bit-exactly")
    s = assert_close(pool, expected, tolerance("rope", dtype), name="pool")
    return (
        f"rope_splice L={L} ct={ct} block_size={block_size} delta=[ct] {_dt(dtype)}: "
        f"latent bit-exact; rope {s}"
    )


def _check_rope_rotate(dtype):
    g = torch.Generator().manual_seed(2)
    B, H = 3, 16
    rope = RopeSpec.from_preset("deepseek-v2-lite")
    q = torch.randn(B, H, 576, generator=g).clamp(-4, 4).to(dtype)
    delta = torch.tensor([-777, 0, 163_839])  # one per query token
    q, delta = q.to(kernel_device()), delta.to(kernel_device())
    out = rope_rotate(q, delta, rope)
    if not torch.equal(out[..., :512], q[..., :512]):
        raise AssertionError("rope_rotate: the latent dims were not copied bit-exactly")
    s = assert_close(out, rope_rotate_reference(q, delta, rope), tolerance("rope", dtype), name="q")
    return f"rope_rotate B={B} H={H} delta=[B] {_dt(dtype)}: latent bit-exact; rope {s}"


def _check_mla_decode(dtype):
    g = torch.Generator().manual_seed(0)
    B, H, block_size, lens = 2, 16, 64, [250, 0]
    pool = torch.randn(8, block_size, 576, generator=g).to(dtype)
    table = torch.randperm(8, generator=g)[:8].view(2, 4).to(torch.int32)
    seqlens = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(B, H, 576, generator=g).to(dtype)
    q, pool, table, seqlens = (x.to(kernel_device()) for x in (q, pool, table, seqlens))
    scale = 192**-0.5
    o, lse = mla_decode_partial(q, pool, table, seqlens, softmax_scale=scale, num_splits=2)
    o_ref, lse_ref = mla_decode_reference(q, pool, table, seqlens, scale)
    s_o = assert_close(o, o_ref, tolerance("mla", dtype), name="o")
    assert_close(lse, lse_ref, tolerance("mla_lse", "float32"), name="lse")
    name = f"mla_decode_partial B={B} H={H} lens={lens} page={block_size} splits=2"
    return f"{name} {_dt(dtype)}: o {s_o}"


def _check_mla_sparse(dtype):
    g = torch.Generator().manual_seed(1)
    B, H, topk = 2, 16, 128
    pool = torch.randn(16, 64, 576, generator=g).to(dtype)
    idx = torch.stack([torch.randperm(16 * 64, generator=g)[:topk] for _ in range(B)])
    idx[:, ::5] = -1
    idx = idx.to(torch.int32)
    q = torch.randn(B, H, 576, generator=g).to(dtype)
    q, pool, idx = (x.to(kernel_device()) for x in (q, pool, idx))
    scale = 192**-0.5
    o, lse = mla_sparse_partial(q, pool, idx, softmax_scale=scale)
    o_ref, lse_ref = mla_sparse_reference(q, pool, idx, scale)
    s_o = assert_close(o, o_ref, tolerance("mla", dtype), name="o")
    assert_close(lse, lse_ref, tolerance("mla_lse", "float32"), name="lse")
    return f"mla_sparse_partial B={B} H={H} topk={topk} (1/5 unused) {_dt(dtype)}: o {s_o}"


CHECKS = {
    "merge": _check_merge,
    "dense partial attention": _check_mla_decode,
    "sparse partial attention": _check_mla_sparse,
    "splice": _check_splice,
    "query rotation": _check_rope_rotate,
}
"""Each check by the name ``mqnc selfcheck --help`` lists."""


def run_checks(names=None) -> list[str]:
    """Run the checks ``names`` (default: every one of :data:`CHECKS`), each in float32 and
    bfloat16; returns one line per check and dtype, raises AssertionError on the first failure
    and KeyError on a name that is no check."""
    names = list(CHECKS) if names is None else list(names)
    unknown = [n for n in names if n not in CHECKS]
    if unknown:
        raise KeyError(f"names: no such check {unknown}; the checks are {list(CHECKS)}")
    return [CHECKS[n](dtype) for n in names for dtype in (torch.float32, torch.bfloat16)]
