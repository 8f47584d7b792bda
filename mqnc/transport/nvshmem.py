"""NVSHMEM engine (GPU only): nvshmem4py bootstrap and RMA, Triton device-initiated put-with-signal.

**GPU-only and imported lazily.** Importing this module imports neither ``nvshmem.core`` nor
CUDA: everything that touches them happens inside :class:`NvshmemTransport` (or the functions
below), so CPU machines never load NVSHMEM. The engine cannot run without a CUDA device and the
nvshmem4py wheel (``pip install 'mqnc[gpu]'``: ``nvshmem4py-cu13`` 0.4.1, which needs
``cuda.core >= 0.5.0``, ``cuda.pathfinder >= 1.2.3`` and ``nvidia-nvshmem-cu13``, any version:
3.4.5, what torch 2.11 pins, ships ``libnvshmem_device.bc``; 3.8.0 only per-arch
``libnvshmem_device_sm_<arch>.bc``). It runs on a GPU machine by ``python -m
perf.gpu_check_nvshmem``; the CPU test suite compiles its device kernels launch-exact for sm_90
(``correctness/test_nvshmem_kernels.py``) and runs its bounded wait kernel interpreted.

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
  **device-side**, on one slot or several alike: a small Triton kernel (``_poll_kernel``) polls
  the awaited signal words with volatile loads until one reaches its target or a bounded number
  of rounds has passed, then writes what it saw; the host reads that once (one sync, no
  ``sleep``) and relaunches until the timeout, which keeps every wait bounded (an
  ``nvshmem_signal_wait_until`` kernel cannot be interrupted). :attr:`NvshmemTransport.wait_paths`
  counts the waits by path (``device-poll[1]``: one slot, ``device-poll[n]``: several), and the
  GPU check records it;
- **two PEs on one GPU time-slice**: they are two processes, two CUDA contexts, and without MPS
  the GPU runs one context at a time, switching at time-slice boundaries. While one PE's wait
  kernel spins, the other PE's put waits for its slice, so probe and route times measured with
  both PEs on one GPU include context switches: an upper bound on the protocol's cost,
  not the NVLink / IBGDA latency of §3.2 (kept short by bounding each spin: ``poll_spins``);
- the device-initiated path (§3.2: "block-scope ``nvshmemx_putmem_signal_nbi_block``") is a
  Triton kernel calling NVSHMEM's device bitcode through ``extern_elementwise``, as PyTorch's
  ``torch/distributed/_symmetric_memory/_nvshmem_triton.py`` does; its module is registered
  with ``nvshmem.bindings.cumodule_init`` after compilation. IBGDA itself needs NICs and two
  nodes: on one GPU the puts go over the local (P2P) transport.
"""

from __future__ import annotations

import collections
import contextlib
import os
import sys
import sysconfig
import threading
import time

import torch
import triton
import triton.language as tl
from triton.language import core as tlcore

from mqnc.base.checks import check_int
from mqnc.base.env import nvshmem_lib_dir
from mqnc.transport.protocol import (
    SlotLayout,
    Transport,
    TransportError,
    TransportTimeout,
    as_tensor,
    handshake,
)

__all__ = [
    "NvshmemTransport",
    "nvshmem_available",
    "device_library_path",
    "signal_constants",
    "device_put_signal",
    "device_wait_until",
    "device_kernel_launches",
    "compile_device_kernels",
    "poll_signals",
]

_UID_KEY = "mqnc/nvshmem/uid"
SIGNAL_LIMIT = 2**63  # signals are int64 words here (the protocol's are u64)
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


def bitcode_names(arch: int) -> tuple[str, str]:
    """The device bitcode's file names, preferred first: NVSHMEM >= 3.5 wheels ship only
    per-arch files (``libnvshmem_device_sm_90.bc``, 3.8.0), 3.4.5 (torch 2.11's pin) one
    ``libnvshmem_device.bc``."""
    return (f"libnvshmem_device_sm_{arch}.bc", "libnvshmem_device.bc")


