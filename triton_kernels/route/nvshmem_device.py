"""NVSHMEM's device functions for the kernel layer's device route (``route.holder_loop``,
``route.put``): extern calls into NVSHMEM's device bitcode (``libnvshmem_device*.bc``, passed as
``extern_libs={"libnvshmem_device": path}`` at launch), as ``mqnc.transport.nvshmem`` declares
its own for the host-driven engine. Block-scope calls: every thread of the CTA must reach them
(call them under CTA-uniform conditions only). Signal operation ``SIGNAL_SET`` is NVSHMEM's 9.
Never traced under the interpreter (the kernels take them behind a ``NVSHMEM`` constexpr).
"""

from __future__ import annotations

from triton.language import core as tlcore

SIGNAL_SET = 9  # NVSHMEM's NVSHMEM_SIGNAL_SET (nvshmem.h)

_I64, _U64, _I32 = tlcore.dtype("int64"), tlcore.dtype("uint64"), tlcore.dtype("int32")


@tlcore.extern
def putmem_nbi_block(dst, src, nbytes, pe, _semantic=None):
    """``nvshmemx_putmem_nbi_block(dst, src, nbytes, pe)``: addresses as int64."""
    return tlcore.extern_elementwise(
        "",
        "",
        [dst, src, nbytes, pe],
        {(_I64, _I64, _I64, _I32): ("nvshmemx_putmem_nbi_block", _I32)},
        is_pure=False,
        _semantic=_semantic,
    )


@tlcore.extern
def putmem_signal_nbi_block(dst, src, nbytes, sig, sig_val, sig_op, pe, _semantic=None):
    """``nvshmemx_putmem_signal_nbi_block``: the data, then ``*sig = sig_val`` on ``pe``."""
    return tlcore.extern_elementwise(
        "",
        "",
        [dst, src, nbytes, sig, sig_val, sig_op, pe],
        {
            (_I64, _I64, _I64, _I64, _U64, _I32, _I32): (
                "nvshmemx_putmem_signal_nbi_block",
                _I32,
            )
        },
        is_pure=False,
        _semantic=_semantic,
    )


@tlcore.extern
def fence(_semantic=None):
    """``nvshmem_fence()``: puts to one PE before it are delivered before puts after it."""
    return tlcore.extern_elementwise(
        "", "", [], {(): ("nvshmem_fence", _I32)}, is_pure=False, _semantic=_semantic
    )


@tlcore.extern
def quiet(_semantic=None):
    """``nvshmem_quiet()``: every put of this PE so far is complete."""
    return tlcore.extern_elementwise(
        "", "", [], {(): ("nvshmem_quiet", _I32)}, is_pure=False, _semantic=_semantic
    )
