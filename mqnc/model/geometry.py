"""MLA geometry: the dimensions every kernel, wire size and cost-model term is derived from.

A cache entry is one ``d_qk = d_c + d_r`` wide vector per token per layer, shared by all heads
(§2.1 of the paper): its first ``d_c`` dims are the compressed latent ``c_KV`` (keys and values),
its last ``d_r`` the decoupled, rotated ``k_pe``. An absorbed query row is ``d_qk`` wide
(``q_nope`` absorbed through ``W_UK``, then ``q_pe``), and the holder's partial is ``d_v = d_c``
wide plus the two fp32 softmax statistics ``(m, l)`` (§3.2).

Every byte size is a property computed from the dims; nothing is typed in twice:

>>> from mqnc.model import PRESETS
>>> g = PRESETS["deepseek-v2-lite"]
>>> g.q_row_bytes, g.p_row_bytes, g.qp_row_bytes, g.kv_bytes_per_token_layer
(1152, 1032, 2184, 1152)

Presets are built from the published Hugging Face configs (the dicts in ``PRESET_CONFIGS``
hold only the published fields this package reads; the source of each is in the comment
beside it). DeepSeek-V4-Pro is left out: its attention dims were not available to us from a
published config at the time of writing.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any

from mqnc.base.checks import check_int
from mqnc.model.kv_format import FP8_E4M3, KV_FORMATS, kv_bytes_per_token

__all__ = [
    "MLAGeometry",
    "PRESETS",
    "PRESET_CONFIGS",
    "get_preset",
    "hf_config_dict",
    "load_geometry",
]

_DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8": 1}
# The narrowest tile of the Triton kernels (the MMA's smallest K): d_c and d_r are each a power
# of two at least this wide (mqnc.triton_kernels.mla.plan.mla_operands; MLAGeometry.check_triton)
_TRITON_MIN_WIDTH = 16


def hf_config_dict(config: Mapping[str, Any] | Any, key: str) -> Mapping[str, Any]:
    """A Hugging Face config (a dict or a ``PretrainedConfig``) as a dict; a multimodal config
    without ``key`` at top level whose ``text_config`` has it (Kimi K2.5/K2.6) is read through
    that ``text_config``."""
    if not isinstance(config, Mapping):
        to_dict = getattr(config, "to_dict", None)
        if to_dict is None:
            raise TypeError(
                f"config: expected a dict or a transformers PretrainedConfig, got {type(config)!r}"
            )
        config = to_dict()
    if key not in config and isinstance(config.get("text_config"), Mapping):
        config = config["text_config"]
    return config


@dataclasses.dataclass(frozen=True)
class MLAGeometry:
    """Dimensions of one MLA model, as the kernels, wire format and cost model see them.

    Parameters
    ----------
    name : str
        Preset or model name (free text).
    d_c : int
        ``kv_lora_rank``: width of the compressed latent ``c_KV`` (keys and values).
    d_r : int
        ``qk_rope_head_dim``: width of the decoupled RoPE key ``k_pe``.
    heads : int
        Query heads ``h_q`` (all heads share one cache entry per token).
    layers : int
        Attention layers ``L`` (a fetch pulls all of them, §2.2).
    qk_nope_head_dim, v_head_dim : int
        Per-head dims of the un-absorbed model (what ``W_UK`` / ``W_UV`` project to).
    q_lora_rank : int or None
        Query compression rank (None: no query LoRA, as in DeepSeek-V2-Lite).
    topk : int or None
        Selection budget of a sparse-attention indexer (``index_topk``), None for dense models.
    cache_dtype : str
        Format of a cache entry: "bf16", "fp16", "fp32" (``d_qk`` values of that type), or
        "fp8_e4m3" (DeepSeek-V3.2's FP8 entry: FP8 e4m3 latent, one fp32 scale per 128 latent
        values, bf16 RoPE; 656 B for 512 + 64 dims; :mod:`mqnc.model.kv_format`).
    wire_dtype : str
        Element type of the routed rows ("bf16", "fp16", "fp32", "fp8").
    value_dim : int or None
        Width of the value read from each entry when it is not the latent ``d_c`` (DeepSeek-V4
        reads values from the whole ``d_qk``-wide entry). None: ``d_v = d_c``.
    """

    name: str
    d_c: int
    d_r: int
    heads: int
    layers: int
    qk_nope_head_dim: int = 128
    v_head_dim: int = 128
    q_lora_rank: int | None = None
    topk: int | None = None
    cache_dtype: str = "bf16"
    wire_dtype: str = "bf16"
    value_dim: int | None = None

    def __post_init__(self) -> None:
        for field in ("d_c", "d_r", "heads", "layers", "qk_nope_head_dim", "v_head_dim"):
            check_int(f"MLAGeometry.{field}", getattr(self, field), minimum=1)
        if self.d_r % 2:
            raise ValueError(
                f"MLAGeometry.d_r: expected an even width (RoPE pairs), got {self.d_r}"
            )
        for field in ("q_lora_rank", "topk", "value_dim"):
            value = getattr(self, field)
            if value is not None:
                check_int(f"MLAGeometry.{field}", value, minimum=1)
        if self.wire_dtype not in _DTYPE_BYTES:
            raise ValueError(
                f"MLAGeometry.wire_dtype: expected one of {sorted(_DTYPE_BYTES)}, "
                f"got {self.wire_dtype!r}"
            )
        if self.cache_dtype not in KV_FORMATS:
            hint = " (an FP8 cache is 'fp8_e4m3': FP8 latent with scales)" * (
                self.cache_dtype == "fp8"
            )
            raise ValueError(
                f"MLAGeometry.cache_dtype: expected one of {list(KV_FORMATS)}{hint}, "
                f"got {self.cache_dtype!r}"
            )
        if self.cache_dtype == FP8_E4M3.name and self.d_c % FP8_E4M3.group:
            raise ValueError(
                f"MLAGeometry.cache_dtype: 'fp8_e4m3' needs d_c (kv_lora_rank) a multiple of "
                f"{FP8_E4M3.group} (one fp32 scale per {FP8_E4M3.group} latent values), "
                f"got d_c = {self.d_c}"
            )

    # ---- derived dims -------------------------------------------------------------------------
    @property
    def d_qk(self) -> int:
        """Width of a cache entry and of an absorbed query row: ``d_c + d_r``."""
        return self.d_c + self.d_r

    @property
    def d_v(self) -> int:
        """Width of the partial output ``o``: the latent ``d_c`` (values live in ``c_KV``)."""
        return self.d_c if self.value_dim is None else self.value_dim

    @property
    def qk_head_dim(self) -> int:
        """Per-head query/key width of the un-absorbed model (sets the softmax scale)."""
        return self.qk_nope_head_dim + self.d_r

    @property
    def fp8_layout(self):
        """The FP8 entry layout (:class:`mqnc.model.kv_format.FP8Layout`) of an "fp8_e4m3" cache,
        ``None`` for a 16/32-bit one: what a pool keeping this geometry's chunks is given."""
        if self.cache_dtype != FP8_E4M3.name:
            return None
        return FP8_E4M3.layout(self.d_c, self.d_r)

    # ---- derived byte sizes (§3.2) --------------------------------------------------------------
    @property
    def kv_bytes_per_token_layer(self) -> int:
        """``b_KV``: bytes of one cache entry (one token, one layer), from ``cache_dtype``'s
        format: ``d_qk x 2`` in bf16 (1152 for 576 dims), ``d_c + 4 d_c / 128 + 2 d_r`` in
        "fp8_e4m3" (656)."""
        return kv_bytes_per_token(self.cache_dtype, self.d_c, self.d_r)

    @property
    def q_row_bytes(self) -> int:
        """``q``: bytes of one routed absorbed query row."""
        return self.d_qk * _DTYPE_BYTES[self.wire_dtype]

    @property
    def p_row_bytes(self) -> int:
        """``p``: bytes of one partial row, ``o`` in the wire dtype plus fp32 ``m`` and ``l``."""
        return self.d_v * _DTYPE_BYTES[self.wire_dtype] + 2 * 4

    @property
    def qp_row_bytes(self) -> int:
        """``q + p``: bytes one routed row moves there and back."""
        return self.q_row_bytes + self.p_row_bytes

    def chunk_bytes(self, tokens: int, layers: int | None = None) -> int:
        """Bytes of a ``tokens``-token chunk over ``layers`` layers (default: all ``L``)."""
        return tokens * (self.layers if layers is None else layers) * self.kv_bytes_per_token_layer

    def replace(self, **changes: Any) -> MLAGeometry:
        """A copy with some fields changed (e.g. ``layers=4`` for a small demo model)."""
        return dataclasses.replace(self, **changes)

    def check_triton(self) -> MLAGeometry:
        """``self`` if the Triton kernels can run it, else a ``ValueError`` naming the Hugging
        Face config field (``kv_lora_rank`` for ``d_c``, ``qk_rope_head_dim`` for ``d_r``), its
        value and what the kernels support.

        The kernels (``mla_decode_partial``, ``rope_rotate``, ``rope_splice`` in
        :mod:`mqnc.triton_kernels`) tile the latent part ``d_c`` and the rope part ``d_r`` of a
        cache entry separately, each a power of two >= 16 wide (``mla_operands``' rule; the
        splice's ``d_r / 2`` a power of two follows). The torch references
        (``kernels="torch"``) run any width, so only a Triton backend checks this.
        """
        for field, hf_name in (("d_c", "kv_lora_rank"), ("d_r", "qk_rope_head_dim")):
            width = getattr(self, field)
            if width < _TRITON_MIN_WIDTH or width & (width - 1):
                raise ValueError(
                    f"{hf_name}: the Triton kernels (kernels='triton') run {field} = {hf_name} "
                    f"only as a power of two >= {_TRITON_MIN_WIDTH} (16, 32, 64, 128, ...; the "
                    f"latent and rope parts of an entry are tiled separately), got {width} "
                    f"(kv_lora_rank {self.d_c}, qk_rope_head_dim {self.d_r}); the torch "
                    "references (kernels='torch') run any width"
                )
        return self

    @classmethod
    def from_hf_config(
        cls, config: Mapping[str, Any] | Any, name: str | None = None
    ) -> MLAGeometry:
        """Build from a Hugging Face config (a dict or a ``PretrainedConfig``).

        Reads ``kv_lora_rank``, ``qk_rope_head_dim``, ``num_attention_heads``,
        ``num_hidden_layers``, ``qk_nope_head_dim``, ``v_head_dim``, ``q_lora_rank`` and
        ``index_topk`` (the DSA selection budget, when present). A multimodal config with a
        ``text_config`` (Kimi K2.5/K2.6) is read through it.
        """
        config = hf_config_dict(config, "kv_lora_rank")
        missing = [
            k
            for k in (
                "kv_lora_rank",
                "qk_rope_head_dim",
                "num_attention_heads",
                "num_hidden_layers",
            )
            if config.get(k) is None
        ]
        if missing:
            raise ValueError(f"config: not an MLA config, missing {missing}")
        return cls(
            name=name
            or str(config.get("_name_or_path") or config.get("model_type") or "hf-config"),
            # the values as given: the dataclass refuses a float or a 0 by name (never cut)
            d_c=config["kv_lora_rank"],
            d_r=config["qk_rope_head_dim"],
            heads=config["num_attention_heads"],
            layers=config["num_hidden_layers"],
            qk_nope_head_dim=_or_default(config, "qk_nope_head_dim", 128),
            v_head_dim=_or_default(config, "v_head_dim", 128),
            q_lora_rank=config.get("q_lora_rank"),
            topk=config.get("index_topk"),
        )


