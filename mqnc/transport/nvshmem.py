"""NVSHMEM engine (GPU only): nvshmem4py bootstrap and RMA, Triton device-initiated put-with-signal.

**GPU-only and imported lazily.** Importing this module imports neither ``nvshmem.core`` nor
CUDA: everything that touches them happens inside :class:`NvshmemTransport` (or the functions
below), so CPU machines never load NVSHMEM. The engine cannot run without a CUDA device and the
nvshmem4py wheel (``pip install 'mqnc[gpu]'``: ``nvshmem4py-cu13``, whose dependency
``nvidia-nvshmem-cu13`` ships ``libnvshmem_device.bc``). It is exercised by
``perf/gpu_check_nvshmem.py`` on a GPU machine, not by the CPU test suite.

Facts it is built on (nvshmem4py 0.4.1, NVSHMEM 3.x; see DESIGN.md, "Transport"):

- bootstrap: rank 0 creates a unique id (``nvshmem.core.get_unique_id()``), its bytes go to the
  other ranks through a ``torch.distributed`` store (the UID broadcast), and every rank calls
  ``nvshmem.core.init(device=, uid=, rank=, nranks=, initializer_method="uid")``;
- symmetric memory: ``nvshmem.core.tensor`` (a torch view of the symmetric heap). The RMA calls
  take whole tracked tensors or ``cuda.core.Buffer`` objects; exact byte ranges of a slot are
  passed as ``Buffer.from_handle(ptr, nbytes)`` sub-buffers of the symmetric allocations;
- host RMA is stream-ordered (``put_signal``, ``get``, ``quiet``, ``barrier_all`` take a
  stream);
- signal and comparison constants come from ``nvshmem.core`` (``SignalOp.SIGNAL_SET`` = 9,
  ``SIGNAL_ADD`` = 10, ``ComparisonType.CMP_GE`` = 5 in NVSHMEM); the engine checks them at
  start-up, because some public code passes rocSHMEM's values (0, 5, 3) by mistake (PyTorch's
  ``_nvshmem_triton.py`` docstrings among them);
- several PEs on one GPU run in NVSHMEM's limited multi-process mode, where host-side
  ``signal_wait`` / ``wait_until`` on a stream and team barriers abort the process; ``put``,
  ``get``, ``put_signal``, ``quiet`` and ``barrier_all`` work. So every wait here is
  **device-side**: a small Triton kernel polls the local signal word with volatile loads for a
  bounded number of spins and the host relaunches it until the timeout, which keeps every wait
  bounded (an ``nvshmem_signal_wait_until`` kernel cannot be interrupted);
- the device-initiated path (§3.2: "block-scope ``nvshmemx_putmem_signal_nbi_block``") is a
  Triton kernel calling NVSHMEM's device bitcode through ``extern_elementwise``, as PyTorch's
  ``torch/distributed/_symmetric_memory/_nvshmem_triton.py`` does; its module is registered
  with ``nvshmem.bindings.cumodule_init`` after compilation. IBGDA itself needs NICs and two
  nodes: on one GPU the puts go over the local (P2P) transport.
"""

from __future__ import annotations

import os
import sys
import sysconfig
import time

import torch
import triton
import triton.language as tl
from triton.language import core as tlcore

from mqnc.transport.protocol import SlotLayout, Transport, TransportTimeout, check_message

__all__ = [
    "NvshmemTransport",
    "nvshmem_available",
    "device_library_path",
    "signal_constants",
    "device_put_signal",
    "device_wait_until",
    "compile_device_kernels",
]

_UID_KEY = "mqnc/nvshmem/uid"
# NVSHMEM's own values (nvshmem.h); checked against nvshmem.core at start-up.
NVSHMEM_SIGNAL_SET, NVSHMEM_SIGNAL_ADD, NVSHMEM_CMP_GE = 9, 10, 5


