"""The device's memory ceilings, measured first so every kernel's GB/s can be read against them.

``python -m perf.bench_copy [--gib 4] [--ctas-per-sm 4] [--kernels read,read-tma,copy,torch]``
(``--quick``: 0.25 GiB) with the flags every benchmark takes (``--reps --warmup --out FILE |
--record --check``, :mod:`mqnc.measure.options`). Three measurements over one buffer of
``--gib`` GiB (4 GiB: 70x the H200's 60 MB L2, so no pass finds its data cached):

``bench="ceiling", variant="read"`` (backend ``triton``)
    :func:`_read_kernel`: a persistent grid (``SMs x --ctas-per-sm`` programs, each striding
    over the buffer's 32 KiB blocks) streams the buffer in with 16-byte loads (``.cg``: through
    L2 only; ptxas refuses ``.cg`` with an evict-first hint) and reduces it to one int32 per
    program: nothing is written back, so the bytes are the buffer's and the time is the read
    ceiling, the one a decode kernel (which reads its cache and writes little) is held
    against.
``bench="ceiling", variant="read-tma"`` (backend ``triton``)
    :func:`_read_tma_kernel`: the same read through TMA (a host-side tensor descriptor, 32 KiB
    boxes into shared memory, three in flight per program, SMs x 2 programs).
``bench="ceiling", variant="copy"`` (backend ``triton``)
    :func:`_copy_kernel`: the same grid and loads, each block stored to a second buffer
    (bytes: read plus written, METHOD.md's convention for a copy).
``bench="copy", variant="d2d"`` (backend ``torch``)
    ``dst.copy_(src)`` (``cudaMemcpyAsync``), read plus written; ``"host"`` on a CPU (memcpy).

Each record carries ``extra.tbps``, ``extra.spec_tbps`` and ``extra.pct_of_spec`` (the device's
HBM spec, :func:`mqnc.cost.ceilings.spec_tbps`: 4.8 TB/s on the H200, None for a device it does
not list), ``extra.pct_of_read`` (against this run's read ceiling) and ``extra.clocks``: the SM
and memory clocks (MHz; current and maximum) read before and after the timed calls through
``nvidia-smi --query-gpu`` (or pynvml when it is importable), or the reason none were read (no
GPU, neither tool). The read kernel's sum is checked against torch's (int32 words, mod 2**32:
exact whatever the order) and the copy against its source (bit for bit) on every run
(``extra.exact``); a mismatch fails the run (exit status 1). Timing is
``mqnc.measure.time_kernel``: CUDA-graph replays between events (``extra.timing``).

Off a GPU the Triton kernels run in the interpreter (when ``TRITON_INTERPRET=1``; otherwise they
are skipped and the run says so) over at most :data:`INTERPRETED_BYTES` of the buffer, so the
dry run checks their exactness and the records' form; their timings say nothing about a GPU.
Why a kernel and not ``copy_`` is the ceiling: ``copy_`` moved 2.71 TB/s on the H200 while the
splice kernel moved 3.0, so ``copy_`` is a floor of what the memory system gives a kernel, not a
ceiling (docs/roofline.md).
"""

from __future__ import annotations

import json
import shutil
import subprocess

import triton
import triton.language as tl

from mqnc.measure.options import (
    bench_parser,
    choice_list,
    finish,
    parse_bench_args,
    positive_float,
    positive_int,
)
from perf.speed_targets import TARGETS

BLOCK = 8192  # int32 words per program per step: 32 KiB, 32 words (8 x 16 B loads) a thread
NUM_WARPS = 8
CTAS_PER_SM = 4  # 4 x 32 KiB in flight per SM: the H200's ~4.8 TB/s x ~1 us latency over 132 SMs
INTERPRETED_BYTES = 1 << 18  # the interpreter's share of the buffer (it measures nothing)
KERNELS = ("read", "read-tma", "copy", "torch")
TMA_ROWS, TMA_COLS = 32, 256  # a 32 KiB box: 256 words (1 KiB) a row, the widest TMA box row
TMA_STAGES = 3  # boxes in flight per program (two 32 KiB buffers and the one being summed)
TMA_CTAS_PER_SM = 2  # 64 KiB of shared memory a program: two fit an SM with room to spare


