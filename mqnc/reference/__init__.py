"""fp64 torch references, one module per kernel family, shared by tests, benchmarks and notebooks.

- :mod:`mqnc.reference.merge_ref`: the M-way online-softmax merge, (o, lse) and (o, m, l) forms.
- :mod:`mqnc.reference.attention_ref`: partial absorbed-MLA attention, dense paged and sparse top-k.
- :mod:`mqnc.reference.rope_ref`: RoPE encoding at positions, the delta rotation, the splice.
- :mod:`mqnc.reference.torch_backend`: the kernel ops' ``"torch"`` backend (one implementation per
  op, from the op's call), registered by ``mqnc.serving.compute``.
"""

from mqnc.reference.attention_ref import (
    mla_decode_reference,
    mla_sparse_reference,
    partial_attention_reference,
)
from mqnc.reference.merge_ref import merge_ml_reference, merge_reference
from mqnc.reference.rope_ref import (
    rope_delta_reference,
    rope_encode_reference,
    rope_rotate_reference,
    rope_splice_reference,
)

__all__ = [
    "merge_reference",
    "merge_ml_reference",
    "partial_attention_reference",
    "mla_decode_reference",
    "mla_sparse_reference",
    "rope_encode_reference",
    "rope_delta_reference",
    "rope_rotate_reference",
    "rope_splice_reference",
]