def _nvshmem4py_bitcode(arch: int) -> str | None:
    """What nvshmem4py itself reports (0.4.1: ``nvshmem.core.find_device_bitcode_library``,
    the per-arch file first, then the generic one), or None where it cannot say (not
    installed, too old, or its CUDA libraries missing)."""
    try:
        from nvshmem.core import find_device_bitcode_library
    except Exception:  # noqa: BLE001 - absent, or present but unloadable off a GPU
        return None
    for kwargs in ({"arch": arch}, {}):
        try:
            path = str(find_device_bitcode_library(**kwargs))
        except Exception:  # noqa: BLE001 - that file does not exist in this install
            continue
        if os.path.exists(path):
            return path
    return None


def _library_dirs() -> list[str]:
    """Where an nvidia-nvshmem wheel or a system install keeps the bitcode."""
    purelib = sysconfig.get_path("purelib")
    # the base interpreter's site-packages too (a venv may not carry the wheel itself)
    base = sysconfig.get_path(
        "purelib", vars={"base": sys.base_prefix, "platbase": sys.base_prefix}
    )
    dirs = []
    try:
        import nvidia.nvshmem as pkg  # the nvidia-nvshmem-cu12/13 wheel

        dirs += [os.path.join(p, "lib") for p in getattr(pkg, "__path__", [])]
    except ImportError:
        pass
    dirs += [
        os.path.join(purelib, "nvidia", "nvshmem", "lib"),
        os.path.join(base, "nvidia", "nvshmem", "lib"),
        "/usr/local/lib",
        "/usr/lib",
        "/opt/nvidia/nvshmem/lib",
    ]
    return list(dict.fromkeys(dirs))


def device_library_path(arch: int | None = None) -> str:
    """Path of NVSHMEM's device bitcode for ``sm_<arch>`` (default: the current GPU's, else 90).

    Looked for in this order: ``$NVSHMEM_LIB_DIR``; what nvshmem4py reports
    (``find_device_bitcode_library``); the nvidia-nvshmem wheel's ``lib`` folder and system
    folders. In each folder ``libnvshmem_device_sm_<arch>.bc`` is preferred to
    ``libnvshmem_device.bc`` (:func:`bitcode_names`).
    """
    if arch is None:
        arch = 90
        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability()
            arch = 10 * major + minor
    names = bitcode_names(arch)
    dirs = [nvshmem_lib_dir()] if nvshmem_lib_dir() else []
    for d in dirs:
        for name in names:
            if os.path.exists(os.path.join(d, name)):
                return os.path.join(d, name)
    found = _nvshmem4py_bitcode(arch)
    if found:
        return found
    dirs += _library_dirs()
    for d in dirs:
        for name in names:
            if os.path.exists(os.path.join(d, name)):
                return os.path.join(d, name)
    raise RuntimeError(
        f"nvshmem engine: none of {list(names)} found ($NVSHMEM_LIB_DIR, nvshmem4py, {dirs}); "
        "install nvidia-nvshmem-cu13 or set NVSHMEM_LIB_DIR"
    )


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


# Every argument of the device-initiated kernels varies from call to call (addresses, sizes,
# sequence numbers, PEs) and none may become a constexpr: Triton would specialise an int equal
# to 1 (``pe=1``, ``sig_val=1``: the first put from PE 0 to PE 1) into a constexpr, on which
# ``.to()`` fails to compile, and compile one more variant per divisibility class of the others.
_PUT_ARGS = ["dst", "src", "nbytes", "sig", "sig_val", "sig_op", "pe"]


@triton.jit(do_not_specialize=_PUT_ARGS)
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


@triton.jit(do_not_specialize=["sig", "cmp", "cmp_val"])
def _wait_until_kernel(sig, cmp, cmp_val):
    """Device-side ``nvshmem_signal_wait_until`` (unbounded: use only when the signal is due)."""
    _signal_wait_until(sig.to(tl.int64), cmp.to(tl.int32), cmp_val.to(tl.uint64))


