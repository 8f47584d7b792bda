"""Absorbed-MLA helpers: from a DeepSeek attention layer's weights to the cache entries and
absorbed query rows the kernels take, and from their latent output back to the hidden state
(§2.1, §3.2 of the paper).

Multi-head latent attention (DeepSeek-V2/V3) caches per token one latent ``c_KV`` (``d_c =
kv_lora_rank``, after ``kv_a_layernorm``) and one rotated rope key ``k_pe`` (``d_r``), shared
by all heads. Per head ``h``, ``kv_b_proj`` expands the latent into ``k_nope = W_UK[h] c_KV``
and ``v = W_UV[h] c_KV``. Attention never needs the expansion (the "absorbed" form):

    q_nope . k_nope = (W_UK[h]^T q_nope) . c_KV         (absorb W_UK into the query)
    sum_t p_t v_t   = W_UV[h] (sum_t p_t c_KV[t])       (apply W_UV after attention)

so the holder attends a ``d_c + d_r`` wide query row ``[W_UK^T q_nope, q_pe]`` against cache
entries ``[c_KV, k_pe]`` and returns a latent output; the requester applies ``W_UV`` and
``o_proj``. The softmax scale stays the model's (``qk_head_dim^-0.5``, times ``mscale^2``
under YaRN), not ``(d_c + d_r)^-0.5``.

Weight layout follows the Hugging Face ``DeepseekV3Attention`` / ``DeepseekV2Attention``
modules and checkpoints (``nn.Linear`` weights ``[out, in]``): ``kv_b_proj.weight`` is
``[H * (qk_nope_head_dim + v_head_dim), d_c]`` with, per head, the ``k_nope`` rows first.
RoPE is left to the caller (:mod:`mqnc.model.rope`, or the model's own rotary module): the
helpers take ``q_pe`` / ``k_pe`` already rotated where it matters and return them un-rotated
where they produce them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from mqnc.model.geometry import MLAGeometry
from mqnc.model.rope import RopeSpec
from mqnc.reference.rope_ref import rope_encode_reference

__all__ = [
    "MLAModel",
    "MLAWeights",
    "softmax_scale_from_config",
    "rms_norm",
    "project_query",
    "project_kv",
    "absorb_query",
    "cache_entry",
    "latent_to_heads",
    "output_projection",
]


def _get(config: Any, key: str, default: Any = None) -> Any:
    if isinstance(config, Mapping):
        return config.get(key, default)
    return getattr(config, key, default)


def softmax_scale_from_config(config: Mapping[str, Any] | Any) -> float:
    """The model's softmax scale: ``(qk_nope_head_dim + qk_rope_head_dim)^-0.5``, times
    ``mscale(factor, mscale_all_dim)^2`` when the RoPE scaling is YaRN with ``mscale_all_dim``
    (DeepSeek-V2-Lite: ``192^-0.5 * 1.2608^2 = 0.1147``): :attr:`RopeSpec.softmax_scale` of
    the config.

    ``config`` is a dict or a transformers config; the RoPE scaling is read from
    ``rope_parameters`` (transformers >= 5) or ``rope_scaling`` (older configs, checkpoints).
    """
    return RopeSpec.from_hf_config(config).softmax_scale


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as DeepSeek's modules compute it: normalise in fp32, cast back, scale by weight."""
    dtype = x.dtype
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def _linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return torch.nn.functional.linear(x, w, b)


