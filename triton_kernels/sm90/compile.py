"""Compile kernels for a real GPU target without a GPU, exactly as a launch compiles them.

The interpreter accepts code the GPU compiler rejects, and Triton compiles a *specialised*
variant at launch: a pointer or int argument divisible by 16 gets ``tt.divisibility = 16``
(which decides, e.g., 16-byte ``cp.async`` versus scalar 2-byte loads), an int equal to 1
becomes a constexpr. A compile test that writes the signature by hand checks a variant that
never runs. So this module compiles through Triton's own launch path: :func:`compile_launch`
calls ``JITFunction.warmup`` (the launch path without the launch) under a stand-in driver that
reports an sm_90 target and no device, so the JIT's own binder derives the signature, constexprs
and attributes from the real argument values, and ``triton.compile`` builds PTX and a cubin.
Works with triton 3.6.0 and 3.9.0 (both have ``driver.set_active``, ``warmup`` and the
``get_current_target/device/stream`` driver interface used by ``JITFunction.run``).

Resources are read from the cubin with the ``cuobjdump`` that Triton's wheel ships
(``-res-usage``: registers, stack, local memory = spills; ``-sass``: the instruction mix) and
from the compile metadata (shared memory, warps); :func:`ttgir_summary` reads the shared-memory
buffers and waits of the software pipeline from the TTGIR.

Any ``@triton.jit`` function can be compiled this way at given launch values
(``compile_launch(fn, args, kwargs)``; NVSHMEM kernels pass ``extern_libs`` in ``kwargs``).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import re
import subprocess
import tempfile
from typing import Any

import triton
from triton.backends.compiler import GPUTarget

from mqnc.base.env import interpreting

__all__ = [
    "KernelResources",
    "compile_launch",
    "compile_variant",
    "resources",
    "sass_mix",
    "mma_macs",
    "wgmma_waits",
    "mla_evidence",
    "ttgir_summary",
    "cuobjdump_path",
    "compile_all",
    "write_table",
]

H200_SMS = 132


class _CompileOnlyDriver:
    """The part of Triton's driver interface that ``JITFunction.run(warmup=True)`` uses: a
    target, a device index and a stream. Nothing here touches a GPU. The device index is
    ``-arch``, no real device's: the JIT keys its per-device binder and kernel cache by it, so
    compile-only entries never mix with a real GPU's in the same process."""

    def __init__(self, target: GPUTarget):
        self.target = target

    def get_current_target(self) -> GPUTarget:
        return self.target

    def get_current_device(self) -> int:
        return -int(self.target.arch)

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def is_active(self) -> bool:
        return True


@contextlib.contextmanager
def _compile_only(arch: int):
    from triton.runtime.driver import driver

    saved = driver._active  # restored as it was (None on a CPU machine, never re-created)
    driver.set_active(_CompileOnlyDriver(GPUTarget("cuda", arch, 32)))
    try:
        yield
    finally:
        driver._active = saved


def compile_launch(fn, args: tuple, kwargs: dict, *, grid: tuple = (1,), arch: int = 90):
    """Compile ``fn[grid](*args, **kwargs)`` for ``sm_<arch>`` as that launch would compile it.

    ``fn`` is a ``@triton.jit`` function (not an interpreted one: call this with
    ``TRITON_INTERPRET=0``, which a CPU-only torch needs: importing the kernels there chooses
    the interpreter otherwise), ``args`` the launch's positional values (torch tensors on any
    device: only their dtype and ``data_ptr`` alignment matter), ``kwargs`` its constexprs and
    options (``num_warps``, ``num_stages``, ``extern_libs``, ...). Returns Triton's
    ``CompiledKernel`` (``.asm['ttgir' | 'ptx' | 'cubin']``, ``.metadata``), never loaded.
    """
    if not hasattr(fn, "warmup") or type(fn).__name__ != "JITFunction":
        raise TypeError(
            f"fn: expected a compiled-mode @triton.jit function (TRITON_INTERPRET=0), got "
            f"{type(fn).__name__}"
        )
    with _compile_only(arch):
        return fn.warmup(*args, grid=grid, **kwargs)


