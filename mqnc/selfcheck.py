"""``mqnc selfcheck``: run every kernel once against its fp64 reference and say what was verified.

What ``make demo`` runs until the agentic fan-in demo lands. Small shapes, CPU interpreter when
no GPU exists; exits non-zero if any check exceeds its bound from ``mqnc.testing.TOLERANCES``.
"""

from __future__ import annotations

__all__ = ["run_checks", "register"]


def _check_merge(torch, dtype):
    from mqnc.reference import merge_reference
    from mqnc.testing import assert_close, tolerance
    from mqnc.triton_kernels import merge_partials

    g = torch.Generator().manual_seed(0)
    M, B, H, D = 5, 2, 16, 512
    o = torch.randn(M, B, H, D, generator=g).clamp(-4, 4).to(dtype)
    lse = torch.randn(M, B, H, generator=g) * 3
    lse[1, 0, :4] = float("-inf")  # empty partials
    lse[:, 1, 0] = float("inf")  # an all-empty row, as FlashMLA marks it
    o_ref, lse_ref = merge_reference(o, lse)
    o_out, lse_out = merge_partials(o, lse)
    s_o = assert_close(o_out, o_ref, tolerance("merge", dtype), name="o")
    s_l = assert_close(lse_out, lse_ref, tolerance("merge_lse", "float32"), name="lse")
    shape = f"M={M} B={B} H={H} Dv={D} {str(dtype)[6:]}"
    return f"merge_partials {shape}: o {s_o}; lse max_abs={s_l.max_abs:.2e}"


def _check_splice(torch, dtype):
    from mqnc.reference import rope_splice_reference
    from mqnc.rope import RopeSpec
    from mqnc.testing import assert_close, tolerance
    from mqnc.triton_kernels import rope_splice

    g = torch.Generator().manual_seed(0)
    L, ct, block_size = 2, 24, 16
    rope = RopeSpec.from_preset("deepseek-v2-lite")
    chunk = torch.randn(L, ct, 576, generator=g).clamp(-4, 4).to(dtype)
    pool = torch.full((L, 3, block_size, 576), float("nan"), dtype=dtype)
    slots = torch.randperm(3 * block_size, generator=g)[:ct]
    delta = torch.randint(-100_000, 100_000, (ct,), generator=g)
    expected = rope_splice_reference(chunk, pool, slots, delta, rope)
    rope_splice(chunk, pool, slots, delta, rope)
    if not torch.equal(pool.view(L, -1, 576)[:, slots, :512], chunk[..., :512]):
        raise AssertionError("rope_splice: the latent dims were not copied bit-exactly")
    s = assert_close(pool, expected, tolerance("rope", dtype), name="pool")
    return (
        f"rope_splice L={L} ct={ct} block_size={block_size} delta=[ct] {str(dtype)[6:]}: "
        f"latent bit-exact; rope {s}"
    )


def _check_mla_decode(torch, dtype):
    from mqnc.reference import mla_decode_reference
    from mqnc.testing import assert_close, tolerance
    from mqnc.triton_kernels import mla_decode_partial

    g = torch.Generator().manual_seed(0)
    B, H, block_size, lens = 2, 16, 64, [250, 0]
    pool = torch.randn(8, block_size, 576, generator=g).to(dtype)
    table = torch.randperm(8, generator=g)[:8].view(2, 4).to(torch.int32)
    seqlens = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(B, H, 576, generator=g).to(dtype)
    scale = 192**-0.5
    o, lse = mla_decode_partial(q, pool, table, seqlens, softmax_scale=scale, num_splits=2)
    o_ref, lse_ref = mla_decode_reference(q, pool, table, seqlens, scale)
    s_o = assert_close(o, o_ref, tolerance("mla", dtype), name="o")
    assert_close(lse, lse_ref, tolerance("mla_lse", "float32"), name="lse")
    name = f"mla_decode_partial B={B} H={H} lens={lens} page={block_size} splits=2"
    return f"{name} {str(dtype)[6:]}: o {s_o}"


def _check_mla_sparse(torch, dtype):
    from mqnc.reference import mla_sparse_reference
    from mqnc.testing import assert_close, tolerance
    from mqnc.triton_kernels import mla_sparse_partial

    g = torch.Generator().manual_seed(1)
    B, H, topk = 2, 16, 128
    pool = torch.randn(16, 64, 576, generator=g).to(dtype)
    idx = torch.stack([torch.randperm(16 * 64, generator=g)[:topk] for _ in range(B)])
    idx[:, ::5] = -1
    idx = idx.to(torch.int32)
    q = torch.randn(B, H, 576, generator=g).to(dtype)
    scale = 192**-0.5
    o, lse = mla_sparse_partial(q, pool, idx, softmax_scale=scale)
    o_ref, lse_ref = mla_sparse_reference(q, pool, idx, scale)
    s_o = assert_close(o, o_ref, tolerance("mla", dtype), name="o")
    assert_close(lse, lse_ref, tolerance("mla_lse", "float32"), name="lse")
    return f"mla_sparse_partial B={B} H={H} topk={topk} (1/5 unused) {str(dtype)[6:]}: o {s_o}"


def run_checks() -> list[str]:
    """Run the checks; returns one line per check, raises AssertionError on the first failure."""
    from mqnc.runtime import use_interpreter_without_cuda

    use_interpreter_without_cuda()
    import torch

    lines = []
    for dtype in (torch.float32, torch.bfloat16):
        lines.append(_check_merge(torch, dtype))
    for dtype in (torch.float32, torch.bfloat16):
        lines.append(_check_splice(torch, dtype))
    for dtype in (torch.float32, torch.bfloat16):
        lines.append(_check_mla_decode(torch, dtype))
        lines.append(_check_mla_sparse(torch, dtype))
    return lines


def _run(args) -> int:
    from mqnc.runtime import device_name, kernel_mode

    try:
        lines = run_checks()
    except AssertionError as exc:
        print(f"FAILED: {exc}")
        return 1
    print(f"mqnc self-check on {device_name()} (kernels {kernel_mode()}):")
    for line in lines:
        print(f"  ok  {line}")
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("selfcheck", help="run each kernel once against its fp64 reference")
    p.set_defaults(func=_run)