@triton.jit(do_not_specialize=["n", "spins"])
def _poll_kernel(SIG, SLOTS, TARGETS, n, SEEN, spins, BLOCK: tl.constexpr):
    """Bounded device-side wait on ``n`` signal words: ``SIG[SLOTS[i]] >= TARGETS[i]`` for some
    ``i``, or ``spins`` rounds of volatile loads; stores the last values seen in ``SEEN[:n]``."""
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    slots = tl.load(SLOTS + offs, mask=mask, other=0)
    want = tl.load(TARGETS + offs, mask=mask, other=0)
    v = tl.load(SIG + slots, mask=mask, other=0, volatile=True)
    done = tl.max(tl.where(mask & (v >= want), 1, 0), axis=0)
    i = 0
    while (done == 0) & (i < spins):
        v = tl.load(SIG + slots, mask=mask, other=0, volatile=True)
        done = tl.max(tl.where(mask & (v >= want), 1, 0), axis=0)
        i += 1
    tl.store(SEEN + offs, v, mask=mask)


def poll_block(num_slots: int) -> int:
    """``_poll_kernel``'s ``BLOCK`` for a transport of ``num_slots`` slots (one compile per
    transport size, whatever the number of awaited slots)."""
    return max(2, triton.next_power_of_2(num_slots))


def poll_signals(
    sig: torch.Tensor, targets: dict[int, int], spins: int, stream=None
) -> dict[int, int]:
    """One bounded device-side wait (``_poll_kernel``) on ``targets`` (slot -> sequence) of the
    signal words ``sig [num_slots]`` int64: returns each awaited slot's value when the kernel
    stopped (one host sync, on ``stream`` when given). Runs interpreted on CPU tensors."""
    slots = list(targets)
    block = poll_block(sig.numel())
    # [2, BLOCK]: both rows 16-byte aligned whatever the number of slots, so every wait launches
    # the one compiled variant (Triton specialises pointers on 16-byte divisibility).
    spec = torch.zeros(2, block, dtype=torch.int64)
    spec[0, : len(slots)] = torch.tensor(slots, dtype=torch.int64)
    spec[1, : len(slots)] = torch.tensor([int(targets[k]) for k in slots], dtype=torch.int64)
    ctx = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
    with ctx:
        spec = spec.to(sig.device, non_blocking=True)
        seen = torch.empty(block, dtype=torch.int64, device=sig.device)
        _poll_kernel[(1,)](sig, spec[0], spec[1], len(slots), seen, int(spins), BLOCK=block)
        vals = seen[: len(slots)].cpu()
    return dict(zip(slots, vals.tolist(), strict=True))


def device_kernel_launches(
    lib: str, *, pe: int = 1, seq: int = 1, num_slots: int = 4, device="cpu"
) -> dict[str, tuple]:
    """The device kernels' launches at real values, for :func:`compile_device_kernels` and the
    GPU check's warm-up: ``{name: (kernel, args, kwargs, grid)}``. ``pe`` and ``seq`` are the
    edge values by default (PE 1, sequence 1: the first put from PE 0 to PE 1); addresses are
    16-byte aligned symmetric-heap-like ints, an 8-byte signal word off a 16-byte boundary;
    ``num_slots`` 4 is the two-PE, one-lane layout of the GPU check."""
    heap = 0x7F00_0020_0000
    slot_bytes = 16 * 1152 + 96
    libs = {"libnvshmem_device": lib}
    sig = torch.zeros(num_slots, dtype=torch.int64, device=device)
    spec = torch.zeros(2, poll_block(num_slots), dtype=torch.int64, device=device)
    seen = torch.zeros(poll_block(num_slots), dtype=torch.int64, device=device)
    return {
        "put_signal_block": (
            _put_signal_block_kernel,
            (heap + slot_bytes, heap + 2 * slot_bytes, slot_bytes, heap + 8, seq, 9, pe),
            {"extern_libs": libs, "num_warps": 4},
            (1,),
        ),
        "wait_until": (
            _wait_until_kernel,
            (heap + 8, NVSHMEM_CMP_GE, seq),
            {"extern_libs": libs, "num_warps": 4},
            (1,),
        ),
        "poll": (
            _poll_kernel,
            (sig, spec[0], spec[1], 1, seen, 1),
            {"BLOCK": poll_block(num_slots), "num_warps": 4},
            (1,),
        ),
    }