def _or_default(config: Mapping[str, Any], key: str, default: int) -> Any:
    """``config[key]``, or ``default`` only where the key is absent or None (a 0 stays 0)."""
    value = config.get(key)
    return default if value is None else value


# Published config fields (only those this package reads: the dims above, and for some the RoPE
# fields mqnc.model.rope reads). Sources:
PRESET_CONFIGS: dict[str, dict[str, Any]] = {
    # deepseek-ai/DeepSeek-V2-Lite config.json: the paper's measured instance (§3).
    "deepseek-v2-lite": dict(
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        num_attention_heads=16,
        num_hidden_layers=27,
        qk_nope_head_dim=128,
        v_head_dim=128,
        q_lora_rank=None,
        # RoPE (read by mqnc.model.rope.RopeSpec.from_preset)
        rope_theta=10000,
        max_position_embeddings=163840,
        rope_scaling=dict(
            type="yarn",
            factor=40,
            original_max_position_embeddings=4096,
            beta_fast=32,
            beta_slow=1,
            mscale=0.707,
            mscale_all_dim=0.707,
        ),
    ),
    # deepseek-ai/DeepSeek-V3 (and DeepSeek-R1, same architecture) config.json.
    "deepseek-v3": dict(
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        num_attention_heads=128,
        num_hidden_layers=61,
        qk_nope_head_dim=128,
        v_head_dim=128,
        q_lora_rank=1536,
        rope_theta=10000,
        max_position_embeddings=163840,
        rope_scaling=dict(
            type="yarn",
            factor=40,
            original_max_position_embeddings=4096,
            beta_fast=32,
            beta_slow=1,
            mscale=1.0,
            mscale_all_dim=1.0,
        ),
    ),
    # deepseek-ai/DeepSeek-V3.2-Exp config.json: V3 attention plus the DSA indexer, index_topk 2048.
    "deepseek-v3.2": dict(
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        num_attention_heads=128,
        num_hidden_layers=61,
        qk_nope_head_dim=128,
        v_head_dim=128,
        q_lora_rank=1536,
        index_topk=2048,
    ),
    # moonshotai/Kimi-K2-Instruct config.json (DeepseekV3 architecture, 64 heads).
    "kimi-k2": dict(
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        num_attention_heads=64,
        num_hidden_layers=61,
        qk_nope_head_dim=128,
        v_head_dim=128,
        q_lora_rank=1536,
    ),
    # zai-org GLM-5 family (transformers GlmMoeDsaConfig defaults, model_type glm_moe_dsa):
    # MLA with DSA, index_topk 2048. GLM-5.1 shares the GLM-5 architecture.
    "glm-5.1": dict(
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        num_attention_heads=64,
        num_hidden_layers=78,
        qk_nope_head_dim=192,
        v_head_dim=256,
        q_lora_rank=2048,
        index_topk=2048,
    ),
    # deepseek-ai/DeepSeek-V4-Flash-Base (transformers DeepseekV4Config defaults): shared-KV MQA
    # with a 512-wide entry of which 64 dims carry RoPE, selection over compressed entries
    # with index_topk 512. Here d_c = 448, d_r = 64 so that d_qk = 512 as published.
    "deepseek-v4-flash": dict(
        kv_lora_rank=448,
        qk_rope_head_dim=64,
        num_attention_heads=64,
        num_hidden_layers=43,
        qk_nope_head_dim=448,
        v_head_dim=512,
        q_lora_rank=1024,
        index_topk=512,
    ),
}

