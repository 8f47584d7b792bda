"""fp64 reference of the FP8 cache quantizer and its inverse (DeepSeek-V3.2's 656-byte entry).

The entry of a ``d_c + d_r`` wide cache row (``mqnc.model.kv_format``, FlashMLA's
``V32_FP8Sparse``): ``d_c`` FP8 e4m3fn latent bytes, ``d_c / group`` float32 scales, ``d_r``
bfloat16 RoPE values. Per group of ``group`` latent values::

    s_inv = fp32(amax / 448)                   (amax: the group's largest |x|)
    scale = 2 ** ceil(log2(max(s_inv, fp32(1e-4))))
    q     = RNE_e4m3(x / scale)                 (|x / scale| <= 448: nothing saturates)

Everything here is computed in float64 and exactly: ``x / scale`` is exact (a power of two),
the e4m3 rounding is done on the fp64 value (round half to even at the spacing of its binade,
``2**-9`` below ``2**-6``), and torch only stores the already-rounded value. So the Triton
kernel's bytes must equal these bit for bit. The RoPE part is the input rounded once to bf16
(a bf16 input is copied bit for bit).

Error bound of ``dequantize(quantize(x))`` against ``x`` (fp64), per latent value:
``|err| <= max(2**-4 |x|, 2**-10 scale)``: e4m3 keeps 3 mantissa bits, so a normal ``y = x /
scale`` (``|y| >= 2**-6``) is within half a spacing, ``2**-4 |y|``; a subnormal within
``2**-10``. Since ``scale < 2 amax / 448`` (unless floored), every error is at most
``2**-4 amax`` of its group.

Only the bf16 / fp32 inputs and the uint8 cache of the Triton op are taken; bad values are a
``ValueError`` naming the argument.
"""

from __future__ import annotations

import torch
from einops import rearrange

__all__ = ["fp8_quantize_reference", "fp8_dequantize_reference", "E4M3_MAX", "SCALE_FLOOR"]

E4M3_MAX = 448.0
SCALE_FLOOR = 1e-4
X_LIMIT = 248.0 * 2.0**120  # from |x| = 248 * 2**120 on, e4m3 rounds x / 2**120 to 256: 2**128
_IN_DTYPES = (torch.bfloat16, torch.float32)


def _check_layout(d_c: int, d_r: int, group: int) -> None:
    if d_c < 1 or d_r < 1 or d_c % group:
        raise ValueError(
            f"d_c: expected a positive multiple of the scale group {group} and a positive RoPE "
            f"width, got d_c {d_c}, d_r {d_r}"
        )


