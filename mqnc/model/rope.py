"""The decoupled-RoPE specification of an MLA model: frequencies, YaRN factors, pair layout.

A cache entry's last ``d_r = 64`` dims hold ``k_pe``, the decoupled RoPE key (§2.1), stored
already rotated to its token's position ``p``: ``k_pe(p) = a * R(p) k`` where ``R(p)`` rotates
pair ``i`` by the angle ``p * inv_freq[i]`` and ``a`` is YaRN's cos/sin factor
(:attr:`RopeSpec.attention_factor`, 1.0 for DeepSeek-V2-Lite and V3). Since
``R(a) R(b) = R(a + b)``, re-homing a chunk cached at canonical positions to a new offset is the
pure rotation ``R(delta)``, ``delta = new - old`` (§2.2): no ``a`` factor is applied again.

Frequencies, exactly as DeepSeek computes them (``DeepseekV2YarnRotaryEmbedding`` in the model
repositories' ``modeling_deepseek.py``, and ``_compute_yarn_parameters`` in transformers), in
float32 torch arithmetic, in this order::

    pos_freqs   = theta ** (arange(0, d_r, 2, float32) / d_r)
    freq_extra  = 1 / pos_freqs                                  (extrapolation)
    freq_inter  = 1 / (factor * pos_freqs)                       (interpolation)
    low, high   = yarn_find_correction_range(beta_fast, beta_slow, d_r, theta, original_max)
    mask        = 1 - clamp((arange(d_r // 2) - low) / (high - low), 0, 1)
    inv_freq    = freq_inter * (1 - mask) + freq_extra * mask

The model runs with these float32 values, so :attr:`RopeSpec.inv_freq` holds them exactly (as
Python floats); the references then compute angles from them in float64 and the kernels in
float64 with an exact mod-2π reduction (see :mod:`mqnc.triton_kernels.splice.rotate`).

A model whose own frequencies are not these values gives them as :attr:`RopeSpec.frequencies`
(:attr:`~RopeSpec.inv_freq` then returns them): a transformers model cast with
``model.to(torch.bfloat16)`` also casts its rotary buffer ``inv_freq``, and encodes every position
with the rounded frequencies; a chunk moved by ``delta`` must then be rotated by ``R(delta)`` of
those same frequencies, or the relative angles drift with ``delta * (rounded - exact)``
(:func:`mqnc.integrations.hf.rope_spec_of` reads the buffer).

Softmax scale (what the attention kernels take): ``qk_head_dim ** -0.5 * m ** 2`` with
``m = 0.1 * mscale_all_dim * ln(factor) + 1`` (YaRN's attention temperature), e.g.
DeepSeek-V2-Lite: ``192 ** -0.5 * 1.2608 ** 2 = 0.11472``.

Pair layouts of the 64 rope dims, and which caches use which:

``"interleaved"`` (the default)
    pair ``i`` is ``(x[2i], x[2i+1])``. DeepSeek's own inference code (``view_as_complex``),
    vLLM and SGLang (``is_neox_style=False``) and transformers' ``DeepseekV2`` model (complex
    multiply) rotate these pairs and cache ``k_pe`` in this layout.
``"half"``
    pair ``i`` is ``(x[i], x[i + 32])``, rotated with ``rotate_half``. transformers'
    ``DeepseekV3`` model and the remote-code ``modeling_deepseek.py`` of the DeepSeek
    checkpoints take interleaved projection outputs, permute them to halves and then apply
    ``rotate_half`` (``apply_rotary_pos_emb_interleave`` / ``q.view(..., d // 2, 2)
    .transpose``), so the ``k_pe`` they cache is in this layout.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from mqnc.base.checks import check_int
from mqnc.model.geometry import PRESET_CONFIGS, hf_config_dict

__all__ = [
    "RopeSpec",
    "YarnScaling",
    "LAYOUTS",
    "ROPE_PRESET_CONFIGS",
    "yarn_get_mscale",
    "yarn_find_correction_range",
    "pair_indices",
]

LAYOUTS = ("interleaved", "half")


def yarn_get_mscale(scale: float = 1.0, mscale: float = 1.0) -> float:
    """YaRN's temperature factor ``0.1 * mscale * ln(scale) + 1`` (1.0 when ``scale <= 1``)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def _yarn_find_correction_dim(num_rotations: float, dim: int, base: float, max_pos: int) -> float:
    return (dim * math.log(max_pos / (num_rotations * 2 * math.pi))) / (2 * math.log(base))


