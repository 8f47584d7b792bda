"""mqnc's Triton kernels, installed as ``mqnc.triton_kernels`` (never as a top-level
``triton_kernels``, which would shadow Triton's own package of that name).

Every op's public signature is declared once, in ``ops`` (a ``torch.library`` op with its fake,
through the registry of ``_core.op``); one op per module (``merge``, ``mla.decode``, ``mla.sparse``,
``splice``, ``tp.scores`` / ``tp.values`` (a tensor-parallel rank's share, §8), ``fp8.quant``
(the FP8 cache entry)) holds its ``@triton.jit`` kernel, its input checks and a planning
function that returns its launches as data (``_core.launch.Launch``), registered as the op's
``"triton"`` implementation. Private modules, each with one job:

- ``_core.op``: the op registry (schema, fake, public function and plan function from one
  declared signature; implementations per backend);
- ``_core.validate``: argument validation (every error names the argument, expected and got);
- ``_core.execution``: interpreter mode, the launch lock, NaN-poisoned outputs;
- ``_core.numerics``: the store-side round to nearest even;
- ``mla.tile`` / ``mla.plan``: the device / host side shared by the two MLA ops;
- ``_core.grid``: occupancy and the split / grid policy (whole waves);
- ``sm90.variants``: the production (goal) shapes and the launches they make;
- ``sm90.compile``: launch-exact compiles for sm_90 without a GPU, registers, spills, SASS, TTGIR;
- ``sm90.table``: the generated occupancy of every production variant.

Importing this package imports Triton but never touches a GPU; it imports nothing of ``mqnc``
above the kernel layer. When torch was built without CUDA it chooses Triton's interpreter first
(``TRITON_INTERPRET=1``, unless set already or Triton was imported before; see
``mqnc.base.runtime.use_interpreter_on_cpu_only_torch``): on such a machine the kernels run as
called, with no set-up.
"""

import os as _os
import sys as _sys

if __name__ != "mqnc.triton_kernels" or getattr(_sys.modules.get("mqnc"), "__file__", None) is None:
    # Imported as a top-level ``triton_kernels`` (Triton's own package has that name), or as
    # ``mqnc.triton_kernels`` under a namespace package ``mqnc``: the folder of a checkout named
    # like the package, found first on ``sys.path`` by a script in the folder that holds it,
    # whose other modules come from wherever mqnc is installed. Refused, naming the fix.
    _root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
    raise ImportError(
        f"{__name__}: mqnc's kernels imported from {_root}, "
        + (
            "which is on sys.path: they are the package mqnc.triton_kernels, not Triton's "
            "top-level triton_kernels; import mqnc.triton_kernels, or run from another folder"
            if __name__ == "triton_kernels"
            else f"a checkout of mqnc that Python took for the package (a namespace package "
            f"'mqnc', because the folder holding it is on sys.path: the script's folder or the "
            f"working directory). Run the script from another folder (or from inside the "
            f"checkout), or rename the checkout; install the package with pip install -e {_root}"
        )
    )

from mqnc.base.runtime import use_interpreter_on_cpu_only_torch

use_interpreter_on_cpu_only_torch()  # before anything here imports triton

# ruff: noqa: E402  (the interpreter is chosen above, before triton is imported)

from mqnc.triton_kernels import ops  # noqa: F401  (declares the torch.ops.mqnc.* ops)
from mqnc.triton_kernels.fp8.quant import fp8_dequantize, fp8_quantize
from mqnc.triton_kernels.merge.partials import (
    lse_from_base2,
    lse_from_ml,
    lse_to_base2,
    merge_partials,
    merge_partials_into,
    ml_from_lse,
)
from mqnc.triton_kernels.mla.decode import (
    mla_decode_partial,
    mla_decode_partial_csr,
    plan_mla_decode,
    plan_mla_decode_csr,
)
from mqnc.triton_kernels.mla.plan import AttentionPlan
from mqnc.triton_kernels.mla.sparse import mla_sparse_partial, plan_mla_sparse
from mqnc.triton_kernels.splice.rotate import rope_rotate, rope_splice
from mqnc.triton_kernels.tp.scores import tp_partial_scores
from mqnc.triton_kernels.tp.values import tp_partial_values

__all__ = [
    "merge_partials",
    "merge_partials_into",
    "lse_to_base2",
    "lse_from_base2",
    "lse_from_ml",
    "ml_from_lse",
    "mla_decode_partial",
    "mla_decode_partial_csr",
    "mla_sparse_partial",
    "plan_mla_decode",
    "plan_mla_decode_csr",
    "plan_mla_sparse",
    "AttentionPlan",
    "rope_splice",
    "rope_rotate",
    "tp_partial_scores",
    "tp_partial_values",
    "fp8_quantize",
    "fp8_dequantize",
]