@triton.jit
def _read_kernel(src, partial, n, BLOCK: tl.constexpr, EVEN: tl.constexpr):
    """Stream ``src`` (``n`` int32 words) in; program ``p`` writes the int32 sum (wrapping) of
    the blocks ``p, p + P, p + 2P, ...`` to ``partial[p]``."""
    pid = tl.program_id(0)
    step = tl.num_programs(0)
    offs = tl.arange(0, BLOCK)
    base = pid.to(tl.int64) * BLOCK  # (64-bit: a 4 GiB buffer is 2**30 words)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for _ in range(pid, tl.cdiv(n, BLOCK), step):
        idx = base + offs
        base += step * BLOCK
        if EVEN:
            x = tl.load(src + idx, cache_modifier=".cg")
        else:
            x = tl.load(src + idx, mask=idx < n, other=0, cache_modifier=".cg")
        acc += x
    tl.store(partial + pid, tl.sum(acc, axis=0))


@triton.jit
def _copy_kernel(src, dst, n, BLOCK: tl.constexpr, EVEN: tl.constexpr):
    """Copy ``src`` to ``dst`` (``n`` int32 words each), program ``p`` taking the blocks
    ``p, p + P, p + 2P, ...``."""
    pid = tl.program_id(0)
    step = tl.num_programs(0)
    offs = tl.arange(0, BLOCK)
    base = pid.to(tl.int64) * BLOCK
    for _ in range(pid, tl.cdiv(n, BLOCK), step):
        idx = base + offs
        base += step * BLOCK
        if EVEN:
            x = tl.load(src + idx, cache_modifier=".cg")
            tl.store(dst + idx, x, cache_modifier=".cs")
        else:
            mask = idx < n
            x = tl.load(src + idx, mask=mask, other=0, cache_modifier=".cg")
            tl.store(dst + idx, x, mask=mask, cache_modifier=".cs")


@triton.jit
def _read_tma_kernel(
    desc, partial, nrows, ROWS: tl.constexpr, COLS: tl.constexpr, STAGES: tl.constexpr
):
    """The read kernel through TMA: ``desc`` a host-side tensor descriptor of the buffer as
    ``[nrows, COLS]`` int32 words with ``[ROWS, COLS]`` boxes (32 KiB), program ``p`` loading
    boxes ``p, p + P, ...`` into shared memory (pipelined ``STAGES`` deep by the compiler,
    the rows past ``nrows`` zero-filled by the hardware) and summing them into
    ``partial[p]``."""
    pid = tl.program_id(0)
    acc = tl.zeros([ROWS, COLS], dtype=tl.int32)
    for b in tl.range(pid, tl.cdiv(nrows, ROWS), tl.num_programs(0), num_stages=STAGES):
        acc += desc.load([b * ROWS, 0])
    tl.store(partial + pid, tl.sum(tl.sum(acc, axis=1), axis=0))


def programs(sms: int, ctas_per_sm: int = CTAS_PER_SM) -> int:
    """The persistent grid: ``sms * ctas_per_sm`` programs."""
    return sms * ctas_per_sm


def read_launch(src, partial, *, block: int = BLOCK, num_warps: int = NUM_WARPS):
    """The read kernel's :class:`~mqnc.triton_kernels._core.launch.Launch` over ``src`` (int32
    words, contiguous) into ``partial`` (int32, one per program: its length is the grid)."""
    from mqnc.triton_kernels._core.launch import Launch

    n = src.numel()
    return Launch(
        "ceiling_read[int32]",
        _read_kernel,
        (partial.numel(),),
        (src, partial, n),
        dict(BLOCK=block, EVEN=n % block == 0, num_warps=num_warps),
    )