def nvshmem_available() -> bool:
    """True when nvshmem4py is importable and a CUDA device exists (nothing is initialised)."""
    if not torch.cuda.is_available():
        return False
    try:
        import nvshmem.core  # noqa: F401
    except ImportError:
        return False
    return True


def _core():
    try:
        import nvshmem.core as nv
    except ImportError as exc:
        raise RuntimeError(
            "nvshmem engine: nvshmem4py is not installed (pip install 'mqnc[gpu]', i.e. "
            "nvshmem4py-cu13); it is GPU-only"
        ) from exc
    return nv


def signal_constants() -> dict[str, int]:
    """``SIGNAL_SET``, ``SIGNAL_ADD`` and ``CMP_GE`` as nvshmem.core defines them (checked)."""
    nv = _core()
    got = {
        "SIGNAL_SET": int(nv.SignalOp.SIGNAL_SET),
        "SIGNAL_ADD": int(nv.SignalOp.SIGNAL_ADD),
        "CMP_GE": int(nv.ComparisonType.CMP_GE),
    }
    want = {
        "SIGNAL_SET": NVSHMEM_SIGNAL_SET,
        "SIGNAL_ADD": NVSHMEM_SIGNAL_ADD,
        "CMP_GE": NVSHMEM_CMP_GE,
    }
    if got != want:
        raise RuntimeError(f"nvshmem.core signal constants {got} differ from NVSHMEM's {want}")
    return got


def device_library_path() -> str:
    """Path of ``libnvshmem_device.bc`` (``NVSHMEM_LIB_DIR`` or the nvidia-nvshmem wheel)."""
    cands = []
    if os.environ.get("NVSHMEM_LIB_DIR"):
        cands.append(os.environ["NVSHMEM_LIB_DIR"])
    purelib = sysconfig.get_path("purelib")
    # the base interpreter's site-packages too (a venv may not carry the wheel itself)
    base = sysconfig.get_path(
        "purelib", vars={"base": sys.base_prefix, "platbase": sys.base_prefix}
    )
    cands += [
        os.path.join(purelib, "nvidia", "nvshmem", "lib"),
        os.path.join(base, "nvidia", "nvshmem", "lib"),
        "/usr/local/lib",
        "/usr/lib",
        "/opt/nvidia/nvshmem/lib",
    ]
    try:
        import nvidia.nvshmem as pkg  # the nvidia-nvshmem-cu12/13 wheel

        for p in getattr(pkg, "__path__", []):
            cands.append(os.path.join(p, "lib"))
    except ImportError:
        pass
    for d in cands:
        for name in ("libnvshmem_device.bc",):
            path = os.path.join(d, name)
            if os.path.exists(path):
                return path
    raise RuntimeError(f"nvshmem engine: libnvshmem_device.bc not found in {cands}")


# ---- Triton device functions: NVSHMEM device bitcode through externs ---------------------------


@tlcore.extern
def _putmem_signal_nbi_block(dst, src, nbytes, sig, sig_val, sig_op, pe, _semantic=None):
    return tlcore.extern_elementwise(
        "",
        "",
        [dst, src, nbytes, sig, sig_val, sig_op, pe],
        {
            (
                tlcore.dtype("int64"),
                tlcore.dtype("int64"),
                tlcore.dtype("int64"),
                tlcore.dtype("int64"),
                tlcore.dtype("uint64"),
                tlcore.dtype("int32"),
                tlcore.dtype("int32"),
            ): ("nvshmemx_putmem_signal_nbi_block", tlcore.dtype("int32"))
        },
        is_pure=False,
        _semantic=_semantic,
    )


@tlcore.extern
def _signal_wait_until(sig, cmp, cmp_val, _semantic=None):
    return tlcore.extern_elementwise(
        "",
        "",
        [sig, cmp, cmp_val],
        {
            (tlcore.dtype("int64"), tlcore.dtype("int32"), tlcore.dtype("uint64")): (
                "nvshmem_signal_wait_until",
                tlcore.dtype("int32"),
            )
        },
        is_pure=False,
        _semantic=_semantic,
    )