@dataclasses.dataclass(frozen=True)
class KernelResources:
    """What the compiled variant of one launch uses, per CTA (registers per thread)."""

    name: str
    registers: int
    stack: int
    local: int
    shared: int
    num_warps: int
    sass: dict
    ttgir: dict
    mma_macs: int = 0
    wgmma_waits: tuple[int, ...] = ()
    triton: str = triton.__version__

    @property
    def spills(self) -> bool:
        return self.local > 0 or self.stack > 0

    @property
    def mma(self) -> tuple[str, ...]:
        return tuple(k for k in ("HGMMA", "HMMA", "IMMA") if self.sass.get(k, 0))


def cuobjdump_path() -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def _cuobjdump(cubin: bytes, flag: str) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        return subprocess.run(
            [cuobjdump_path(), flag, path], capture_output=True, text=True, check=True
        ).stdout


def _sass(compiled) -> str:
    """``cuobjdump -sass`` of a ``CompiledKernel``'s cubin, kept beside the cubin in Triton's
    cache (the same key: the same source, options, target and Triton, hence the same cubin and
    the same wheel's ``cuobjdump``), so that a kernel Triton found in its cache is not
    disassembled again (~0.2-0.5 s each). The entry starts with the cubin's SHA-256 and is
    used only when that matches; without a cache key it is disassembled every time."""
    import hashlib

    cubin = compiled.asm["cubin"]
    key = getattr(compiled, "hash", None)
    if not key:
        return _cuobjdump(cubin, "-sass")
    from triton.runtime.cache import get_cache_manager

    digest = hashlib.sha256(cubin).hexdigest()
    cache = get_cache_manager(key)
    path = cache.get_file("mqnc-cuobjdump.sass")
    if path is not None:
        with open(path) as f:
            head, _, sass = f.read().partition("\n")
        if head == digest:
            return sass
    sass = _cuobjdump(cubin, "-sass")
    cache.put(f"{digest}\n{sass}", "mqnc-cuobjdump.sass", binary=False)
    return sass


# Global loads and stores by width: LDG.E.128 / LDG.E.64 / LDG.E (32) / LDG.E.U16 / LDG.E.U8 ...
_WIDTH = {"128": 128, "64": 64, "U16": 16, "S16": 16, "U8": 8, "S8": 8}


def _width(mods: list[str]) -> int:
    for m in mods:
        if m in _WIDTH:
            return _WIDTH[m]
    return 32