def read_tma_launch(src, partial, *, num_warps: int = NUM_WARPS):
    """The TMA read kernel's launch over ``src`` (int32 words, contiguous, a multiple of
    :data:`TMA_COLS` of them, 16-byte aligned) into ``partial`` (one int32 per program)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    from mqnc.triton_kernels._core.launch import Launch

    view = src.view(-1, TMA_COLS)
    desc = TensorDescriptor.from_tensor(view, [TMA_ROWS, TMA_COLS])
    return Launch(
        "ceiling_read_tma[int32]",
        _read_tma_kernel,
        (partial.numel(),),
        (desc, partial, view.shape[0]),
        dict(ROWS=TMA_ROWS, COLS=TMA_COLS, STAGES=TMA_STAGES, num_warps=num_warps),
    )


def copy_launch(src, dst, grid: int, *, block: int = BLOCK, num_warps: int = NUM_WARPS):
    """The copy kernel's launch: ``src`` to ``dst`` (int32 words, contiguous, one size) on
    ``grid`` programs."""
    from mqnc.triton_kernels._core.launch import Launch

    n = src.numel()
    return Launch(
        "ceiling_copy[int32]",
        _copy_kernel,
        (grid,),
        (src, dst, n),
        dict(BLOCK=block, EVEN=n % block == 0, num_warps=num_warps),
    )


def read_sum(partial) -> int:
    """The read kernel's result: its partial sums added, mod 2**32 (as torch's sum of the same
    int32 words, mod 2**32: integer addition in any order)."""
    import torch

    return int(partial.to(torch.int64).sum()) % 2**32


def clocks(device) -> dict:
    """The SM and memory clocks of CUDA ``device`` now (MHz: ``sm``, ``mem``, ``sm_max``,
    ``mem_max``, and ``via``), through pynvml when importable, else ``nvidia-smi``; or
    ``{"unavailable": why}`` (a CPU, or neither tool)."""
    if device.type != "cuda":
        return {"unavailable": "no GPU (the kernels ran on the CPU)"}
    index = device.index or 0
    try:
        import pynvml

        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(index)
        kinds = (pynvml.NVML_CLOCK_SM, pynvml.NVML_CLOCK_MEM)
        cur = [pynvml.nvmlDeviceGetClockInfo(h, k) for k in kinds]
        top = [pynvml.nvmlDeviceGetMaxClockInfo(h, k) for k in kinds]
        return dict(sm=cur[0], mem=cur[1], sm_max=top[0], mem_max=top[1], via="pynvml")
    except Exception:  # noqa: BLE001 - absent or failing: nvidia-smi next
        pass
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return {"unavailable": "neither pynvml nor nvidia-smi on this machine"}
    q = "clocks.sm,clocks.mem,clocks.max.sm,clocks.max.mem"
    try:
        r = subprocess.run(
            [smi, f"--id={index}", f"--query-gpu={q}", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        vals = [int(float(v)) for v in r.stdout.strip().split(",")]
        return dict(sm=vals[0], mem=vals[1], sm_max=vals[2], mem_max=vals[3], via="nvidia-smi")
    except Exception as exc:  # noqa: BLE001 - recorded, never fatal
        return {"unavailable": f"nvidia-smi failed: {exc!r}"[:200]}


def _extra(tbps: float, spec, read_tbps, timing: dict, clock: dict, **more) -> dict:
    pct = None if spec is None else round(100 * tbps / spec, 1)
    of_read = None if not read_tbps else round(100 * tbps / read_tbps, 1)
    return dict(
        tbps=tbps,
        spec_tbps=spec,
        pct_of_spec=pct,
        read_tbps=read_tbps,
        pct_of_read=of_read,
        clocks=clock,
        timing=timing,
        **more,
    )


def _kernels_runnable(dev: str) -> str | None:
    """Why the Triton kernels cannot run here (None: they can)."""
    from mqnc.base.env import interpreting

    if dev == "cuda" or interpreting():
        return None
    return "the Triton ceiling kernels need a GPU or TRITON_INTERPRET=1: skipped"


def _ceiling(args, kind: str, src, dst, dev, read_tbps):
    """Time one ceiling kernel (``kind``: ``read`` or ``copy``), check it exact; its record."""
    import torch

    from mqnc.base.runtime import device_name
    from mqnc.cost.ceilings import spec_tbps
    from mqnc.measure import record, time_kernel

    grid = programs(args.sms, args.ctas_per_sm)
    if kind == "read":
        partial = torch.empty(grid, dtype=torch.int32, device=dev)
        launch, nbytes = read_launch(src, partial), src.numel() * 4
    elif kind == "read-tma":
        grid = programs(args.sms, TMA_CTAS_PER_SM)
        partial = torch.empty(grid, dtype=torch.int32, device=dev)
        src = src[: src.numel() // TMA_COLS * TMA_COLS]
        launch, nbytes = read_tma_launch(src, partial), src.numel() * 4
    else:
        launch, nbytes = copy_launch(src, dst, grid), 2 * src.numel() * 4
    before = clocks(src.device)
    t = time_kernel([launch], working_set_bytes=nbytes, warmup=args.warmup, reps=args.reps)
    clock = {"before": before, "after": clocks(src.device)}
    if kind != "copy":
        want = int(src.to(torch.int64).sum()) % 2**32 if dev != "cuda" else _gpu_sum(src)
        exact = read_sum(partial) == want
    else:
        exact = bool(torch.equal(dst, src))
    tbps = nbytes / (t.p50 * 1e-6) / 1e12
    extra = _extra(
        tbps,
        spec_tbps(device_name()),
        read_tbps,
        t.how,
        clock,
        exact=exact,
        programs=grid,
        ctas_per_sm=TMA_CTAS_PER_SM if kind == "read-tma" else args.ctas_per_sm,
        block_words=TMA_ROWS * TMA_COLS if kind == "read-tma" else BLOCK,
        num_warps=NUM_WARPS,
        interpreted=dev != "cuda",
    )
    rec = record(
        "ceiling",
        kind,
        nbytes,
        t.percentiles,
        x_name="bytes",
        nbytes=nbytes,
        backend="triton",
        path=args.out,
        extra=extra,
    )
    print(f"{kind} ceiling (Triton, {grid} programs): {tbps * 1e3:.0f} GB/s, exact {exact}")
    return rec


def _gpu_sum(src) -> int:
    """torch's sum of ``src``'s int32 words mod 2**32, in 64-bit chunks (no 8 GiB int64 copy)."""
    import torch

    total, step = 0, 1 << 26
    for i in range(0, src.numel(), step):
        total += int(src[i : i + step].to(torch.int64).sum())
    return total % 2**32


def main(argv=None) -> int:
    ap = bench_parser(__doc__, reps=20)
    ap.add_argument("--gib", type=positive_float, default=None, help="buffer GiB (4; --quick 0.25)")
    ap.add_argument(
        "--ctas-per-sm",
        type=positive_int,
        default=CTAS_PER_SM,
        help=f"programs per SM of the Triton kernels' grid ({CTAS_PER_SM})",
    )
    ap.add_argument(
        "--kernels",
        type=choice_list(KERNELS),
        default=list(KERNELS),
        help="what to measure: read, read-tma, copy (the Triton kernels), torch (copy_)",
    )
    args = parse_bench_args(ap, argv)
    args.gib = args.gib or (0.25 if args.quick else 4.0)
    import torch

    from mqnc.base.runtime import device_name
    from mqnc.cost.ceilings import spec_tbps
    from mqnc.measure import record, time_kernel

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    n = int(args.gib * 2**30) // 4  # int32 words
    gen = torch.Generator(device=dev).manual_seed(0)
    src = torch.randint(-(2**31), 2**31 - 1, (n,), dtype=torch.int32, device=dev, generator=gen)
    dst = torch.empty_like(src)
    args.sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev == "cuda" else 2
    read_tbps, failed = None, False
    why = _kernels_runnable(dev)
    for kind in ("read", "read-tma", "copy"):
        if kind not in args.kernels:
            continue
        if why:
            print(why)
            break
        small = n if dev == "cuda" else min(n, INTERPRETED_BYTES // 4)
        rec = _ceiling(args, kind, src[:small], dst[:small], dev, read_tbps)
        failed |= not rec["extra"]["exact"]
        if kind.startswith("read") and dev == "cuda":  # (an interpreted time is no ceiling)
            read_tbps = max(read_tbps or 0.0, rec["extra"]["tbps"])
    if "torch" in args.kernels:
        nbytes = 2 * src.numel() * src.element_size()
        before = clocks(src.device)
        t = time_kernel(
            [lambda: dst.copy_(src)], working_set_bytes=nbytes, warmup=args.warmup, reps=args.reps
        )
        tbps = nbytes / (t.p50 * 1e-6) / 1e12
        clock = {"before": before, "after": clocks(src.device)}
        extra = _extra(tbps, spec_tbps(device_name()), read_tbps, t.how, clock)
        rec = record(
            "copy",
            "d2d" if dev == "cuda" else "host",
            nbytes,
            t.percentiles,
            x_name="bytes",
            nbytes=nbytes,
            backend="torch",
            path=args.out,
            extra=extra,
        )
        print(
            f"copy_ (torch): {rec['gbps']:.0f} GB/s (read + write, {args.gib} GiB, "
            f"p50 {t.p50:.0f} us); clocks {json.dumps(clock)}"
        )
    if failed:
        print("MISMATCH: a ceiling kernel's result is not exact")
        return 1
    return finish(args, TARGETS)


if __name__ == "__main__":
    raise SystemExit(main())
