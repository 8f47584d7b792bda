"""Cache formats: how one token's cache entry (one layer) is laid out in bytes.

Two kinds of entry exist:

- a **16/32-bit entry** (``"bf16"``, ``"fp16"``, ``"fp32"``): the ``d_qk = d_c + d_r`` values
  in that dtype, latent first, RoPE last (1152 B for DeepSeek's 576 dims in bf16);
- the **FP8 entry** (``"fp8_e4m3"``, DeepSeek-V3.2's sparse FP8 cache as FlashMLA reads it,
  ``FP8KVCacheLayout.V32_FP8Sparse`` in FlashMLA's ``tests/quant.py``): 656 B for 512 + 64 dims.

The FP8 entry, byte by byte (little-endian, as on every GPU)::

    offset  size            what
    0       d_c             latent c_KV, FP8 e4m3fn (OCP: bias 7, no inf, max 448), one byte each
    d_c     4 * d_c / 128   one float32 scale per group of 128 latent values, in group order
    ..      2 * d_r         k_pe, the RoPE part, bfloat16 (never quantized: RoPE is rotated)

A latent value is ``fp8 * scale`` of its group. The scale is FlashMLA's: a power of two, the
smallest one at least ``max(amax / 448, 1e-4)`` (``amax`` the group's largest magnitude, the
division done in float32; ``2**ceil(log2(.))``), so that ``x / scale`` is exact and at most 448
(no saturation), and dequantizing is exact in bf16 and fp32. This module is pure data (no
torch): the quantizer (``mqnc.triton_kernels.fp8.quant``), its fp64 reference
(``mqnc.reference.fp8_ref``) and :class:`~mqnc.model.MLAGeometry`'s ``b_KV`` are checked
against it.

>>> fmt = FP8_E4M3.layout(d_c=512, d_r=64)
>>> fmt.token_bytes, fmt.scale_offset, fmt.rope_offset, fmt.groups
(656, 512, 528, 4)
"""

from __future__ import annotations

import dataclasses

__all__ = [
    "FP8_E4M3",
    "FP8Layout",
    "FP8Format",
    "KV_FORMATS",
    "E4M3_MAX",
    "SCALE_FLOOR",
    "kv_bytes_per_token",
]

E4M3_MAX = 448.0
"""The largest finite FP8 e4m3fn value (``1.75 * 2**8``)."""

SCALE_FLOOR = 1e-4
"""The smallest ``amax / 448`` a scale is taken from (FlashMLA's ``clamp_min(., 1e-4)``): a
group whose ``amax < 0.0448`` (all zeros included) gets the scale ``2**-13``."""

_PLAIN_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


@dataclasses.dataclass(frozen=True)
class FP8Layout:
    """The byte layout of one FP8 entry of a ``d_c + d_r`` wide cache.

    Attributes
    ----------
    d_c, d_r : int
        Latent and RoPE widths (``d_c`` a multiple of ``group``; ``d_r`` even).
    group : int
        Latent values per scale (128).
    """

    d_c: int
    d_r: int
    group: int = 128

    def __post_init__(self) -> None:
        for field in ("d_c", "d_r", "group"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"FP8Layout.{field}: expected a positive int, got {value!r}")
        if self.d_c % self.group:
            raise ValueError(
                f"FP8Layout.d_c: expected a multiple of the scale group {self.group} (one fp32 "
                f"scale per {self.group} latent values), got {self.d_c}"
            )

    @property
    def groups(self) -> int:
        """Scales per entry: ``d_c / group``."""
        return self.d_c // self.group

    @property
    def latent_offset(self) -> int:
        return 0

    @property
    def scale_offset(self) -> int:
        """Byte offset of the first float32 scale (4-byte aligned when ``d_c`` is)."""
        return self.d_c

    @property
    def rope_offset(self) -> int:
        """Byte offset of the bf16 RoPE part."""
        return self.d_c + 4 * self.groups

    @property
    def token_bytes(self) -> int:
        """Bytes of one entry (one token, one layer): ``d_c + 4 d_c / group + 2 d_r``."""
        return self.rope_offset + 2 * self.d_r

    def fields(self) -> tuple[tuple[str, int, int, str], ...]:
        """``(name, offset, bytes, element type)`` of each part, in byte order (the figure of
        ``docs/fp8-cache.md``)."""
        return (
            ("latent", self.latent_offset, self.d_c, "float8_e4m3fn"),
            ("scales", self.scale_offset, 4 * self.groups, "float32"),
            ("rope", self.rope_offset, 2 * self.d_r, "bfloat16"),
        )


@dataclasses.dataclass(frozen=True)
class FP8Format:
    """The FP8 cache format: its name, scale group and element limits."""

    name: str = "fp8_e4m3"
    group: int = 128
    max_value: float = E4M3_MAX
    scale_floor: float = SCALE_FLOOR

    def layout(self, d_c: int, d_r: int) -> FP8Layout:
        """The byte layout of an entry of ``d_c + d_r`` dims."""
        return FP8Layout(d_c=d_c, d_r=d_r, group=self.group)


FP8_E4M3 = FP8Format()
"""DeepSeek-V3.2's FP8 cache (FlashMLA's ``V32_FP8Sparse``): 656 B per token for 512 + 64."""

KV_FORMATS = ("bf16", "fp16", "fp32", FP8_E4M3.name)
"""The cache formats an :class:`~mqnc.model.MLAGeometry`'s ``cache_dtype`` can name."""


def kv_bytes_per_token(cache_dtype: str, d_c: int, d_r: int) -> int:
    """``b_KV``: bytes of one cache entry in ``cache_dtype`` (one of :data:`KV_FORMATS`).

    >>> kv_bytes_per_token("bf16", 512, 64), kv_bytes_per_token("fp8_e4m3", 512, 64)
    (1152, 656)
    """
    if cache_dtype == FP8_E4M3.name:
        return FP8_E4M3.layout(d_c, d_r).token_bytes
    if cache_dtype not in _PLAIN_BYTES:
        raise ValueError(f"cache_dtype: expected one of {list(KV_FORMATS)}, got {cache_dtype!r}")
    return (d_c + d_r) * _PLAIN_BYTES[cache_dtype]