def compile_device_kernels(arch: int = 90, *, pe: int = 1, seq: int = 1) -> dict[str, dict]:
    """Compile the NVSHMEM engine's device kernels for ``sm_<arch>`` exactly as their launches
    compile (``mqnc.triton_kernels.sm90.compile.compile_launch``: the JIT's own specialisation of
    the real argument values, no GPU), against NVSHMEM's device bitcode
    (:func:`device_library_path`). Returns, per kernel, its resources (registers, stack, local:
    spills), the compiled kernel's hash and which NVSHMEM device functions its PTX calls.
    Must run in compiled mode, ``TRITON_INTERPRET=0`` (on a CPU-only torch importing the kernels
    would otherwise choose the interpreter)."""
    from mqnc.triton_kernels.sm90.compile import compile_launch, resources

    names = ("nvshmemx_putmem_signal_nbi_block", "nvshmem_signal_wait_until", "nvshmem_quiet")
    out = {}
    launches = device_kernel_launches(device_library_path(arch), pe=pe, seq=seq)
    for name, (fn, args, kwargs, grid) in launches.items():
        k = compile_launch(fn, args, kwargs, grid=grid, arch=arch)
        res = resources(name, k)
        out[name] = dict(
            registers=res.registers,
            stack=res.stack,
            local=res.local,
            hash=k.hash,
            cubin_bytes=len(k.asm["cubin"]),
            calls=[n for n in names if n in k.asm["ptx"]],
        )
    return out


_INITIALISED_MODULES: dict[int, int] = {}
"""Compiled kernel (``id``) -> its CUDA module, registered with the NVSHMEM instance of this
process (:func:`_finalize_modules` undoes it when that instance ends)."""


def _launch_extern(kernel, args, stream: torch.cuda.Stream) -> None:
    """Launch a kernel that calls NVSHMEM device functions: compile it against the device
    bitcode, register its module with nvshmem4py once per NVSHMEM instance, then launch on
    ``stream``."""
    import nvshmem.bindings as nvb

    libs = {"libnvshmem_device": device_library_path()}
    with torch.cuda.stream(stream):
        compiled = kernel.warmup(*args, grid=(1,), extern_libs=libs)
        compiled._init_handles()
        if id(compiled) not in _INITIALISED_MODULES:
            nvb.cumodule_init(int(compiled.module))
            _INITIALISED_MODULES[id(compiled)] = int(compiled.module)
        kernel[(1,)](*args, extern_libs=libs)