def _token_bytes(d_c: int, d_r: int, group: int) -> int:
    return d_c + 4 * (d_c // group) + 2 * d_r


def _pow2_ceil(s: torch.Tensor) -> torch.Tensor:
    """``2 ** ceil(log2(s))`` of positive float64 ``s``, exactly (``frexp``, no ``log2``)."""
    m, e = torch.frexp(s)
    return torch.ldexp(torch.ones_like(s), torch.where(m == 0.5, e - 1, e).to(s.dtype))


def _rne_e4m3(y: torch.Tensor) -> torch.Tensor:
    """``y`` (float64, ``|y| <= 448``) rounded to the nearest e4m3 value, ties to even."""
    a = y.abs()
    _, e = torch.frexp(a)  # a = m 2**e, m in [0.5, 1): the binade is 2**(e - 1)
    step = torch.ldexp(torch.ones_like(a), (torch.clamp(e - 1, min=-6) - 3).to(a.dtype))
    return torch.copysign(torch.round(a / step) * step, y)


def fp8_quantize_reference(x: torch.Tensor, d_c: int, group: int = 128) -> torch.Tensor:
    """Quantize cache rows to FP8 entries.

    Parameters
    ----------
    x : torch.Tensor
        ``[..., d_c + d_r]`` bf16 or float32 cache rows (latent first, RoPE last), finite and
        of magnitude below ``248 * 2**120`` (~3.3e38; above, the dequantized value overflows).
    d_c : int
        Latent width (a multiple of ``group``).
    group : int
        Latent values per fp32 scale (128).

    Returns
    -------
    torch.Tensor
        ``[..., d_c + 4 d_c / group + 2 d_r]`` uint8 (656 for 512 + 64): the entries.
    """
    if not isinstance(x, torch.Tensor) or x.dtype not in _IN_DTYPES:
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(f"x: expected a bfloat16 or float32 tensor, got {got}")
    d_r = x.shape[-1] - d_c if x.dim() else 0
    _check_layout(d_c, d_r, group)
    ok = x.abs() < X_LIMIT  # False for NaN too
    if not bool(ok.all()):
        bad = (~ok).nonzero()[0].tolist()
        raise ValueError(
            f"x: expected finite cache values of magnitude < {X_LIMIT:.6g} (248 * 2**120: from "
            f"there e4m3 rounds to 2**128, past float32), got {x[tuple(bad)].item()} at {bad}"
        )
    # the latent dims as groups of ``group`` values, each with its own scale
    lat = rearrange(x[..., :d_c].double(), "... (g k) -> ... g k", k=group)
    s_inv = (lat.abs().amax(-1) / E4M3_MAX).float().double()
    scale = _pow2_ceil(torch.clamp(s_inv, min=torch.tensor(SCALE_FLOOR).float().item()))
    q = rearrange(_rne_e4m3(lat / scale[..., None]), "... g k -> ... (g k)")
    parts = (
        q.to(torch.float8_e4m3fn).view(torch.uint8),
        scale.float().contiguous().view(torch.uint8),
        x[..., d_c:].to(torch.bfloat16).contiguous().view(torch.uint8),
    )
    return torch.cat(parts, dim=-1)


def _check_entries(cache: torch.Tensor, d_c: int, d_r: int, group: int) -> None:
    if not isinstance(cache, torch.Tensor) or cache.dtype != torch.uint8:
        got = cache.dtype if isinstance(cache, torch.Tensor) else type(cache).__name__
        raise TypeError(f"cache: expected a uint8 tensor of FP8 entries, got {got}")
    _check_layout(d_c, d_r, group)
    want = _token_bytes(d_c, d_r, group)
    if cache.dim() == 0 or cache.shape[-1] != want:
        got = tuple(cache.shape)
        raise ValueError(
            f"cache: expected entries of {want} bytes ({d_c} FP8 latent, {d_c // group} fp32 "
            f"scales, {d_r} bf16 RoPE values) on the last dim, got shape {got} (scales missing?)"
        )


def fp8_dequantize_reference(
    cache: torch.Tensor, d_c: int, d_r: int, dtype: torch.dtype, group: int = 128
) -> torch.Tensor:
    """Dequantize FP8 entries: ``fp8 * scale`` exactly (fp64), rounded to float32, then to
    ``dtype`` (FlashMLA's order: the product in fp32; for a power-of-two scale every step is
    exact, for another finite positive one the float32 rounding is the kernel's one multiply).

    Parameters
    ----------
    cache : torch.Tensor
        ``[..., d_c + 4 d_c / group + 2 d_r]`` uint8 entries; every scale finite and > 0, no
        latent byte a NaN (``0x7F`` / ``0xFF``).
    d_c, d_r : int
        Latent and RoPE widths.
    dtype : torch.dtype
        ``torch.bfloat16`` or ``torch.float32``.
    group : int
        Latent values per scale (128).

    Returns
    -------
    torch.Tensor
        ``[..., d_c + d_r]`` in ``dtype``.
    """
    _check_entries(cache, d_c, d_r, group)
    if dtype not in _IN_DTYPES:
        raise TypeError(f"dtype: expected torch.bfloat16 or torch.float32, got {dtype}")
    cache = cache.contiguous()
    G = d_c // group
    scale = cache[..., d_c : d_c + 4 * G].contiguous().view(torch.float32)
    bad = ~(torch.isfinite(scale) & (scale > 0))
    if bool(bad.any()):
        where = bad.nonzero()[0].tolist()
        raise ValueError(
            f"cache: expected every scale finite and > 0, got {scale[tuple(where)].item()} "
            f"(scale {where[-1]} of the entry at {where[:-1]})"
        )
    lat = cache[..., :d_c]
    nan = (lat & 0x7F) == 0x7F
    if bool(nan.any()):
        where = nan.nonzero()[0].tolist()
        raise ValueError(f"cache: expected no NaN latent byte (0x7F / 0xFF), got one at {where}")
    v = rearrange(lat.view(torch.float8_e4m3fn).double(), "... (g k) -> ... g k", g=G)
    v = rearrange((v * scale.double()[..., None]).float(), "... g k -> ... (g k)")  # in fp32
    rope = cache[..., d_c + 4 * G :].contiguous().view(torch.bfloat16)
    return torch.cat([v.to(dtype), rope.to(dtype)], dim=-1)