@tlcore.extern
def _quiet(_semantic=None):
    return tlcore.extern_elementwise(
        "",
        "",
        [],
        {(): ("nvshmem_quiet", tlcore.dtype("int32"))},
        is_pure=False,
        _semantic=_semantic,
    )


@triton.jit
def _put_signal_block_kernel(dst, src, nbytes, sig, sig_val, sig_op, pe):
    """One block: block-scope non-blocking put-with-signal, then quiet (§3.2)."""
    _putmem_signal_nbi_block(
        dst.to(tl.int64),
        src.to(tl.int64),
        nbytes.to(tl.int64),
        sig.to(tl.int64),
        sig_val.to(tl.uint64),
        sig_op.to(tl.int32),
        pe.to(tl.int32),
    )
    _quiet()


@triton.jit
def _wait_until_kernel(sig, cmp, cmp_val):
    """Device-side ``nvshmem_signal_wait_until`` (unbounded: use only when the signal is due)."""
    _signal_wait_until(sig.to(tl.int64), cmp.to(tl.int32), cmp_val.to(tl.uint64))


@triton.jit
def _poll_kernel(sig_ptr, target, out_ptr, spins):
    """Bounded device-side wait: spin on the local signal word until it reaches ``target`` or
    ``spins`` volatile loads have been made; store what was seen."""
    v = tl.load(sig_ptr, volatile=True)
    i = 0
    while (v < target) & (i < spins):
        v = tl.load(sig_ptr, volatile=True)
        i += 1
    tl.store(out_ptr, v)


def compile_device_kernels(arch: int = 90) -> dict[str, dict]:
    """Compile the device-initiated kernels for ``sm_<arch>`` against NVSHMEM's device bitcode,
    without a GPU (``triton.compile`` for a ``GPUTarget``). Returns, per kernel, the cubin size
    and which NVSHMEM device functions its PTX calls. Needs ``libnvshmem_device.bc`` only."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    libs = (("libnvshmem_device", device_library_path()),)
    i64 = "i64"
    specs = {
        "put_signal_block": (
            _put_signal_block_kernel,
            dict(dst=i64, src=i64, nbytes=i64, sig=i64, sig_val=i64, sig_op="i32", pe="i32"),
        ),
        "wait_until": (_wait_until_kernel, dict(sig=i64, cmp="i32", cmp_val=i64)),
        "poll": (_poll_kernel, dict(sig_ptr="*i64", target=i64, out_ptr="*i64", spins="i32")),
    }
    names = ("nvshmemx_putmem_signal_nbi_block", "nvshmem_signal_wait_until", "nvshmem_quiet")
    out = {}
    for name, (fn, sig) in specs.items():
        k = triton.compile(
            ASTSource(fn=fn, signature=sig, constexprs={}),
            target=GPUTarget("cuda", arch, 32),
            options={"extern_libs": libs, "num_warps": 4},
        )
        ptx = k.asm["ptx"]
        out[name] = dict(cubin_bytes=len(k.asm["cubin"]), calls=[n for n in names if n in ptx])
    return out


_INITIALISED_MODULES: set[int] = set()


def _launch_extern(kernel, args, stream: torch.cuda.Stream) -> None:
    """Launch a kernel that calls NVSHMEM device functions: compile it against the device
    bitcode, register its module with nvshmem4py once, then launch on ``stream``."""
    import nvshmem.bindings as nvb

    libs = {"libnvshmem_device": device_library_path()}
    with torch.cuda.stream(stream):
        compiled = kernel.warmup(*args, grid=(1,), extern_libs=libs)
        compiled._init_handles()
        if id(compiled) not in _INITIALISED_MODULES:
            nvb.cumodule_init(int(compiled.module))
            _INITIALISED_MODULES.add(id(compiled))
        kernel[(1,)](*args, extern_libs=libs)


def device_put_signal(
    dst_ptr: int,
    src_ptr: int,
    nbytes: int,
    sig_ptr: int,
    value: int,
    pe: int,
    stream: torch.cuda.Stream,
) -> None:
    """Device-initiated put-with-signal (``SIGNAL_SET``) of ``nbytes`` from a local symmetric
    address to ``pe``'s, from a Triton kernel (one block), followed by ``nvshmem_quiet``."""
    set_op = signal_constants()["SIGNAL_SET"]
    _launch_extern(
        _put_signal_block_kernel, (dst_ptr, src_ptr, nbytes, sig_ptr, value, set_op, pe), stream
    )


