"""FP8 cache quantizer and its inverse: cache rows to DeepSeek-V3.2's 656-byte entries and back.

An entry (``mqnc.model.kv_format``; FlashMLA's ``V32_FP8Sparse``) holds, for a ``d_c + d_r``
wide row: ``d_c`` FP8 e4m3fn latent bytes, ``d_c / 128`` float32 scales (one per group of 128
latent values), then the ``d_r`` RoPE values in bfloat16. A group's scale is the power of two
``2**ceil(log2(max(fp32(amax / 448), 1e-4)))`` (FlashMLA's), so ``x / scale`` is exact and
never above 448, and dequantizing is exact.

Kernel design: grid ``ceil(N / BLOCK_T)``, a program quantizes ``BLOCK_T`` rows (16) group by
group: it loads a ``[BLOCK_T, 128]`` tile, takes its row maxima, builds the scale and its
inverse from exponent bits (no ``log2``, no division: both exact), multiplies, encodes and
stores 128 bytes a row, then the scale, then copies (bf16 input) or rounds (fp32 input) the
RoPE part. The entries are one uint8 buffer; scales and RoPE values are stored through
``int32`` / ``int16`` pointers into it (4- and 2-byte aligned: ``d_c`` is a multiple of 128
and an entry a multiple of 16 bytes at 512 + 64).

The FP8 encode is integer arithmetic (round to nearest, ties to even, subnormals included),
on every backend, so the interpreter checks the very bits the GPU writes: triton 3.9.0's
interpreter casts float32 to ``tl.float8e4nv`` with ties away from zero and flushes e4m3
subnormals to zero (1.0625 -> 0x39, 3 * 2**-11 -> 0x00; RNE gives 0x38 and 0x01), which is not
the hardware's ``cvt.rn.satfinite.e4m3x2.f32``. The decode is integer arithmetic too (exact).

:func:`fp8_quantize` and :func:`fp8_dequantize` are declared (signature, docstring, fake) in
``ops``; this module is their ``"triton"`` implementation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mqnc.triton_kernels._core.execution import (
    bf16_rne_in_software,
    check_launchable,
    new_output,
    poisoning,
)
from mqnc.triton_kernels._core.launch import Launch
from mqnc.triton_kernels._core.numerics import round_to
from mqnc.triton_kernels._core.validate import check_int
from mqnc.triton_kernels.fp8.cache import FP8_GROUP, bad_fp8_entries, raise_bad_fp8_entry
from mqnc.triton_kernels.ops import fp8_dequantize, fp8_quantize

__all__ = [
    "fp8_quantize",
    "fp8_dequantize",
    "quantize_launch",
    "dequantize_launch",
    "check_rows",
    "check_entries",
    "GROUP",
    "BLOCK_T",
]

GROUP = FP8_GROUP
"""Latent values per fp32 scale."""
BLOCK_T = 16
"""Rows per program."""
_IN_DTYPES = (torch.bfloat16, torch.float32)
X_LIMIT = 248.0 * 2.0**120
"""Largest magnitude (excluded) a cache value may have: the scale is at most 2**120 (that of
float32's largest values), and ``x / 2**120 >= 248`` rounds to 256 in e4m3, whose product with
the scale, 2**128, is past float32's range."""
_SCALE_FLOOR_BITS = tl.constexpr(0x38D1B717)  # float32(1e-4), FlashMLA's clamp of amax / 448


@triton.jit
def _encode_e4m3(y):
    """Bits (int32, 0..255) of float32 ``y`` (``|y| <= 448``) rounded to e4m3fn, ties to even."""
    u = y.to(tl.int32, bitcast=True)
    sign = (u >> 24) & 0x80
    a = u & 0x7FFFFFFF
    e = a >> 23
    # normal (|y| >= 2**-6): round the 23-bit mantissa to 3 bits, carry into the exponent
    normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - (120 << 3)
    # subnormal: RNE(|y| * 2**9) from the integer mantissa (0 for fp32 zeros / subnormals)
    m = (a & 0x7FFFFF) | 0x800000
    s = tl.minimum(tl.maximum(141 - e, 1), 31)
    q = m >> s
    rem = m - (q << s)
    half = 1 << (s - 1)
    q = q + ((rem > half) | ((rem == half) & ((q & 1) == 1))).to(tl.int32)
    q = tl.where(e == 0, 0, q)
    return sign | tl.where(e >= 121, normal, q)


@triton.jit
def _decode_e4m3(c):
    """float32 value of e4m3fn bits ``c`` (int32, 0..255; no NaN), exactly."""
    e = (c >> 3) & 15
    m = c & 7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    v = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)  # subnormal: m * 2**-9
    return tl.where((c & 0x80) != 0, -v, v)