PRESETS: dict[str, MLAGeometry] = {
    name: MLAGeometry.from_hf_config(cfg, name=name) for name, cfg in PRESET_CONFIGS.items()
}
# V4 attends values over the whole 512-wide entry (its output is de-rotated afterwards).
PRESETS["deepseek-v4-flash"] = PRESETS["deepseek-v4-flash"].replace(value_dim=512)


def get_preset(name: str) -> MLAGeometry:
    """Look a preset up by name; an unknown name lists the valid ones."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(
            f"model: unknown preset {name!r}; expected one of {sorted(PRESETS)}"
        ) from None


def load_geometry(model: str | os.PathLike) -> MLAGeometry:
    """A preset by name, or the geometry of a Hugging Face ``config.json`` (a path to the file,
    or to a folder holding one): what every ``--model`` option of the CLI and the benchmarks
    takes. A string that is neither a preset nor an existing path is a ValueError listing the
    presets."""
    name = os.fspath(model)
    if name in PRESETS:
        return PRESETS[name]
    path = os.path.join(name, "config.json") if os.path.isdir(name) else name
    if not os.path.isfile(path):
        raise ValueError(
            f"model: expected a preset out of {sorted(PRESETS)} or a path to a Hugging Face "
            f"config.json, got {name!r}"
        )
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"model: cannot read {path!r} as a JSON config ({exc})") from None
    if not isinstance(config, dict):
        raise ValueError(f"model: expected a JSON object in {path!r}, got {type(config).__name__}")
    try:
        return MLAGeometry.from_hf_config(config, name=config.get("_name_or_path") or path)
    except ValueError as exc:
        raise ValueError(f"model: {path!r}: {exc}") from None