def sass_mix(sass: str) -> dict:
    """Static counts of the instructions that decide a memory-bound kernel's speed.

    ``LDG.<bits>`` global loads by width, ``LDGSTS.<bits>`` asynchronous global-to-shared
    copies (``cp.async``), ``UTMALDG`` TMA loads, ``STG.<bits>`` global stores, ``LDS`` /
    ``STS`` shared-memory traffic, ``HGMMA`` (Hopper warpgroup MMA), ``HMMA`` (mma.sync),
    ``BAR``/``DEPBAR`` waits. Counted once per instruction in the program text (a loop body
    counts once).
    """
    counts: collections.Counter = collections.Counter()
    for line in sass.splitlines():
        m = re.search(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", line)
        if m is None:
            continue
        op, *mods = m.group(1).split(".")
        if op in ("LDG", "STG", "LDGSTS"):
            counts[f"{op}.{_width(mods)}"] += 1
        elif op in ("UTMALDG", "UTMASTG", "HGMMA", "HMMA", "IMMA", "LDS", "STS", "LDSM"):
            counts[op] += 1
        elif op in ("DEPBAR", "BAR", "SYNCS", "WARPGROUP"):
            counts[op] += 1
    return dict(sorted(counts.items()))


# Multiply-accumulates of one tensor-core instruction, by its shape suffix, and who issues it:
# HGMMA.64xNxK (wgmma) is issued by a warpgroup (4 warps), HMMA.MNK (mma.sync) by a warp.
_HMMA_SHAPES = {"16816": 16 * 8 * 16, "1688": 16 * 8 * 8, "884": 8 * 8 * 4}


def _at_word_start(pattern: str, text: str) -> list[tuple[str, ...]]:
    """The groups of every match of ``pattern`` that starts a word (``re.findall`` of
    ``\\b`` + ``pattern``, as tuples): a pattern that begins with ``\\b`` is tried at every
    position of the text, one that begins with a literal is searched for (~50x faster over the
    megabytes of SASS a kernel linked with NVSHMEM has)."""
    return [
        m.groups()
        for m in re.finditer(pattern, text)
        if m.start() == 0 or not re.match(r"\w", text[m.start() - 1])
    ]


def mma_macs(sass: str, num_warps: int) -> int:
    """Multiply-accumulates the tensor-core instructions of the program text issue per CTA on
    one pass (a loop body counts once): each ``HGMMA.64xNxK`` is ``64 N K`` per warpgroup
    (``num_warps / 4`` of them run the same text), each ``HMMA.16816`` ``16 8 16`` per warp."""
    if not isinstance(num_warps, int) or num_warps < 1:
        raise ValueError(f"num_warps: expected a positive int, got {num_warps!r}")
    total = 0
    for m, n, k in _at_word_start(r"HGMMA\.(\d+)x(\d+)x(\d+)\.", sass):
        total += int(m) * int(n) * int(k) * max(1, num_warps // 4)
    for (shape,) in _at_word_start(r"HMMA\.(\d+)\.", sass):
        if shape not in _HMMA_SHAPES:
            raise ValueError(f"sass: HMMA.{shape} is not a shape this count knows")
        total += _HMMA_SHAPES[shape] * num_warps
    return total


def wgmma_waits(sass: str) -> tuple[int, ...]:
    """The ``WARPGROUP.DEPBAR.LE gsb0, N`` waits of the SASS, in program order: ``N`` wgmma
    groups may stay in flight past each (0: the warpgroup waits for every one it issued)."""
    return tuple(
        int(n, 16) for n in re.findall(r"WARPGROUP\.DEPBAR\.LE\s+gsb0,\s*(0x[0-9a-f]+)", sass)
    )


def tile_bodies(kwargs: dict) -> int:
    """Copies of the tile's code in an MLA attention kernel's program text: 2 for the
    restructured kernels (launches with a ``RING`` constexpr: the unmasked loop body and the
    masked tail, of which each tile runs one), else 1."""
    return 2 if "RING" in kwargs else 1


def mla_evidence(
    res: KernelResources, block_h: int, block_n: int, d_qk: int, d_v: int, bodies: int = 1
) -> dict:
    """Static evidence of an MLA attention variant's schedule, per CTA and per 64 cache entries.

    The ideal tile does ``block_h x block_n x d_qk`` multiply-accumulates for ``QK^T`` and
    ``block_h x block_n x d_v`` for ``PV``, once each. Counted in ``HGMMA.64xNx16`` units (the
    fewest wgmma instructions that do it: ``N = block_n`` for ``QK^T``, ``block_h / 64 x d_qk /
    16`` of them; ``N = 256`` for ``PV``, ``block_h / 64 x d_v / 256 x block_n / 16``), scaled
    to 64 entries, that is ``mma_ideal_per_64`` (in ``HMMA.16816`` units for an mma.sync
    kernel). ``mma_per_64`` is the instructions the SASS
    issues per CTA per 64 entries (HGMMA, else HMMA: a loop body's static count, times the
    warpgroups or warps that run it, times ``64 / block_n``); ``redundancy`` is the issued
    multiply-accumulates (:func:`mma_macs`, every instruction at its own shape) over the ideal:
    1.0 when no warp recomputes another's ``QK^T``, None without tensor-core instructions.
    ``wgmma_waits`` is ``"in flight/total"``: the ``WARPGROUP.DEPBAR`` waits that leave wgmma
    groups pending (TTGIR ``warp_group_dot_wait {pendings > 0}``) over all of them; ``tma``
    the TMA loads (``UTMALDG`` in the SASS, plus TTGIR's TMA copies); ``cta_per_sm`` at sm_90's
    limits (``_core.grid.Occupancy``). ``bodies``: copies of the tile's code in the program text
    (:func:`tile_bodies`; each tile runs one), by which the static counts are divided.
    ``ring``: KV tiles in the shared-memory ring (:func:`ring_depth`); ``read_chain``: the
    longest chain of dependent global reads (:func:`read_chain`: 3 = length, page id, tile)."""
    from mqnc.triton_kernels._core.grid import SM90, Occupancy

    per = 64 / block_n
    kind = "HGMMA" if res.sass.get("HGMMA") else "HMMA"
    issuers = max(1, res.num_warps // 4) if kind == "HGMMA" else res.num_warps
    ideal_macs = block_h * block_n * (d_qk + d_v)
    ideal = (block_h / 64) * (d_qk / 16 + (d_v / 256) * (block_n / 16))
    if kind == "HMMA":  # an mma.sync kernel: in HMMA.16816 units
        ideal = ideal_macs / _HMMA_SHAPES["16816"]
    waits = res.wgmma_waits
    return {
        "mma": kind if res.sass.get(kind) else None,
        "mma_per_64": round(res.sass.get(kind, 0) * issuers * per / bodies, 1),
        "mma_ideal_per_64": round(ideal * per, 1),
        "redundancy": round(res.mma_macs / bodies / ideal_macs, 3) if res.mma_macs else None,
        "wgmma_waits": f"{sum(1 for n in waits if n > 0)}/{len(waits)}",
        "tma": res.sass.get("UTMALDG", 0) + res.ttgir.get("tma_copies", 0),
        "cta_per_sm": Occupancy(res.registers, 32 * res.num_warps, res.shared).ctas_per_sm(SM90),
        "ring": ring_depth(res.ttgir.get("local_alloc", []), block_n, d_v),
        "read_chain": res.ttgir.get("read_chain"),
        "registers": res.registers,
        "shared": res.shared,
        "spill": res.stack + res.local,
    }


# Global reads in the TTGIR: plain loads, cp.async copies, TMA copies and descriptor loads.
_READS = (
    "tt.load",
    "ttg.async_copy_global_to_local",
    "ttng.async_tma_copy_global_to_local",
    "ttng.async_tma_gather",
    "tt.descriptor_load",
    "tt.descriptor_gather",
)
_SSA_DEF = re.compile(r"^\s*((?:%[\w.$-]+(?::\d+)?\s*,\s*)*%[\w.$-]+(?::\d+)?)\s*=\s*([\w.]+)(.*)$")
_SSA_USE = re.compile(r"%([\w.$-]+)")


def read_chain(ttgir: str) -> int:
    """The longest chain of DEPENDENT global reads in a kernel's TTGIR: reads (``tt.load``,
    ``cp.async`` and TMA copies, descriptor loads) each of whose address, coordinates or mask
    is computed from the value the one before it read. Counted on the SSA def-use graph in
    program order: a value's depth is the largest of its operands' (a copy's result token
    carries its read into the ``async_wait`` and ``local_load`` that use it), plus one at each
    read; control flow is not followed (a region's block arguments, a loop's iter_args, start
    at 0), so in a software-pipelined loop the count is the prologue's, the first tile's
    chain: e.g. the dense kernel's row length, then its page ids, then the KV tile: 3; the
    sparse kernel's indices then the tile: 2 (its top-k is an argument); a kernel without
    indirection: 1."""
    depth: dict[str, int] = {}
    best = 0
    for line in ttgir.splitlines():
        m = _SSA_DEF.match(line)
        if m is None:
            continue
        names, op, rest = m.groups()
        rest = rest.split(" loc(")[0]
        d = max((depth.get(u, 0) for u in _SSA_USE.findall(rest)), default=0)
        if op in _READS:
            d += 1
            best = max(best, d)
        for name in re.findall(r"%([\w.$-]+)", names):
            depth[name] = d
    return best


def ring_depth(local_alloc: list[str], block_n: int, d_v: int) -> int:
    """Buffers in the KV ring: the leading dimension of the ``<n>x<block_n>x<d_v>x<dtype>``
    shared-memory allocation among ``local_alloc`` (:func:`ttgir_summary`'s; 1 where the tile
    is allocated once, 0 where none is)."""
    ring = 0
    for a in local_alloc:
        dims = a.split("x")
        if len(dims) == 4 and dims[1:3] == [str(block_n), str(d_v)]:
            ring = max(ring, int(dims[0]))
        elif len(dims) == 3 and dims[:2] == [str(block_n), str(d_v)]:
            ring = max(ring, 1)
    return ring


def ttgir_summary(ttgir: str) -> dict:
    """The software pipeline as the TTGIR shows it.

    ``local_alloc`` lists the shared-memory buffers (``<stages>x<shape>x<dtype>`` as allocated:
    a leading stage dimension means a multi-buffered ring), ``async_copies`` counts
    ``cp.async``-style copies into them, ``tma_copies`` TMA copies, ``async_waits`` the
    ``num`` operand of each ``async_wait`` (how many copy groups may stay in flight: 0 means the
    loop waits for the tile it just issued, i.e. no overlap), ``barrier_waits`` the mbarrier
    waits (TMA pipelines), ``wgmma`` Hopper warpgroup dots.
    """
    allocs = re.findall(
        r"ttg\.local_alloc\s*(?:%\S+\s*)?:\s*\([^)]*\)\s*->\s*!ttg\.memdesc<([^,>]+)", ttgir
    )
    allocs += re.findall(r"ttg\.local_alloc\s*:\s*\(\)\s*->\s*!ttg\.memdesc<([^,>]+)", ttgir)
    return {
        "local_alloc": sorted(set(a.strip() for a in allocs)),
        "async_copies": len(re.findall(r"ttg\.async_copy_global_to_local", ttgir)),
        "tma_copies": len(re.findall(r"async_tma_copy_global_to_local|async_tma_gather", ttgir)),
        "async_waits": [int(n) for n in re.findall(r"ttg\.async_wait[^{]*\{num = (\d+)", ttgir)],
        "barrier_waits": len(re.findall(r"ttng\.wait_barrier", ttgir)),
        "wgmma": len(re.findall(r"ttng\.warp_group_dot\b", ttgir)),
        "wgmma_pendings": [
            int(n) for n in re.findall(r"ttng\.warp_group_dot_wait[^{]*\{pendings = (\d+)", ttgir)
        ],
        "read_chain": read_chain(ttgir),
    }


def resources(name: str, compiled) -> KernelResources:
    """Registers, stack, local memory (spills), shared memory, SASS mix and TTGIR pipeline of
    one ``CompiledKernel``."""
    cubin = compiled.asm["cubin"]
    usage = _cuobjdump(cubin, "-res-usage")

    def field(key: str) -> int:
        m = re.search(rf"\b{key}:(\d+)", usage)
        if m is None:
            raise RuntimeError(f"cuobjdump -res-usage gave no {key} for {name}:\n{usage}")
        return int(m.group(1))

    sass = _sass(compiled)
    num_warps = int(compiled.metadata.num_warps)
    return KernelResources(
        name=name,
        registers=field("REG"),
        stack=field("STACK"),
        local=field("LOCAL"),
        shared=int(compiled.metadata.shared),
        num_warps=num_warps,
        sass=sass_mix(sass),
        ttgir=ttgir_summary(compiled.asm["ttgir"]),
        mma_macs=mma_macs(sass, num_warps),
        wgmma_waits=wgmma_waits(sass),
    )


def compile_variant(name: str, launch, arch: int = 90) -> tuple[KernelResources, Any]:
    """Compile a planned :class:`~mqnc.triton_kernels._core.launch.Launch` for ``sm_<arch>``;
    returns its resources and Triton's ``CompiledKernel``."""
    compiled = compile_launch(
        launch.kernel, launch.args, launch.kwargs, grid=launch.grid, arch=arch
    )
    return resources(name, compiled), compiled


def compile_all(arch: int = 90) -> list[dict]:
    """Compile every launch of every goal and ecosystem shape (``sm90.variants.COMPILED``) for
    ``sm_<arch>``; one dict per variant (by name, first-seen order) with its resources, its goal
    shapes, an MLA attention variant's ``evidence`` (:func:`mla_evidence`), and ``kernels``: how
    many distinct compiled kernels its shapes' launches got from the JIT (1: the name identifies
    the variant; the later launches of a name are JIT cache hits).

    Must run in compiled mode, ``TRITON_INTERPRET=0`` (under the interpreter ``@triton.jit`` yields
    interpreted functions that cannot be compiled); the test suite calls it in a subprocess.
    A variant that fails to compile is reported with its error instead of raising.
    """
    from mqnc.triton_kernels.sm90.variants import COMPILED, D_QK, D_V, shape_launches

    out: dict[str, dict] = {}
    kernels: dict[str, set] = {}
    for shape in COMPILED:
        for launch in shape_launches(shape):
            row = out.setdefault(launch.name, {"name": launch.name, "shapes": []})
            row["shapes"].append(shape.label)
            if row.get("ok") is False:
                continue
            try:
                compiled = compile_launch(
                    launch.kernel, launch.args, launch.kwargs, grid=launch.grid, arch=arch
                )
                if "ok" not in row:
                    res = resources(launch.name, compiled)
                    row.update({"ok": True, **dataclasses.asdict(res), "grid": launch.grid})
                    if launch.name.startswith("mla_"):
                        kw = launch.kwargs
                        ev = mla_evidence(
                            res, kw["BLOCK_H"], kw["BLOCK_N"], D_QK, D_V, tile_bodies(kw)
                        )
                        row["evidence"] = ev
            except Exception as exc:  # noqa: BLE001 - reported to the caller: the test fails
                row.update({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
                continue
            kernels.setdefault(launch.name, set()).add(id(compiled))
    for name, row in out.items():
        row["kernels"] = len(kernels.get(name, ()))
    return list(out.values())


def write_table(rows: list[dict], path: str) -> None:
    """Write the sm_90 occupancy table (``sm90.table.py``) from :func:`compile_all` rows."""
    lines = [
        '"""Generated by ``python -m mqnc.triton_kernels.sm90.compile --write-table``',
        "(do not edit): the sm_90 resources of every production kernel variant, compiled",
        "launch-exact (see ``sm90.compile``). Read off a GPU by ``_core.grid.kernel_occupancy``;",
        'the compile test checks it against a fresh compile under the triton that wrote it."""',
        "",
        f'TRITON = "{triton.__version__}"',
        "SM90_VARIANTS: dict[str, dict] = {",
    ]
    for row in rows:
        if not row.get("ok"):
            raise RuntimeError(f"{row['name']} did not compile: {row.get('error')}")
        lines.append(f'    "{row["name"]}": {{')
        for key in ("registers", "num_warps", "shared", "stack", "local"):
            lines.append(f'        "{key}": {row[key]},')
        lines.append("    },")
    lines.append("}")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    import argparse
    import json
    import sys

    ap = argparse.ArgumentParser(description="Compile every production variant for sm_<arch>.")
    ap.add_argument("arch", nargs="?", type=int, default=90)
    ap.add_argument("--write-table", action="store_true", help="rewrite _sm90_table.py")
    args = ap.parse_args()
    if interpreting():
        sys.exit(
            "set TRITON_INTERPRET=0 to compile for a GPU target (compile-only: nothing launches)"
        )
    rows = compile_all(args.arch)
    if args.write_table:
        write_table(rows, os.path.join(os.path.dirname(__file__), "_sm90_table.py"))
    print(json.dumps(rows))