@dataclasses.dataclass
class MLAWeights:
    """One MLA attention layer's weights, in the Hugging Face (``nn.Linear``: ``[out, in]``) layout.

    Either ``q_proj`` (no query LoRA, DeepSeek-V2-Lite) or ``q_a_proj`` + ``q_a_norm`` +
    ``q_b_proj`` (DeepSeek-V3) is set. Biases exist only with ``attention_bias``.
    """

    heads: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    kv_lora_rank: int
    kv_a_proj: torch.Tensor  # [d_c + d_r, hidden]
    kv_a_norm: torch.Tensor  # [d_c]
    kv_b_proj: torch.Tensor  # [H * (qk_nope + v_head), d_c]
    o_proj: torch.Tensor  # [hidden, H * v_head]
    softmax_scale: float
    q_proj: torch.Tensor | None = None  # [H * (qk_nope + d_r), hidden]
    q_a_proj: torch.Tensor | None = None  # [q_lora_rank, hidden]
    q_a_norm: torch.Tensor | None = None  # [q_lora_rank]
    q_b_proj: torch.Tensor | None = None  # [H * (qk_nope + d_r), q_lora_rank]
    kv_a_bias: torch.Tensor | None = None
    q_a_bias: torch.Tensor | None = None
    o_bias: torch.Tensor | None = None
    norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        if (self.q_proj is None) == (self.q_a_proj is None):
            raise ValueError(
                "MLAWeights: expected exactly one of q_proj (no query LoRA) or q_a_proj + "
                f"q_b_proj, got q_proj={'set' if self.q_proj is not None else None}, "
                f"q_a_proj={'set' if self.q_a_proj is not None else None}"
            )
        H, dn, dr, dv, dc = (
            self.heads,
            self.qk_nope_head_dim,
            self.qk_rope_head_dim,
            self.v_head_dim,
            self.kv_lora_rank,
        )
        expect = {
            "kv_a_proj": (dc + dr, None),
            "kv_a_norm": (dc,),
            "kv_b_proj": (H * (dn + dv), dc),
            "o_proj": (None, H * dv),
        }
        if self.q_proj is not None:
            expect["q_proj"] = (H * (dn + dr), None)
        else:
            if self.q_b_proj is None or self.q_a_norm is None:
                raise ValueError("MLAWeights: q_a_proj needs q_a_norm and q_b_proj, got None")
            expect["q_b_proj"] = (H * (dn + dr), self.q_a_proj.shape[0])
        for name, shape in expect.items():
            t = getattr(self, name)
            if t.dim() != len(shape) or any(
                s is not None and s != g for s, g in zip(shape, t.shape, strict=True)
            ):
                want = tuple("*" if s is None else s for s in shape)
                raise ValueError(f"MLAWeights.{name}: expected shape {want}, got {tuple(t.shape)}")

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def from_hf_attention(cls, module: torch.nn.Module) -> MLAWeights:
        """From a transformers ``DeepseekV3Attention`` (or ``DeepseekV2Attention``-like) module;
        the tensors are the module's own parameters (no copy)."""
        cfg = module.config
        lora = getattr(module, "q_a_proj", None) is not None

        def bias(lin):
            return None if lin is None or lin.bias is None else lin.bias.detach()

        return cls(
            heads=int(cfg.num_attention_heads),
            qk_nope_head_dim=int(cfg.qk_nope_head_dim),
            qk_rope_head_dim=int(cfg.qk_rope_head_dim),
            v_head_dim=int(cfg.v_head_dim),
            kv_lora_rank=int(cfg.kv_lora_rank),
            kv_a_proj=module.kv_a_proj_with_mqa.weight.detach(),
            kv_a_norm=module.kv_a_layernorm.weight.detach(),
            kv_b_proj=module.kv_b_proj.weight.detach(),
            o_proj=module.o_proj.weight.detach(),
            softmax_scale=float(module.scaling),
            q_proj=None if lora else module.q_proj.weight.detach(),
            q_a_proj=module.q_a_proj.weight.detach() if lora else None,
            q_a_norm=module.q_a_layernorm.weight.detach() if lora else None,
            q_b_proj=module.q_b_proj.weight.detach() if lora else None,
            kv_a_bias=bias(module.kv_a_proj_with_mqa),
            q_a_bias=bias(getattr(module, "q_a_proj", None)),
            o_bias=bias(module.o_proj),
            norm_eps=float(module.kv_a_layernorm.variance_epsilon),
        )

    @classmethod
    def from_state_dict(
        cls,
        state_dict: Mapping[str, torch.Tensor],
        config: Mapping[str, Any] | Any,
        prefix: str = "",
    ) -> MLAWeights:
        """From a checkpoint's tensors for one layer, e.g. ``prefix="model.layers.0.self_attn."``
        of a DeepSeek safetensors file; ``config`` is the model's config (dict or object)."""

        def get(name: str, required: bool = True):
            key = prefix + name
            if key not in state_dict:
                if required:
                    raise KeyError(f"state_dict: expected key {key!r}, not found")
                return None
            return state_dict[key]

        lora = _get(config, "q_lora_rank") is not None
        return cls(
            heads=int(_get(config, "num_attention_heads")),
            qk_nope_head_dim=int(_get(config, "qk_nope_head_dim")),
            qk_rope_head_dim=int(_get(config, "qk_rope_head_dim")),
            v_head_dim=int(_get(config, "v_head_dim")),
            kv_lora_rank=int(_get(config, "kv_lora_rank")),
            kv_a_proj=get("kv_a_proj_with_mqa.weight"),
            kv_a_norm=get("kv_a_layernorm.weight"),
            kv_b_proj=get("kv_b_proj.weight"),
            o_proj=get("o_proj.weight"),
            softmax_scale=softmax_scale_from_config(config),
            q_proj=None if lora else get("q_proj.weight"),
            q_a_proj=get("q_a_proj.weight") if lora else None,
            q_a_norm=get("q_a_layernorm.weight") if lora else None,
            q_b_proj=get("q_b_proj.weight") if lora else None,
            kv_a_bias=get("kv_a_proj_with_mqa.bias", False),
            q_a_bias=get("q_a_proj.bias", False) if lora else None,
            o_bias=get("o_proj.bias", False),
            norm_eps=float(_get(config, "rms_norm_eps", 1e-6)),
        )

    # ---- the two halves of kv_b_proj ------------------------------------------------------------
    @property
    def w_uk(self) -> torch.Tensor:
        """``W_UK`` ``[H, qk_nope_head_dim, d_c]``: latent to per-head ``k_nope``."""
        w = self.kv_b_proj.view(self.heads, self.qk_nope_head_dim + self.v_head_dim, -1)
        return w[:, : self.qk_nope_head_dim]

    @property
    def w_uv(self) -> torch.Tensor:
        """``W_UV`` ``[H, v_head_dim, d_c]``: latent to per-head value."""
        w = self.kv_b_proj.view(self.heads, self.qk_nope_head_dim + self.v_head_dim, -1)
        return w[:, self.qk_nope_head_dim :]

    @property
    def d_qk(self) -> int:
        """Width of a cache entry / absorbed query row: ``kv_lora_rank + qk_rope_head_dim``."""
        return self.kv_lora_rank + self.qk_rope_head_dim


