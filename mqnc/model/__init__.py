"""The model layer (§2, §3.3): what one MLA model is, as kernels, wire and cost model see it.

- :mod:`mqnc.model.geometry`: :class:`MLAGeometry` and published presets; every byte size
  derived from the dims (pure Python: the cost model reads it without torch).
- :mod:`mqnc.model.rope`: :class:`RopeSpec`, DeepSeek's decoupled RoPE (YaRN frequencies, pair
  layouts, softmax scale).
- :mod:`mqnc.model.mla`: absorption helpers (:class:`MLAWeights` from Hugging Face modules or
  checkpoints, ``project_query``, ``absorb_query``, ...) and :class:`MLAModel`, a small real
  MLA model (the demo's, and ``local``'s re-prefill).

The torch-backed names of :mod:`mqnc.model.mla` are re-exported lazily (imported on first
use), so that ``import mqnc.model.geometry`` loads no torch.
"""

from mqnc.base.lazy import lazy_exports, public_names
from mqnc.model.geometry import (
    PRESET_CONFIGS,
    PRESETS,
    MLAGeometry,
    get_preset,
    hf_config_dict,
    load_geometry,
)
from mqnc.model.rope import (
    LAYOUTS,
    ROPE_PRESET_CONFIGS,
    RopeSpec,
    YarnScaling,
    pair_indices,
    yarn_find_correction_range,
    yarn_get_mscale,
)

_MLA = public_names(__name__, ".mla")
__getattr__ = lazy_exports(__name__, {name: ".mla" for name in _MLA})

__all__ = [
    "MLAGeometry",
    "PRESETS",
    "PRESET_CONFIGS",
    "get_preset",
    "load_geometry",
    "hf_config_dict",
    "RopeSpec",
    "YarnScaling",
    "LAYOUTS",
    "ROPE_PRESET_CONFIGS",
    "yarn_get_mscale",
    "yarn_find_correction_range",
    "pair_indices",
    *_MLA,
]