@triton.jit(do_not_specialize=["N"])
def _quantize_kernel(
    X,
    C,
    N,
    stride_x,
    D_C: tl.constexpr,
    D_R: tl.constexpr,
    GROUP: tl.constexpr,
    ENTRY: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BF16_IN: tl.constexpr,
    BF16_RNE: tl.constexpr,
):
    """Grid ``ceil(N / BLOCK_T)``: entries of ``BLOCK_T`` rows."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    mask = rows < N
    x_row = X + rows.to(tl.int64)[:, None] * stride_x
    c_row = C + rows.to(tl.int64)[:, None] * ENTRY
    cols = tl.arange(0, GROUP)[None, :]
    scales = (C + D_C).to(tl.pointer_type(tl.int32))
    for g in tl.static_range(D_C // GROUP):
        x = tl.load(x_row + g * GROUP + cols, mask=mask[:, None], other=0.0).to(tl.float32)
        s_inv = tl.math.div_rn(tl.max(tl.abs(x), axis=1), 448.0)  # IEEE, not div.full
        bits = tl.maximum(s_inv.to(tl.int32, bitcast=True), _SCALE_FLOOR_BITS)
        exp = (bits >> 23) + ((bits & 0x7FFFFF) != 0).to(tl.int32)  # ceil to a power of two
        inv = ((254 - exp) << 23).to(tl.float32, bitcast=True)
        code = _encode_e4m3(x * inv[:, None])
        tl.store(c_row + g * GROUP + cols, code.to(tl.uint8), mask=mask[:, None])
        tl.store(scales + rows.to(tl.int64) * (ENTRY // 4) + g, exp << 23, mask=mask)
    r_cols = tl.arange(0, D_R)[None, :]
    rope = (C + D_C + 4 * (D_C // GROUP)).to(tl.pointer_type(tl.int16))
    r_out = rope + rows.to(tl.int64)[:, None] * (ENTRY // 2) + r_cols
    if BF16_IN:
        r_in = (X + D_C).to(tl.pointer_type(tl.int16))
        r = tl.load(r_in + rows.to(tl.int64)[:, None] * stride_x + r_cols, mask=mask[:, None])
        tl.store(r_out, r, mask=mask[:, None])
    else:
        r = tl.load(x_row + D_C + r_cols, mask=mask[:, None], other=0.0)
        r = round_to(r, tl.bfloat16, BF16_RNE).to(tl.int16, bitcast=True)
        tl.store(r_out, r, mask=mask[:, None])


@triton.jit(do_not_specialize=["N"])
def _dequantize_kernel(
    C,
    Y,
    N,
    D_C: tl.constexpr,
    D_R: tl.constexpr,
    GROUP: tl.constexpr,
    ENTRY: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BF16_RNE: tl.constexpr,
):
    """Grid ``ceil(N / BLOCK_T)``: rows of ``BLOCK_T`` entries (``Y`` contiguous)."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    mask = rows < N
    c_row = C + rows.to(tl.int64)[:, None] * ENTRY
    y_row = Y + rows.to(tl.int64)[:, None] * (D_C + D_R)
    cols = tl.arange(0, GROUP)[None, :]
    scales = (C + D_C).to(tl.pointer_type(tl.float32))
    for g in tl.static_range(D_C // GROUP):
        code = tl.load(c_row + g * GROUP + cols, mask=mask[:, None], other=0).to(tl.int32)
        scale = tl.load(scales + rows.to(tl.int64) * (ENTRY // 4) + g, mask=mask, other=1.0)
        v = _decode_e4m3(code) * scale[:, None]
        tl.store(
            y_row + g * GROUP + cols, round_to(v, Y.dtype.element_ty, BF16_RNE), mask=mask[:, None]
        )
    r_cols = tl.arange(0, D_R)[None, :]
    rope = (C + D_C + 4 * (D_C // GROUP)).to(tl.pointer_type(tl.int16))
    r = tl.load(rope + rows.to(tl.int64)[:, None] * (ENTRY // 2) + r_cols, mask=mask[:, None])
    r = r.to(tl.bfloat16, bitcast=True).to(Y.dtype.element_ty)
    tl.store(y_row + D_C + r_cols, r, mask=mask[:, None])


def entry_bytes(d_c: int, d_r: int) -> int:
    """Bytes of one entry: ``d_c + 4 d_c / 128 + 2 d_r`` (656 at 512 + 64)."""
    return d_c + 4 * (d_c // GROUP) + 2 * d_r


def _check_widths(name: str, d_c: int, d_r: int) -> None:
    check_int("d_c", d_c, minimum=GROUP)
    if d_c % GROUP:
        raise ValueError(f"d_c: expected a multiple of {GROUP} (one scale per {GROUP}), got {d_c}")
    if d_r < 16 or d_r & (d_r - 1):
        raise ValueError(
            f"{name}: expected a RoPE width (width - d_c) that is a power of two >= 16 (the "
            f"kernel tiles it), got {d_r}"
        )


def check_rows(x: object, d_c: object) -> int:
    """``x [..., d_c + d_r]`` bf16 / fp32, finite (one host sync), the widths tileable;
    returns ``d_r``."""
    if not isinstance(x, torch.Tensor) or x.dtype not in _IN_DTYPES:
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(f"x: expected a bfloat16 or float32 tensor, got {got}")
    check_int("d_c", d_c, minimum=1)
    if x.dim() == 0 or x.shape[-1] <= d_c:
        raise ValueError(f"x: expected rows wider than d_c {d_c}, got shape {tuple(x.shape)}")
    d_r = x.shape[-1] - d_c
    _check_widths("x", d_c, d_r)
    ok = x.abs() < X_LIMIT  # False for NaN too: one pass checks both
    if not bool(ok.all()):
        bad = (~ok).nonzero()[0].tolist()
        raise ValueError(
            f"x: expected finite cache values of magnitude < {X_LIMIT:.6g} (248 * 2**120: from "
            f"there e4m3 rounds to 2**128, past float32), got {x[tuple(bad)].item()} at {bad}"
        )
    return d_r


def check_entries(cache: object, d_c: object, d_r: object, name: str = "cache") -> None:
    """``cache [..., entry_bytes(d_c, d_r)]`` uint8 whose scales are finite and > 0 and whose
    latent bytes are no NaN (one host sync); errors name ``name``."""
    if not isinstance(cache, torch.Tensor) or cache.dtype != torch.uint8:
        got = cache.dtype if isinstance(cache, torch.Tensor) else type(cache).__name__
        raise TypeError(f"{name}: expected a uint8 tensor of FP8 entries, got {got}")
    check_int("d_c", d_c, minimum=1)
    check_int("d_r", d_r, minimum=1)
    _check_widths("d_r", d_c, d_r)
    want = entry_bytes(d_c, d_r)
    if cache.dim() == 0 or cache.shape[-1] != want:
        raise ValueError(
            f"{name}: expected entries of {want} bytes ({d_c} FP8 latent, {d_c // GROUP} fp32 "
            f"scales, {d_r} bf16 RoPE values) on the last dim, got shape {tuple(cache.shape)} "
            "(scales missing?)"
        )
    flat = cache.reshape(-1, want)
    bad = bad_fp8_entries(flat, d_c)
    if bool(bad.any()):
        first = int(bad.nonzero()[0, 0])
        at = [int(i) for i in torch.unravel_index(torch.tensor(first), cache.shape[:-1])]
        raise_bad_fp8_entry(name, flat[first], d_c, f"the entry at {at}")


def quantize_launch(x: torch.Tensor, d_c: int, out: torch.Tensor) -> Launch:
    """The launch writing ``out [N, entry]`` uint8 (contiguous) from ``x [N, d_c + d_r]``
    (unit stride on the last dim; inputs valid)."""
    N, width = x.shape
    d_r = width - d_c
    return Launch(
        name=f"fp8_quantize[{str(x.dtype)[6:]},d={d_c}+{d_r},{BLOCK_T}]",
        kernel=_quantize_kernel,
        grid=(triton.cdiv(N, BLOCK_T),),
        args=(x, out, N, x.stride(0)),
        kwargs=dict(
            D_C=d_c,
            D_R=d_r,
            GROUP=GROUP,
            ENTRY=entry_bytes(d_c, d_r),
            BLOCK_T=BLOCK_T,
            BF16_IN=x.dtype == torch.bfloat16,
            BF16_RNE=bf16_rne_in_software(torch.bfloat16, x.device),
            num_warps=4,
        ),
    )


def dequantize_launch(cache: torch.Tensor, d_c: int, d_r: int, out: torch.Tensor) -> Launch:
    """The launch writing ``out [N, d_c + d_r]`` (contiguous) from ``cache [N, entry]`` uint8
    (contiguous; entries valid)."""
    N = cache.shape[0]
    return Launch(
        name=f"fp8_dequantize[{str(out.dtype)[6:]},d={d_c}+{d_r},{BLOCK_T}]",
        kernel=_dequantize_kernel,
        grid=(triton.cdiv(N, BLOCK_T),),
        args=(cache, out, N),
        kwargs=dict(
            D_C=d_c,
            D_R=d_r,
            GROUP=GROUP,
            ENTRY=entry_bytes(d_c, d_r),
            BLOCK_T=BLOCK_T,
            BF16_RNE=bf16_rne_in_software(out.dtype, out.device),
            num_warps=4,
        ),
    )


@fp8_quantize.op.implementation("triton")
def _quantize(call) -> torch.Tensor:
    x, d_c = call.x, call.d_c
    d_r = check_rows(x, d_c)
    check_launchable(x, "x")
    lead = x.shape[:-1]
    rows = x.reshape(-1, d_c + d_r)
    if rows.shape[0] and rows.stride(-1) != 1:
        rows = rows.contiguous()
    shape = (rows.shape[0], entry_bytes(d_c, d_r))
    # poisoned: 0xFF bytes (a NaN latent, NaN scales, NaN RoPE) where the kernel writes nothing
    out = torch.full(shape, 0xFF, dtype=torch.uint8, device=x.device) if poisoning() else None
    out = torch.empty(shape, dtype=torch.uint8, device=x.device) if out is None else out
    if rows.shape[0]:
        quantize_launch(rows, d_c, out)()
    return out.reshape(*lead, out.shape[-1])


@fp8_dequantize.op.implementation("triton")
def _dequantize(call) -> torch.Tensor:
    cache, d_c, d_r, dtype = call.cache, call.d_c, call.d_r, call.dtype
    check_entries(cache, d_c, d_r)
    if dtype not in _IN_DTYPES:
        raise TypeError(f"dtype: expected torch.bfloat16 or torch.float32, got {dtype}")
    check_launchable(cache, "cache")
    lead = cache.shape[:-1]
    entries = cache.reshape(-1, cache.shape[-1]).contiguous()
    out = new_output((entries.shape[0], d_c + d_r), dtype, cache.device)
    if entries.shape[0]:
        dequantize_launch(entries, d_c, d_r, out)()
    return out.reshape(*lead, d_c + d_r)