def yarn_find_correction_range(
    low_rot: float, high_rot: float, dim: int, base: float, max_pos: int, truncate: bool = True
) -> tuple[float, float]:
    """Pair-index range ``[low, high]`` over which YaRN blends interpolation into extrapolation.

    DeepSeek's ``yarn_find_correction_range`` (floor/ceil, i.e. ``truncate=True``), clamped to
    ``[0, dim - 1]``; for DeepSeek-V2-Lite (theta 1e4, d_r 64, original max 4096,
    beta_fast 32, beta_slow 1) it is ``(10, 23)``.
    """
    low = _yarn_find_correction_dim(low_rot, dim, base, max_pos)
    high = _yarn_find_correction_dim(high_rot, dim, base, max_pos)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def pair_indices(layout: str, rope_dim: int = 64) -> tuple[list[int], list[int]]:
    """Positions of the two members of each pair within the ``rope_dim`` dims.

    Returns ``(first, second)``, lists of ``rope_dim // 2`` indices: pair ``i`` is
    ``(x[first[i]], x[second[i]])``, rotated by ``inv_freq[i]``.
    """
    half = rope_dim // 2
    if layout == "interleaved":
        return [2 * i for i in range(half)], [2 * i + 1 for i in range(half)]
    if layout == "half":
        return list(range(half)), [i + half for i in range(half)]
    raise ValueError(f"layout: expected one of {LAYOUTS}, got {layout!r}")


@dataclasses.dataclass(frozen=True)
class YarnScaling:
    """YaRN ``rope_scaling`` parameters, as in a DeepSeek config.

    ``attention_factor`` overrides the cos/sin factor when a config gives it explicitly
    (transformers' ``rope_parameters`` may); None: ``mscale / mscale_all_dim`` rule.
    """

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    def __post_init__(self) -> None:
        if not (isinstance(self.factor, (int, float)) and self.factor > 0):
            raise ValueError(
                f"rope_scaling.factor: expected a positive number, got {self.factor!r}"
            )
        check_int(
            "rope_scaling.original_max_position_embeddings",
            self.original_max_position_embeddings,
            minimum=1,
        )


# The presets whose published config carries its RoPE fields (rope_theta, rope_scaling): one
# dict per model, kept with the other published fields in mqnc.model.geometry.PRESET_CONFIGS.
ROPE_PRESET_CONFIGS: dict[str, dict[str, Any]] = {
    name: cfg for name, cfg in PRESET_CONFIGS.items() if "rope_scaling" in cfg
}


