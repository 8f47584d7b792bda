"""mqnc's Triton kernels, installed as ``mqnc.triton_kernels`` (never as a top-level
``triton_kernels``, which would shadow Triton's own package of that name).

One op per module, each with its launcher, input checks and ``compile_specs()`` for the sm_90
compile test. Importing this package imports Triton but never touches a GPU.
"""

from mqnc.triton_kernels.merge import (
    lse_from_base2,
    lse_from_ml,
    lse_to_base2,
    merge_partials,
    merge_partials_into,
    ml_from_lse,
)
from mqnc.triton_kernels.mla_decode import mla_decode_partial
from mqnc.triton_kernels.mla_sparse import mla_sparse_partial
from mqnc.triton_kernels.splice import rope_rotate, rope_splice

# Every kernel module, for the sm_90 compile test (each defines ``compile_specs()``).
KERNEL_MODULES = ["merge", "mla_decode", "mla_sparse", "splice"]

__all__ = [
    "KERNEL_MODULES",
    "merge_partials",
    "merge_partials_into",
    "lse_to_base2",
    "lse_from_base2",
    "lse_from_ml",
    "ml_from_lse",
    "mla_decode_partial",
    "mla_sparse_partial",
    "rope_splice",
    "rope_rotate",
]
