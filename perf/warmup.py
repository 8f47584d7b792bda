"""Compile every production kernel variant into Triton's cache before anything is timed.

``python -m perf.warmup [--jobs 16] [--ops mla_decode,mla_sparse,merge,splice,rotate,nvshmem]``
(``--ops route``: the device route's kernels instead, ``perf/gpu_route.sh``'s first step)

The first step of ``perf/gpu_check.sh`` after the copy ceiling: a cold cache would otherwise
put compiles (0.2-3 s per variant, ~10 s for an NVSHMEM kernel linking the device bitcode) into
the first timed call of every benchmark and test. Two phases:

1. **parallel**: every variant the goal shapes launch (``sm90.variants.production_variants``, once
   each, planned as on a CPU) and the NVSHMEM engine's put and wait kernels (when the device
   bitcode is found) or, with ``route``, the device route's own kernels at 16 and 128 heads
   (``mqnc.transport.device_route.device_route_launches``: the resident holder kernels, bf16
   and FP8, the put, wait and merge, the pass's take, gather and reply), compiled by
   ``--jobs`` processes sharing the on-disk cache
   (``~/.triton/cache``). On a GPU each is the JIT's own ``kernel.warmup`` on device tensors;
   without one (the dry run) ``sm90.compile.compile_launch`` for sm_90, which builds the same cache
   entry (same source, specialisation, options and target).
2. **verify** (GPU only): every goal shape planned at the live occupancy
   (``shape_launches(shape, device="cuda")``) and each launch warmed up in this process; a
   variant the CPU planning did not foresee is compiled here and counted (``new``).

Prints one line per variant (seconds, ok) and a summary; exits 1 if a variant failed.
Runs in compiled mode, ``TRITON_INTERPRET=0``, which it sets itself when the variable is unset (on
a CPU-only torch importing the kernels would otherwise choose the interpreter);
``TRITON_INTERPRET=1`` is refused.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import multiprocessing
import os
import sys
import time

DEFAULT_OPS = ("mla_decode", "mla_sparse", "merge", "splice", "rotate", "nvshmem")
OPS = DEFAULT_OPS + ("route",)
_CACHE: dict = {}


def _op(name: str) -> str:
    if name.startswith("nvshmem:"):
        return "nvshmem"
    if name.startswith("route:"):
        return "route"
    return name.split("[", 1)[0]


def _launches() -> dict[str, tuple]:
    """``{variant name: (kernel, args, kwargs, grid)}``, built once per process."""
    if not _CACHE:
        from mqnc.triton_kernels.sm90.variants import production_variants
        from mqnc.triton_kernels.sm90.variants import shape_launches as _  # noqa: F401 - warm import

        for v in production_variants():
            ln = v.launch
            _CACHE[v.name] = (ln.kernel, ln.args, ln.kwargs, ln.grid)
        try:
            from mqnc.transport.nvshmem import device_kernel_launches, device_library_path

            launches = device_kernel_launches(device_library_path())
            for name in ("put_signal_block", "poll"):  # what the engine launches
                _CACHE[f"nvshmem:{name}"] = launches[name]
        except Exception:  # noqa: BLE001 - no NVSHMEM bitcode here: nothing of it to warm
            pass
        from mqnc.transport.device_route import device_route_launches

        for heads in (16, 128):
            for fp8 in (False, True):
                for name, ln in device_route_launches(heads, fp8=fp8).items():
                    _CACHE[f"route:{name},H={heads}"] = (ln.kernel, ln.args, ln.kwargs, ln.grid)
    return _CACHE


def _compile_one(name: str) -> tuple[str, float, str | None]:
    """Compile one variant into the cache (a worker process): ``(name, seconds, error)``."""
    t0 = time.perf_counter()
    try:
        import torch

        kernel, args, kwargs, grid = _launches()[name]
        if torch.cuda.is_available():
            args = tuple(a.to("cuda") if isinstance(a, torch.Tensor) else a for a in args)
            kernel.warmup(*args, grid=grid, **kwargs)
        else:
            from mqnc.triton_kernels.sm90.compile import compile_launch

            compile_launch(kernel, args, kwargs, grid=grid, arch=90)
        return name, time.perf_counter() - t0, None
    except Exception as exc:  # noqa: BLE001 - reported per variant, the others go on
        return name, time.perf_counter() - t0, f"{type(exc).__name__}: {str(exc)[:300]}"


def _cache_entries() -> int:
    from triton import knobs

    d = knobs.cache.dir
    return len(os.listdir(d)) if d and os.path.isdir(d) else 0


def _verify() -> tuple[int, float]:
    """Plan every goal shape at the live occupancy and warm each launch up here: returns
    (new cache entries, seconds); 0 new means phase 1 compiled everything the shapes launch."""
    from mqnc.triton_kernels.sm90.variants import GOALS, shape_launches

    before, t0 = _cache_entries(), time.perf_counter()
    for shape in GOALS:
        for ln in shape_launches(shape, device="cuda"):
            ln.kernel.warmup(*ln.args, grid=ln.grid, **ln.kwargs)
    return _cache_entries() - before, time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compile processes")
    ap.add_argument("--ops", default=",".join(DEFAULT_OPS),
                    help=f"comma list out of {', '.join(OPS)} (default: not route)")  # fmt: skip
    args = ap.parse_args(argv)
    from mqnc.base.runtime import use_compiled_kernels

    if not use_compiled_kernels():
        sys.exit("perf.warmup: set TRITON_INTERPRET=0 (it compiles kernels, never launches here)")
    ops = {o.strip() for o in args.ops.split(",") if o.strip()}
    if not ops or ops - set(OPS):
        raise ValueError(f"--ops: expected names out of {OPS}, got {args.ops!r}")
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    t0 = time.perf_counter()
    names = [n for n in _launches() if _op(n) in ops]
    # the slowest first: NVSHMEM (bitcode link), then attention, then the small kernels
    names.sort(key=lambda n: (not n.startswith("nvshmem"), not n.startswith("mla")))
    ctx = multiprocessing.get_context("spawn")
    failed = 0
    with concurrent.futures.ProcessPoolExecutor(max(1, args.jobs), mp_context=ctx) as pool:
        for name, secs, err in pool.map(_compile_one, names):
            failed += err is not None
            print(f"{secs:6.1f} s  {'ok    ' if err is None else 'FAILED'}  {name}  {err or ''}")
    wall = time.perf_counter() - t0
    print(f"warmup: {len(names)} variants, {failed} failed, {wall:.1f} s on {args.jobs} jobs")
    import torch

    if torch.cuda.is_available() and ops & {"mla_decode", "mla_sparse", "merge", "splice"}:
        new, secs = _verify()
        print(
            f"warmup verify: every goal shape planned on the GPU, {new} new compiles, {secs:.1f} s"
        )
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