@dataclasses.dataclass(frozen=True)
class RopeSpec:
    """Decoupled-RoPE parameters of one MLA model (see the module docstring for the formulas).

    Parameters
    ----------
    theta : float
        ``rope_theta`` (10000 for DeepSeek).
    rope_dim : int
        ``qk_rope_head_dim`` ``d_r``: the rotated dims at the end of each 576-wide entry (64).
    qk_head_dim : int
        ``qk_nope_head_dim + qk_rope_head_dim`` of the un-absorbed model (192 for DeepSeek);
        only sets the softmax scale.
    yarn : YarnScaling or None
        YaRN scaling, None for plain RoPE.
    layout : {"interleaved", "half"}
        Pair layout of the cached rope dims.
    frequencies : sequence of float or None
        The model's own ``rope_dim // 2`` per-pair frequencies (finite, >= 0) where they are not
        the ones ``theta`` and ``yarn`` give in float32 (a model cast to bf16 rounds its rotary
        buffer and encodes positions with the rounded values); None: computed (module
        docstring). :attr:`inv_freq` returns them; ``yarn`` still sets the scales.

    Examples
    --------
    >>> from mqnc.model import RopeSpec
    >>> spec = RopeSpec.from_preset("deepseek-v2-lite")
    >>> len(spec.inv_freq), spec.attention_factor, round(spec.softmax_scale, 5)
    (32, 1.0, 0.11472)
    """

    theta: float = 10000.0
    rope_dim: int = 64
    qk_head_dim: int = 192
    yarn: YarnScaling | None = None
    layout: str = "interleaved"
    frequencies: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout: expected one of {LAYOUTS}, got {self.layout!r}")
        if check_int("rope_dim", self.rope_dim, minimum=2) % 2:
            raise ValueError(f"rope_dim: expected an even int (RoPE pairs), got {self.rope_dim}")
        if not (isinstance(self.theta, (int, float)) and self.theta > 1):
            raise ValueError(f"theta: expected a number > 1, got {self.theta!r}")
        check_int("qk_head_dim", self.qk_head_dim, minimum=1)
        if self.frequencies is not None:
            # a tuple of floats whatever sequence came in (a corpus manifest gives a JSON list)
            object.__setattr__(
                self, "frequencies", _check_frequencies(self.frequencies, self.pairs)
            )

    # ---- construction --------------------------------------------------------------------------
    @classmethod
    def from_hf_config(
        cls, config: Mapping[str, Any] | Any, layout: str = "interleaved"
    ) -> RopeSpec:
        """Build from a Hugging Face config (a dict or a ``PretrainedConfig``).

        Reads ``qk_rope_head_dim``, ``qk_nope_head_dim`` and either the older form
        (``rope_theta`` at top level plus ``rope_scaling = {"type"/"rope_type": "yarn",
        factor, original_max_position_embeddings, beta_fast, beta_slow, mscale,
        mscale_all_dim}``) or the newer ``rope_parameters`` dict (transformers >= 5: the same
        keys plus ``rope_theta`` and ``rope_type``). A missing ``factor`` is
        ``max_position_embeddings / original_max_position_embeddings`` (as transformers does).
        ``layout`` is not in any config: it is a property of the code that wrote the cache
        (module docstring).
        """
        config = hf_config_dict(config, "qk_rope_head_dim")
        rope_dim = config.get("qk_rope_head_dim")
        if rope_dim is None:
            raise ValueError("config: not an MLA config, missing 'qk_rope_head_dim'")
        nope = config.get("qk_nope_head_dim")
        nope = 128 if nope is None else nope  # only an absent width defaults (a 0 stays 0)
        rope_dim = check_int("qk_rope_head_dim", rope_dim, minimum=2)
        nope = check_int("qk_nope_head_dim", nope, minimum=1)
        params = config.get("rope_parameters")
        scaling = config.get("rope_scaling")
        if isinstance(params, Mapping) and params:
            theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
            scaling = params
        else:
            theta = config.get("rope_theta", 10000.0)
        yarn = _yarn_of(scaling, config) if isinstance(scaling, Mapping) and scaling else None
        return cls(
            theta=float(theta),
            rope_dim=rope_dim,
            qk_head_dim=nope + rope_dim,
            yarn=yarn,
            layout=layout,
        )

    @classmethod
    def from_preset(cls, name: str, layout: str = "interleaved") -> RopeSpec:
        """The spec of a preset in :data:`ROPE_PRESET_CONFIGS` (``"deepseek-v2-lite"``, ...)."""
        try:
            cfg = ROPE_PRESET_CONFIGS[name]
        except KeyError:
            raise ValueError(
                f"model: unknown rope preset {name!r}; "
                f"expected one of {sorted(ROPE_PRESET_CONFIGS)}"
            ) from None
        return cls.from_hf_config(cfg, layout=layout)

    def replace(self, **changes: Any) -> RopeSpec:
        """A copy with some fields changed (e.g. ``layout="half"`` or ``yarn=None``)."""
        return dataclasses.replace(self, **changes)

    # ---- derived quantities --------------------------------------------------------------------
    @property
    def pairs(self) -> int:
        """Number of rotated pairs, ``rope_dim // 2`` (32)."""
        return self.rope_dim // 2

    @property
    def inv_freq(self) -> tuple[float, ...]:
        """The ``rope_dim // 2`` per-pair frequencies (rad per position): :attr:`frequencies`
        when given, else DeepSeek's float32 values exactly (computed once with torch in
        float32, in DeepSeek's operation order)."""
        if self.frequencies is not None:
            return self.frequencies
        return _inv_freq_fp32(self.theta, self.rope_dim, self.yarn)

    @property
    def attention_factor(self) -> float:
        """YaRN's cos/sin factor ``a`` (encoding is ``a * R(p)``): ``attention_factor`` if the
        config gives it, else ``get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)``
        when both are set, else ``get_mscale(factor)``; 1.0 without YaRN."""
        y = self.yarn
        if y is None:
            return 1.0
        if y.attention_factor is not None:
            return float(y.attention_factor)
        if y.mscale and y.mscale_all_dim:
            return float(
                yarn_get_mscale(y.factor, y.mscale) / yarn_get_mscale(y.factor, y.mscale_all_dim)
            )
        return float(yarn_get_mscale(y.factor))

    @property
    def softmax_mscale(self) -> float:
        """YaRN's softmax temperature factor ``0.1 * mscale_all_dim * ln(factor) + 1``
        (1.0 without YaRN or without ``mscale_all_dim``); the scale uses its square."""
        y = self.yarn
        if y is None or not y.mscale_all_dim:
            return 1.0
        return yarn_get_mscale(y.factor, y.mscale_all_dim)

    @property
    def softmax_scale(self) -> float:
        """The attention softmax scale ``qk_head_dim ** -0.5 * softmax_mscale ** 2``."""
        return self.qk_head_dim**-0.5 * self.softmax_mscale**2

    def pair_indices(self) -> tuple[list[int], list[int]]:
        """``(first, second)`` positions of each pair's members in this spec's layout."""
        return pair_indices(self.layout, self.rope_dim)


