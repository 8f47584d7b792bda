"""Where the holder's and the requester's arithmetic runs: the Triton kernels or their fp64
torch references, chosen once per object with ``kernels=``.

Every primitive of §2.1 ends in one of five kernel calls: dense paged or sparse top-k partial
absorbed-MLA attention, the M-way merge of partials (§3.3), the query rotation by ``-delta``
(route, §3.2) and the splice of a fetched chunk (§2.2). :class:`~mqnc.serving.Holder`,
:class:`~mqnc.serving.Requester` and the paged pool call them through the object
:func:`kernel_ops` returns: the kernel ops (``mqnc.triton_kernels.ops``, one declaration each)
bound to a backend, under the kernels' own names and signatures:

``"triton"`` (the default)
    the package :mod:`mqnc.triton_kernels` itself (compiled on a GPU, interpreted on a CPU);
``"torch"``
    the same ops on their ``"torch"`` backend (:data:`ReferenceOps`): the fp64 references of
    :mod:`mqnc.reference.torch_backend`, registered here (this layer may import both), rounded once
    to the kernels' output dtypes (``o`` in the query's dtype, ``lse`` float32, rotated and spliced
    rows in the input's / pool's dtype). For tests and CPU runs that exercise the serving logic
    (transport, batching, fallback, an external model's decode loop) rather than the kernels: the
    Triton interpreter takes ~0.1 s per merge on a CPU, the reference well under 1 ms.

Shapes, dtypes and the LSE base (natural log) are the kernels'; see their docstrings.
"""

from __future__ import annotations

from mqnc.reference.torch_backend import IMPLEMENTATIONS, ROWS_PER_SLICE
from mqnc.triton_kernels.ops import backend_ops, register_backend

__all__ = ["KERNELS", "ROWS_PER_SLICE", "ReferenceOps", "check_kernels", "kernel_ops"]

KERNELS = ("triton", "torch")

register_backend("torch", IMPLEMENTATIONS)

ReferenceOps = backend_ops("torch")
"""The kernel ops on the torch backend (``kernel_ops("torch")``): the fp64 references, rounded
once; their ``out=`` is checked and written as the kernels' is."""


def check_kernels(kernels: object) -> str:
    """``kernels`` if it is one of :data:`KERNELS`, else a ``ValueError`` naming it."""
    if kernels not in KERNELS:
        raise ValueError(f"kernels: expected one of {KERNELS}, got {kernels!r}")
    return kernels  # type: ignore[return-value]


def kernel_ops(kernels: str = "triton"):
    """The kernel ops bound to ``kernels`` (:data:`KERNELS`): attribute ``<name>`` is op
    ``<name>``'s public function on that backend (for ``"triton"``, the very functions of
    :mod:`mqnc.triton_kernels`)."""
    return backend_ops(check_kernels(kernels))