def project_query(w: MLAWeights, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head query parts of ``hidden [..., hidden]``: ``q_nope [..., H, qk_nope_head_dim]``
    and the **un-rotated** ``q_pe [..., H, qk_rope_head_dim]`` (rotate it at the token's
    position before :func:`absorb_query`)."""
    if w.q_proj is not None:
        q = _linear(hidden, w.q_proj, None)
    else:
        q = _linear(hidden, w.q_a_proj, w.q_a_bias)
        q = _linear(rms_norm(q, w.q_a_norm, w.norm_eps), w.q_b_proj, None)
    q = q.unflatten(-1, (w.heads, w.qk_nope_head_dim + w.qk_rope_head_dim))
    return q[..., : w.qk_nope_head_dim], q[..., w.qk_nope_head_dim :]


def project_kv(w: MLAWeights, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The cached parts of ``hidden [..., hidden]``: the latent ``c_KV [..., d_c]`` (after
    ``kv_a_layernorm``) and the **un-rotated** ``k_pe [..., d_r]`` (rotate it at the token's
    position before :func:`cache_entry`)."""
    kv = _linear(hidden, w.kv_a_proj, w.kv_a_bias)
    c_kv, k_pe = kv[..., : w.kv_lora_rank], kv[..., w.kv_lora_rank :]
    return rms_norm(c_kv, w.kv_a_norm, w.norm_eps), k_pe


def absorb_query(q_nope: torch.Tensor, q_pe: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """The absorbed query row ``[W_UK[h]^T q_nope[h], q_pe[h]]`` (§2.1).

    Parameters
    ----------
    q_nope : torch.Tensor
        ``[..., H, qk_nope_head_dim]``.
    q_pe : torch.Tensor
        ``[..., H, d_r]``, **rotated** at the query's position (same pair convention as the
        cached ``k_pe``).
    w_uk : torch.Tensor
        ``[H, qk_nope_head_dim, d_c]`` (:attr:`MLAWeights.w_uk`).

    Returns
    -------
    torch.Tensor
        ``[..., H, d_c + d_r]`` in ``q_nope``'s dtype: the rows the kernels take.
    """
    q_lat = torch.einsum("...hn,hnc->...hc", q_nope, w_uk.to(q_nope.dtype))
    return torch.cat([q_lat, q_pe.to(q_lat.dtype)], dim=-1)


def cache_entry(c_kv: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
    """One cache entry per token, ``[..., d_c + d_r]`` = ``[c_KV, k_pe]`` (``k_pe`` rotated at
    the token's position), shared by all heads: the rows of the paged pool."""
    return torch.cat([c_kv, k_pe.to(c_kv.dtype)], dim=-1)


def latent_to_heads(o_latent: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """Per-head attention output ``[..., H, v_head_dim]`` from the merged latent output
    ``o_latent [..., H, d_c]`` (``W_UV`` applied after attention, §2.1)."""
    return torch.einsum("...hc,hvc->...hv", o_latent, w_uv.to(o_latent.dtype))


def output_projection(w: MLAWeights, o_latent: torch.Tensor) -> torch.Tensor:
    """The layer's output ``[..., hidden]`` from the merged latent output ``[..., H, d_c]``:
    ``W_UV`` per head, heads concatenated, then ``o_proj``."""
    heads = latent_to_heads(o_latent, w.w_uv)
    return _linear(
        heads.flatten(-2),
        w.o_proj.to(heads.dtype),
        None if w.o_bias is None else w.o_bias.to(heads.dtype),
    )


# ---- a small real MLA model: the demo's model and ``local``'s re-prefill -------------------------


class MLAModel:
    """A small real MLA model: DeepSeek's attention layers on a residual stream (no MLP).

    Each layer maps hidden states ``h [T, D]`` to ``h + o_proj(MLA(rms(h)))`` with the weights
    of one :class:`MLAWeights` (seeded random, or taken from Hugging Face DeepSeek attention
    modules with :meth:`from_hf_attention`) and the decoupled RoPE of ``rope`` (YaRN included).
    A token's cache entry per layer is ``[c_KV, k_pe]`` (``d_c + d_r`` = 576 wide for
    DeepSeek-V2-Lite's geometry, ``k_pe`` rotated at the token's position).

    :meth:`prefill` attends causally within the chunk it is given: canonical chunks are cached
    position-independently (§1, §2.2). Since RoPE scores depend only on relative positions,
    prefilling a chunk at another offset gives the same ``c_KV`` and ``k_pe`` rotated by the
    offset difference: what the splice reproduces and what ``local`` (re-prefill) recomputes.

    Parameters
    ----------
    geometry : MLAGeometry
        Dims; ``geometry.layers`` layers.
    rope : RopeSpec
        Frequencies, pair layout and softmax scale.
    layers : list of MLAWeights
        One per layer.
    """

    def __init__(
        self,
        geometry: MLAGeometry,
        rope: RopeSpec,
        layers: list[MLAWeights],
        *,
        eps: float = 1e-6,
    ) -> None:
        if len(layers) != geometry.layers:
            raise ValueError(
                f"layers: expected geometry.layers = {geometry.layers} layer weights, "
                f"got {len(layers)}"
            )
        for i, w in enumerate(layers):
            if (w.kv_lora_rank, w.qk_rope_head_dim, w.heads) != (
                geometry.d_c,
                geometry.d_r,
                geometry.heads,
            ):
                raise ValueError(
                    f"layers[{i}]: expected (d_c, d_r, heads) = "
                    f"{(geometry.d_c, geometry.d_r, geometry.heads)}, got "
                    f"{(w.kv_lora_rank, w.qk_rope_head_dim, w.heads)}"
                )
        self.geometry = geometry
        self.rope = rope
        self.layers = layers
        self.eps = eps
        self.hidden = int(layers[0].kv_a_proj.shape[1])

    @classmethod
    def random(
        cls, geometry: MLAGeometry, rope: RopeSpec, *, hidden: int = 256, seed: int = 0
    ) -> MLAModel:
        """Seeded random float32 weights, scaled so activations stay O(1) through the layers."""
        g = torch.Generator().manual_seed(seed)
        H, d_c, d_r = geometry.heads, geometry.d_c, geometry.d_r
        d_n, d_vh = geometry.qk_nope_head_dim, geometry.v_head_dim

        def w(out: int, inp: int, gain: float = 1.0) -> torch.Tensor:
            return torch.randn(out, inp, generator=g) * (gain / math.sqrt(inp))

        layers = [
            MLAWeights(
                heads=H,
                qk_nope_head_dim=d_n,
                qk_rope_head_dim=d_r,
                v_head_dim=d_vh,
                kv_lora_rank=d_c,
                kv_a_proj=w(d_c + d_r, hidden),
                kv_a_norm=1.0 + 0.1 * torch.randn(d_c, generator=g),
                kv_b_proj=w(H * (d_n + d_vh), d_c),
                o_proj=w(hidden, H * d_vh, 0.5),
                softmax_scale=rope.softmax_scale,
                q_proj=w(H * (d_n + d_r), hidden),
            )
            for _ in range(geometry.layers)
        ]
        return cls(geometry, rope, layers)

    @classmethod
    def from_hf_attention(cls, geometry: MLAGeometry, rope: RopeSpec, modules) -> MLAModel:
        """From Hugging Face DeepSeek attention modules, one per layer (weights not copied)."""
        return cls(geometry, rope, [MLAWeights.from_hf_attention(m) for m in modules])

    @property
    def softmax_scale(self) -> float:
        return self.layers[0].softmax_scale

    def _norm(self, h: torch.Tensor) -> torch.Tensor:
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)

    def cache_entries(self, layer: int, h: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Cache entries ``[T, d_qk]`` (h's dtype) of hidden states ``h [T, D]`` at integer
        ``positions [T]``."""
        w = self.layers[layer]
        c_kv, k_pe = project_kv(_cast(w, h.dtype), self._norm(h))
        return cache_entry(c_kv, rope_encode_reference(k_pe, positions, self.rope).to(h.dtype))

    def absorbed_query(self, layer: int, h: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Absorbed query rows ``[T, H, d_qk]`` (h's dtype) of ``h [T, D]`` at ``positions [T]``."""
        w = _cast(self.layers[layer], h.dtype)
        q_nope, q_pe = project_query(w, self._norm(h))
        q_pe = rope_encode_reference(q_pe, positions[:, None], self.rope).to(h.dtype)
        return absorb_query(q_nope, q_pe, w.w_uk)

    def attention_output(self, layer: int, o_latent: torch.Tensor) -> torch.Tensor:
        """``W_UV`` then ``o_proj``: latent output ``[T, H, d_c]`` -> ``[T, D]``."""
        return output_projection(_cast(self.layers[layer], o_latent.dtype), o_latent)

    def prefill(
        self, x: torch.Tensor, start: int, *, dtype: torch.dtype = torch.float64
    ) -> torch.Tensor:
        """Prefill token embeddings ``x [T, D]`` at positions ``start .. start + T - 1``,
        attending causally within them; returns the cache entries ``[L, T, d_qk]`` in ``dtype``.

        Attention runs in the decompressed form (per-head ``k_nope = W_UK c_KV`` and values
        ``W_UV c_KV``, 192 + 128 wide) rather than the absorbed one (576 + 512): the same
        scores and outputs in exact arithmetic at a third of the work for a prefill, whose
        ``T`` queries share the keys (the absorbed form pays off in decode, §2.1)."""
        T = x.shape[0]
        pos = torch.arange(start, start + T)
        h = x.to(dtype)
        out = []
        for layer in range(self.geometry.layers):
            w = _cast(self.layers[layer], dtype)
            hn = self._norm(h)
            c_kv, k_pe = project_kv(w, hn)
            k_pe = rope_encode_reference(k_pe, pos, self.rope).to(dtype)
            q_nope, q_pe = project_query(w, hn)
            q_pe = rope_encode_reference(q_pe, pos[:, None], self.rope).to(dtype)
            k_nope = torch.einsum("sc,hnc->hsn", c_kv, w.w_uk)
            v = torch.einsum("sc,hvc->hsv", c_kv, w.w_uv)
            q = torch.cat([q_nope.transpose(0, 1), q_pe.transpose(0, 1)], dim=-1)
            k = torch.cat([k_nope, k_pe.expand(w.heads, T, -1)], dim=-1)
            heads = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=self.softmax_scale
            ).transpose(0, 1)  # [T, H, v_head_dim]
            h = h + _linear(heads.flatten(-2), w.o_proj, None if w.o_bias is None else w.o_bias)
            out.append(cache_entry(c_kv, k_pe))
        return torch.stack(out)


def _cast(w: MLAWeights, dtype: torch.dtype) -> MLAWeights:
    """The layer's weights in ``dtype`` (a no-op when they already are)."""
    if w.kv_a_proj.dtype == dtype:
        return w
    return dataclasses.replace(
        w,
        **{
            f.name: getattr(w, f.name).to(dtype)
            for f in dataclasses.fields(w)
            if isinstance(getattr(w, f.name), torch.Tensor)
        },
    )