def _finalize_modules() -> None:
    """Unregister every module :func:`_launch_extern` registered (before ``finalize``): a later
    instance in this process registers them again with its own device state."""
    import nvshmem.bindings as nvb

    finalize = getattr(nvb, "cumodule_finalize", None)
    for module in _INITIALISED_MODULES.values():
        if finalize is not None:
            finalize(module)
    _INITIALISED_MODULES.clear()


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
        Bytes per slot (symmetric: the same on every PE). The PEs agree on it, ``lanes`` and
        the world size in a handshake on ``store`` before NVSHMEM is initialised
        (:func:`~mqnc.transport.protocol.handshake`: a mismatch is a ``ValueError`` naming
        both values, on every PE).
    lanes : int
    agree : mapping or None
        Further terms (JSON values) every PE must be built with, checked in the same
        handshake.
    device : torch.device or int or None
        The CUDA device (default: the current one). Two PEs may share one GPU (limited MPG).
    device_put : bool
        Issue puts from a Triton kernel (device-initiated, the paper's path) instead of the
        host's stream-ordered ``put_signal``.
    poll_spins : int
        Rounds of volatile loads per launch of the bounded device-side wait (short, so that a
        PE sharing the GPU gets its time slice back soon; the host relaunches until the
        timeout).

    Attributes
    ----------
    wait_paths : collections.Counter
        Waits by the path they took: ``device-poll[1]`` (one slot) or ``device-poll[n]``
        (several slots, e.g. a holder's inboxes); every wait is device-side.
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
        poll_spins: int = 1 << 12,
        agree=None,
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
        elif isinstance(device, int) and not isinstance(device, bool):
            index = device
        else:
            d = torch.device(device)
            if d.type != "cuda":
                raise ValueError(f"device: expected a CUDA device, got {device!r}")
            index = torch.cuda.current_device() if d.index is None else d.index
        self.device = torch.device("cuda", index)
        self.poll_spins = check_int("poll_spins", poll_spins, minimum=1)
        if not isinstance(device_put, bool):
            raise TypeError(f"device_put: expected a bool, got {type(device_put).__name__}")
        torch.cuda.set_device(self.device)
        dev = Device(self.device.index)
        dev.set_current()
        # One key per instance: every PE counts its instances on the store, so a second fabric
        # over the same store (a reused torchrun store) never reads the previous one's id.
        key = f"{_UID_KEY}/{store.add(f'{_UID_KEY}/count/{rank}', 1)}"
        import torch.distributed as dist

        terms = {"engine": self.name, "world_size": world_size, "lanes": lanes,
                 "slot_bytes": slot_bytes}  # fmt: skip
        clash = sorted(set(agree or ()) & set(terms))
        if clash:
            raise ValueError(f"agree: the engine's own terms {clash} are not the caller's")
        handshake(dist.PrefixStore(f"{key}/handshake", store), rank, world_size,
                  {**terms, **(agree or {})})  # fmt: skip
        if rank == 0:
            uid = nv.get_unique_id()
            store.set(key, uid._data.view(np.int8).tobytes())
        else:
            raw = store.get(key)
            uid = nv.get_unique_id(empty=True)
            uid._data.view(np.int8)[:] = np.frombuffer(raw, dtype=np.int8)
        nv.init(device=dev, uid=uid, rank=rank, nranks=world_size, initializer_method="uid")
        n = self.layout.num_slots
        # Symmetric allocations, in the same order on every PE.
        self._heap = nv.tensor((n * slot_bytes,), dtype=torch.uint8)
        self._stage = nv.tensor((n * slot_bytes,), dtype=torch.uint8)
        self._sig = nv.tensor((n,), dtype=torch.int64)
        self._sig.zero_()
        self._heap.zero_()  # an unwritten slot reads as zeros, as on the other engines
        self._stream = torch.cuda.Stream(self.device)
        self._wait_stream = torch.cuda.Stream(self.device)
        self.device_put = device_put
        # one staging region per slot serves every peer: a put's copy and its put are one step
        self._put_lock = threading.Lock()
        self.wait_paths: collections.Counter = collections.Counter()
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
    def _open(self) -> None:
        if self._closed:
            raise TransportError(f"PE {self.rank}: the NVSHMEM engine is closed")

    def put_signal(self, peer: int, slot: int, data: torch.Tensor, seq: int) -> None:
        """As the protocol's; this engine's signals are int64 words, so ``seq < 2**63``."""
        # a slot of this rank's, a u64 seq; a host array (the wire's array=True) as a tensor
        data = as_tensor(self._check_put(peer, slot, data, seq))
        if seq >= SIGNAL_LIMIT:
            raise ValueError(f"seq: expected an int in [0, 2**63) on this engine, got {seq}")
        self._open()
        n = int(data.numel())
        off = self._slot_off(slot)
        with self._put_lock:  # the next copy into this staging region waits for this put
            with torch.cuda.stream(self._stream):
                self._stage[off : off + n].copy_(data, non_blocking=True)
            if self.device_put:
                device_put_signal(
                    int(self._heap.data_ptr()) + off,
                    int(self._stage.data_ptr()) + off,
                    n,
                    int(self._sig.data_ptr()) + 8 * slot,
                    seq,
                    peer,
                    self._stream,
                )
                return
            sig = self._sub(self._sig, 8 * slot, 8)
            if n == 0:  # the signal alone: no byte of the slot is touched
                signal_op = getattr(self._nv, "signal_op", None)
                if signal_op is None:
                    raise ValueError("data: a 0-byte put needs nvshmem4py's signal_op")
                signal_op(sig, seq, self._nv.SignalOp.SIGNAL_SET, remote_pe=peer,
                          stream=self._stream)  # fmt: skip
                return
            self._nv.put_signal(
                self._sub(self._heap, off, n),
                self._sub(self._stage, off, n),
                sig,
                seq,
                self._nv.SignalOp.SIGNAL_SET,
                remote_pe=peer,
                stream=self._stream,
            )

    def quiet(self, timeout: float | None = None, peers=None) -> None:
        """Complete every put of this PE (``peers`` is not narrower on NVSHMEM: one quiet
        covers all). A GPU stream cannot be abandoned: ``timeout`` is checked, not enforced."""
        if timeout is not None:
            self._deadline(timeout)
        self._open()
        self._nv.quiet(stream=self._stream)
        self._stream.synchronize()

    def signal(self, slot: int) -> int:
        self._check_slot(slot)
        self._open()
        return int(self._sig[slot].item())

    def wait_any(self, targets: dict[int, int], timeout: float) -> list[int]:
        """Device-side: bounded polls of the awaited signal words (:func:`poll_signals`, one
        host sync each, no sleep) on the wait stream until one is reached or ``timeout``."""
        self._check_targets(targets)
        big = [q for q in targets.values() if not 0 <= q < SIGNAL_LIMIT]
        if big:
            raise ValueError(f"seq: expected ints in [0, 2**63) on this engine, got {big}")
        deadline = self._deadline(timeout)
        self._open()
        path = "device-poll[1]" if len(targets) == 1 else "device-poll[n]"
        while True:
            seen = poll_signals(self._sig, targets, self.poll_spins, self._wait_stream)
            ready = [s for s, q in targets.items() if seen[s] >= q]
            if ready:
                self.wait_paths[path] += 1
                return ready
            if time.monotonic() >= deadline:
                raise TransportTimeout(
                    f"PE {self.rank}: no signal on slots {sorted(targets)} within {timeout:.3g} s"
                )

    def read(self, slot: int, nbytes: int | None = None) -> torch.Tensor:
        self._check_slot(slot)
        n = self.slot_bytes if nbytes is None else self._check_nbytes(nbytes)
        self._open()
        off = self._slot_off(slot)
        torch.cuda.current_stream(self.device).synchronize()
        return self._heap[off : off + n].cpu()

    def get(self, peer: int, slot: int, nbytes: int, timeout: float) -> torch.Tensor:
        """As the protocol's; a GPU stream cannot be abandoned: ``timeout`` is checked, not
        enforced. The source rule is checked here, at the getter: NVSHMEM's symmetric heap
        is readable by every PE, so a PE that bypasses this engine reads any slot (the trust
        model: every PE is one job's)."""
        n = self._check_get(peer, slot, nbytes)
        off = self._slot_off(slot)
        self._deadline(timeout)
        self._open()
        if n == 0:
            return torch.empty(0, dtype=torch.uint8)
        # Lands in this PE's staging copy of the slot (symmetric), then leaves the device; the
        # staging region is the puts' too
        with self._put_lock:
            self._nv.get(
                self._sub(self._stage, off, n),
                self._sub(self._heap, off, n),
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
        _finalize_modules()
        for t in (self._heap, self._stage, self._sig):
            nv.free_tensor(t)
        nv.finalize()