def _check_frequencies(values: Any, pairs: int) -> tuple[float, ...]:
    """``values`` as a tuple of ``pairs`` finite floats >= 0, else a ``ValueError`` (a
    ``TypeError`` for a non-number) naming ``frequencies``."""
    if isinstance(values, (str, bytes)) or not hasattr(values, "__len__"):
        raise TypeError(
            f"frequencies: expected a sequence of {pairs} floats, got {type(values).__name__}"
        )
    if len(values) != pairs:
        raise ValueError(
            f"frequencies: expected rope_dim // 2 = {pairs} per-pair frequencies, got {len(values)}"
        )
    bad = [v for v in values if isinstance(v, bool) or not isinstance(v, (int, float))]
    if bad:
        raise TypeError(f"frequencies: expected floats, got {type(bad[0]).__name__} {bad[0]!r}")
    out = tuple(float(v) for v in values)
    bad = [v for v in out if not (math.isfinite(v) and v >= 0)]
    if bad:
        raise ValueError(f"frequencies: expected finite values >= 0, got {bad[0]!r}")
    return out


def _yarn_of(scaling: Mapping[str, Any], config: Mapping[str, Any]) -> YarnScaling | None:
    """The YaRN parameters of a config's ``rope_scaling`` / ``rope_parameters`` (None for the
    ``"default"`` type; any other type is an error)."""
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return None
    if kind != "yarn":
        raise ValueError(
            f"config: rope scaling type {kind!r} is not supported; expected 'yarn' or 'default'"
        )
    ompe = scaling.get("original_max_position_embeddings")
    if ompe is None:
        raise ValueError("config: yarn rope scaling without 'original_max_position_embeddings'")
    factor = scaling.get("factor")
    if factor is None:
        mpe = config.get("max_position_embeddings")
        if mpe is None:
            raise ValueError(
                "config: yarn rope scaling without 'factor' or 'max_position_embeddings'"
            )
        factor = mpe / ompe
    return YarnScaling(
        factor=float(factor),
        original_max_position_embeddings=int(ompe),
        beta_fast=float(scaling.get("beta_fast") or 32),
        beta_slow=float(scaling.get("beta_slow") or 1),
        mscale=scaling.get("mscale"),
        mscale_all_dim=scaling.get("mscale_all_dim"),
        attention_factor=scaling.get("attention_factor"),
        truncate=bool(scaling.get("truncate", True)),
    )


_FREQ_CACHE: dict[tuple, tuple[float, ...]] = {}


def _inv_freq_fp32(theta: float, dim: int, yarn: YarnScaling | None) -> tuple[float, ...]:
    key = (theta, dim, yarn)
    hit = _FREQ_CACHE.get(key)
    if hit is not None:
        return hit
    # torch here, not at the top: ``mqnc.model`` imports this module, and its geometry must load
    # without torch (the cost model reads it)
    import torch

    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    freq_extra = 1.0 / pos_freqs
    if yarn is None:
        inv_freq = freq_extra
    else:
        freq_inter = 1.0 / (yarn.factor * pos_freqs)
        low, high = yarn_find_correction_range(
            yarn.beta_fast,
            yarn.beta_slow,
            dim,
            theta,
            yarn.original_max_position_embeddings,
            yarn.truncate,
        )
        if low == high:
            high += 0.001  # DeepSeek's guard against a zero-width ramp
        ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
        mask = 1 - ramp
        inv_freq = freq_inter * (1 - mask) + freq_extra * mask
    out = tuple(float(v) for v in inv_freq.tolist())
    _FREQ_CACHE[key] = out
    return out