def device_wait_until(sig_ptr: int, value: int, stream: torch.cuda.Stream) -> None:
    """Device-side ``nvshmem_signal_wait_until(sig, CMP_GE, value)`` (unbounded)."""
    _launch_extern(_wait_until_kernel, (sig_ptr, signal_constants()["CMP_GE"], value), stream)


class NvshmemTransport(Transport):
    """One PE of the NVSHMEM engine (GPU only).

    Parameters
    ----------
    rank, world_size : int
        This PE and the number of PEs.
    store : torch.distributed.Store
        Carries the NVSHMEM unique id from rank 0 to the others.
    slot_bytes : int
        Bytes per slot (symmetric: the same on every PE).
    lanes : int
    device : torch.device or int or None
        The CUDA device (default: the current one). Two PEs may share one GPU (limited MPG).
    device_put : bool
        Issue puts from a Triton kernel (device-initiated, the paper's path) instead of the
        host's stream-ordered ``put_signal``.
    poll_spins : int
        Volatile loads per launch of the bounded device-side wait.
    """

    name = "nvshmem"

    def __init__(
        self,
        rank: int,
        world_size: int,
        store,
        *,
        slot_bytes: int,
        lanes: int = 1,
        device=None,
        device_put: bool = False,
        poll_spins: int = 1 << 16,
    ) -> None:
        super().__init__(rank, SlotLayout(world_size, lanes), slot_bytes)
        if not torch.cuda.is_available():
            raise RuntimeError("nvshmem engine: needs a CUDA device (GPU only)")
        import numpy as np

        nv = _core()
        from cuda.core import Buffer, Device

        self._nv, self._Buffer = nv, Buffer
        self.consts = signal_constants()
        if device is None:
            index = torch.cuda.current_device()
        elif isinstance(device, int):
            index = device
        else:
            index = torch.device(device).index or 0
        self.device = torch.device("cuda", index)
        torch.cuda.set_device(self.device)
        dev = Device(self.device.index)
        dev.set_current()
        if rank == 0:
            uid = nv.get_unique_id()
            store.set(_UID_KEY, uid._data.view(np.int8).tobytes())
        else:
            raw = store.get(_UID_KEY)
            uid = nv.get_unique_id(empty=True)
            uid._data.view(np.int8)[:] = np.frombuffer(raw, dtype=np.int8)
        nv.init(device=dev, uid=uid, rank=rank, nranks=world_size, initializer_method="uid")
        n = self.layout.num_slots
        # Symmetric allocations, in the same order on every PE.
        self._heap = nv.tensor((n * slot_bytes,), dtype=torch.uint8)
        self._stage = nv.tensor((n * slot_bytes,), dtype=torch.uint8)
        self._sig = nv.tensor((n,), dtype=torch.int64)
        self._sig.zero_()
        self._seen = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._stream = torch.cuda.Stream(self.device)
        self._wait_stream = torch.cuda.Stream(self.device)
        self.device_put = bool(device_put)
        self.poll_spins = int(poll_spins)
        torch.cuda.synchronize(self.device)
        nv.barrier_all(stream=self._stream)
        self._stream.synchronize()
        self._closed = False

    # ---- helpers ------------------------------------------------------------------------------
    def _sub(self, t: torch.Tensor, offset: int, nbytes: int):
        return self._Buffer.from_handle(int(t.data_ptr()) + offset, nbytes)

    def _slot_off(self, slot: int) -> int:
        return slot * self.slot_bytes

    # ---- the protocol -------------------------------------------------------------------------
    def put_signal(self, peer: int, slot: int, data: torch.Tensor, seq: int) -> None:
        self.check_peer(peer)
        self._check_slot(slot)
        data = check_message(data, self.slot_bytes)
        n = int(data.numel())
        off = self._slot_off(slot)
        with torch.cuda.stream(self._stream):
            self._stage[off : off + n].copy_(data, non_blocking=True)
        if self.device_put:
            device_put_signal(
                int(self._heap.data_ptr()) + off,
                int(self._stage.data_ptr()) + off,
                n,
                int(self._sig.data_ptr()) + 8 * slot,
                int(seq),
                peer,
                self._stream,
            )
            return
        self._nv.put_signal(
            self._sub(self._heap, off, max(n, 1)),
            self._sub(self._stage, off, max(n, 1)),
            self._sub(self._sig, 8 * slot, 8),
            int(seq),
            self._nv.SignalOp.SIGNAL_SET,
            remote_pe=peer,
            stream=self._stream,
        )

    def quiet(self, timeout: float | None = None, peers=None) -> None:
        self._nv.quiet(stream=self._stream)
        self._stream.synchronize()

    def signal(self, slot: int) -> int:
        self._check_slot(slot)
        return int(self._sig[slot].item())

    def wait_any(self, targets: dict[int, int], timeout: float) -> list[int]:
        for s in targets:
            self._check_slot(s)
        deadline = self._deadline(timeout)
        while True:
            vals = self._sig.cpu()
            ready = [s for s, q in targets.items() if int(vals[s]) >= q]
            if ready:
                return ready
            if time.monotonic() >= deadline:
                raise TransportTimeout(
                    f"PE {self.rank}: no signal on slots {sorted(targets)} within {timeout:.3g} s"
                )
            if len(targets) == 1:
                # Device-side bounded spin on the one awaited word (limited-MPG safe).
                ((s, q),) = targets.items()
                with torch.cuda.stream(self._wait_stream):
                    _poll_kernel[(1,)](self._sig[s:], q, self._seen, self.poll_spins)
                self._wait_stream.synchronize()
            else:
                time.sleep(20e-6)

    def read(self, slot: int, nbytes: int | None = None) -> torch.Tensor:
        self._check_slot(slot)
        n = self.slot_bytes if nbytes is None else int(nbytes)
        off = self._slot_off(slot)
        torch.cuda.current_stream(self.device).synchronize()
        return self._heap[off : off + n].cpu()

    def get(self, peer: int, slot: int, nbytes: int, timeout: float) -> torch.Tensor:
        self.check_peer(peer)
        self._check_slot(slot)
        off, n = self._slot_off(slot), int(nbytes)
        # Lands in this PE's staging copy of the slot (symmetric), then leaves the device.
        self._nv.get(
            self._sub(self._stage, off, max(n, 1)),
            self._sub(self._heap, off, max(n, 1)),
            remote_pe=peer,
            stream=self._stream,
        )
        self._nv.quiet(stream=self._stream)
        self._stream.synchronize()
        return self._stage[off : off + n].cpu()

    def barrier(self, timeout: float) -> None:
        """``barrier_all`` (works in limited MPG mode). A GPU collective cannot be abandoned:
        ``timeout`` is not enforced; call it only while every PE is alive."""
        self._nv.barrier_all(stream=self._stream)
        self._stream.synchronize()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        torch.cuda.synchronize(self.device)
        nv = self._nv
        for t in (self._heap, self._stage, self._sig):
            nv.free_tensor(t)
        nv.finalize()
