"""Every production kernel variant compiles for sm_90 (the lent H200) exactly as a launch
compiles it, with no register spills, without a GPU: the interpreter accepts code the GPU
compiler rejects, and a hand-written signature compiles a variant that never runs.

What is compiled: every launch of every goal shape (``sm90.variants.GOALS``: bf16, the production
tiles, real tensors of the production geometry), through Triton's own launch path
(``sm90.compile.compile_launch``: ``JITFunction.warmup`` under a compile-only sm_90 driver), so the
JIT derives the signature, constexprs and 16-byte-divisibility attributes from the real
arguments. The compile runs in a subprocess with ``TRITON_INTERPRET=0`` (the suite interprets
kernels when there is no GPU, interpreted functions cannot be compiled, and importing the kernels
on a CPU-only torch chooses the interpreter unless told ``0``).

Run under triton 3.6.0 (the GPU machine's) with ``make compat``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import triton
from preloaded import compiled_mode

from mqnc.triton_kernels._core.grid import SM90
from mqnc.triton_kernels.mla.plan import REGISTERS_PER_SM
from mqnc.triton_kernels.sm90.table import SM90_VARIANTS, TRITON
from mqnc.triton_kernels.sm90.variants import production_variants

VARIANTS = [v.name for v in production_variants()]
# The only spills allowed, by (triton, variant): the fp32-cache tiles under triton 3.6.0 (the GPU
# machine's). At 16 warps a CTA may have 128 registers a thread; every fp32 configuration tried
# (16 x 16 and 16 x 32 on 4, 8 or 16 warps, 3 to 5 stages) spills there, this one least; the
# 183-197 registers it took unbounded could not launch at all.
KNOWN_SPILLS = {
    ("3.6.0", "mla_decode[float32,16x16,w16,s5,out=fp32-split]"): 24,
    ("3.6.0", "mla_sparse[float32,16x16,w16,s5,out=fp32-split]"): 16,
}


# ---- the compile scripts: one child process each, forked from one preloaded interpreter ------
# Every script below ran in a Python of its own, which imported torch, Triton and the kernels
# and hashed Triton's sources before compiling (~3 s of a CPU each time): _run_script forks each
# from one interpreter that did that once (correctness/preloaded.py), in compiled mode
# (``TRITON_INTERPRET=0``): each still runs alone, as ``python -c`` runs it, nothing compiled
# before it.
_SCRIPTS: list = []


def _run_script(code: str, *, timeout: float, cwd=None) -> subprocess.CompletedProcess:
    """``python -c code`` in compiled mode, forked from the preloaded interpreter."""
    if not _SCRIPTS:
        _SCRIPTS.append(compiled_mode())  # (no launch)
    return _SCRIPTS[0].run(code, timeout=timeout, cwd=cwd)


@pytest.fixture(scope="module", autouse=True)
def _close_the_preloaded_interpreter():
    yield
    while _SCRIPTS:
        _SCRIPTS.pop().close()


_COMPILE_ALL = """
import json
from mqnc.triton_kernels.sm90.compile import compile_all
print(json.dumps(compile_all(90)))
"""


@pytest.fixture(scope="module")
def compiled() -> dict[str, dict]:
    r = _run_script(_COMPILE_ALL, timeout=900)  # python -m mqnc.triton_kernels.sm90.compile 90
    assert r.returncode == 0, r.stderr[-4000:]
    return {k["name"]: k for k in json.loads(r.stdout)}


def test_the_compile_covers_every_variant_the_goal_shapes_launch(compiled):
    assert sorted(compiled) == sorted(VARIANTS)


@pytest.mark.parametrize("name", VARIANTS)
def test_compiles_for_sm90_without_spills(compiled, name):
    res = compiled[name]
    assert res["ok"], res.get("error")
    print(
        f"triton {res['triton']} {name}: {res['registers']} regs, stack {res['stack']}, "
        f"local {res['local']}, shared {res['shared']} B, sass {res['sass']}"
    )
    assert res["registers"] <= 255
    # A CTA's threads must fit the SM's 65,536 registers together, or it cannot launch at all
    # (triton: "out of resource: threads"; seen on the H200 for a 16-warp tile at 255).
    regs_per_cta = res["registers"] * 32 * res["num_warps"]
    assert regs_per_cta <= REGISTERS_PER_SM, f"{name}: {regs_per_cta} registers per CTA"
    # a launch asking more shared memory than a CTA may have fails (OutOfResources)
    assert res["shared"] <= SM90.shared_per_cta, f"{name}: {res['shared']} B of shared memory"
    spill = res["stack"] + res["local"]
    allowed = KNOWN_SPILLS.get((res["triton"], name), 0)
    assert spill <= allowed, f"{name} spills: stack {res['stack']}, local {res['local']}"
    # One name, one compiled kernel: every goal shape that launches this variant got the same
    # specialisation from the JIT (the name is a faithful key for the occupancy table).
    assert res["kernels"] == 1, f"{name}: {res['kernels']} distinct kernels over {res['shapes']}"


@pytest.mark.parametrize("name", [n for n in VARIANTS if n.startswith("mla_")])
def test_mla_tile_loop_is_double_buffered(compiled, name):
    """The KV tile behind the page-table (or index) indirection is (at least) double-buffered:
    TTGIR allocates a 2-deep (or deeper) ring of ``BLOCK_N x 512`` tiles, copies into it
    asynchronously (``cp.async``: LDGSTS in the SASS) and waits with groups still in flight
    (``num > 0``); the single-buffered loop had ``1x64x512xbf16`` and ``async_wait {num = 0}``
    only. 16-bit operands run on the tensor cores (HMMA; a 64-head tile HGMMA, a warpgroup's
    64 rows); fp32 ones in full fp32 (``ieee``, never tf32).

    The one exception is chosen, not fallen into: the dense 64-head tile at 3 stages under
    triton 3.6 (``mla.plan._WIDE``), measured the fastest at 128 heads on an H200 (bound by
    its MMAs, not its loads), allocates a 2-deep ring but waits for every copy group (``num =
    0``); checked to be exactly that."""
    res = compiled[name]
    dtype, tile, _warps, stages = name.split("[")[1].split(",")[:4]
    block_n = tile.split("x")[1]
    elem = {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}[dtype]
    if "-fp8[" in name:  # FP8 entries: the ring holds their bytes (bf16 queries, bf16 MMAs)
        elem = "i8"
    ttgir = res["ttgir"]
    print(f"{name}: buffers {ttgir['local_alloc']}, async_wait nums {ttgir['async_waits']}")
    ring = [
        int(b.split("x")[0]) for b in ttgir["local_alloc"] if b.endswith(f"x{block_n}x512x{elem}")
    ]
    sass = res["sass"]
    if name.endswith(",tma]"):  # TMA page boxes into a 2-deep ring on mbarriers (no cp.async)
        assert ring and max(ring) >= 2 and ttgir["tma_copies"] > 0, ttgir
        assert sass.get("UTMALDG", 0) > 0 and not sass.get("LDGSTS.128", 0), sass
    else:
        assert ring and max(ring) >= 2 and ttgir["async_copies"] > 0, ttgir["local_alloc"]
        if stages == "s3" or name.endswith(",pipe]"):
            # chosen: a 2-deep ring whose every wait is for all copy groups (the dense 64 x 32
            # tile at 3 stages, the restructured "-pipe" loops at 2), measured the fastest at
            # 128 heads on an H200 (bound by their MMAs, not their loads)
            assert stages == "s2" or (tile == "64x32" and name.startswith("mla_decode")), name
            assert max(ttgir["async_waits"]) == 0
        else:
            assert max(ttgir["async_waits"]) > 0
        assert sass.get("LDGSTS.128", 0) > 0, sass
    if elem != "f32":  # 16-bit operands on tensor cores
        assert sass.get("HGMMA" if tile.startswith("64x") else "HMMA", 0) > 0, sass
    else:  # no tf32 rounding of fp32
        assert not sass.get("HMMA", 0) and not sass.get("HGMMA", 0), sass


@pytest.mark.parametrize("name", [n for n in VARIANTS if n.startswith("merge")])
def test_merge_reads_partials_with_16_byte_loads(compiled, name):
    sass = compiled[name]["sass"]
    assert sass.get("LDG.128", 0) > 0 and not sass.get("LDG.16", 0), sass


def test_occupancy_table_matches_a_fresh_compile(compiled):
    """The checked-in table (``sm90.table``, what the split policy reads off a GPU) is what
    this compile gives, under the triton that wrote it (regenerate with
    ``python -m mqnc.triton_kernels.sm90.compile --write-table``)."""
    if triton.__version__ != TRITON:  # (the tiles above 32 heads differ by version too)
        pytest.skip(f"table written by triton {TRITON}, this is {triton.__version__}")
    assert sorted(SM90_VARIANTS) == sorted(VARIANTS)
    for name, row in SM90_VARIANTS.items():
        got = {k: compiled[name][k] for k in row}
        assert got == row, f"{name}: table {row}, compiled {got}"


_THREE_STAGES = """
import dataclasses, json
from mqnc.triton_kernels.sm90.compile import compile_launch, ttgir_summary
from mqnc.triton_kernels.sm90.variants import GOALS, shape_launches
shape = next(s for s in GOALS if s.op == "mla_decode" and (s.H, s.B, s.ct) == (16, 1, 2048))
launch = shape_launches(shape)[0]
kwargs = {**launch.kwargs, "num_stages": 3}
k = compile_launch(launch.kernel, launch.args, kwargs, grid=launch.grid)
print(json.dumps(ttgir_summary(k.asm["ttgir"])))
"""


def test_three_stages_leave_the_kv_tile_single_buffered():
    """The evidence for num_stages = 5: the same launch at Triton's default 3 stages gets one
    KV buffer and waits for every copy group at the loop top (no overlap), because the page-id
    load takes a pipeline stage of its own."""
    r = _run_script(_THREE_STAGES, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    print(f"3 stages: buffers {summary['local_alloc']}, async_wait nums {summary['async_waits']}")
    assert "1x64x512xbf16" in summary["local_alloc"]
    assert "2x64x512xbf16" not in summary["local_alloc"]
    assert set(summary["async_waits"]) == {0}


# The static schedule of every MLA attention variant the default path launches, per triton
# (``sm90.compile.mla_evidence``): (tensor-core instructions per CTA per 64 entries, redundancy =
# issued over ideal multiply-accumulates, wgmma waits leaving work in flight, TMA loads, CTAs
# per SM, registers, shared bytes, spilled bytes). Read off a launch-exact compile under each
# triton; a change that makes any of them worse fails below (an improvement updates its row).
# 1.529 = (2 x 576 + 512) / (576 + 512): each CTA computes its QK^T twice (the 64-head
# HGMMA tiles put both warpgroups on the same 64 rows; the 32-head and sparse 16 x 32 HMMA
# tiles likewise); no wait leaves a wgmma in flight; the 64 x 64 "-tma" tiles (triton 3.6's
# defaults above 32 heads) load each page by TMA (8 boxes a tile), the others by cp.async.
# fmt: off
SCHEDULE: dict[str, dict[str, tuple]] = {
    "3.6.0": {
        "mla_decode[bfloat16,16x64,w8,s5,out=fp32-split]":
            (544.0, 1.0, 0, 0, 1, 208, 168960, 0),
        "mla_decode[bfloat16,16x64,w8,s5,out=bfloat16]":
            (544.0, 1.0, 0, 0, 1, 204, 168960, 0),
        "mla_decode[bfloat16,64x64,w8,s2,out=fp32-split,tma]":
            (152.0, 1.529, 0, 8, 1, 235, 221200, 0),
        "mla_decode[bfloat16,64x64,w8,s2,out=bfloat16,tma]":
            (152.0, 1.529, 0, 8, 1, 242, 221200, 0),
        "mla_sparse[bfloat16,16x32,w8,s5,out=fp32-split]":
            (832.0, 1.529, 0, 0, 1, 173, 93952, 0),
        "mla_sparse[bfloat16,64x32,w8,s2,out=fp32-split,pipe]":
            (296.0, 1.529, 0, 0, 1, 246, 147584, 0),
        "mla_decode[bfloat16,16x64,w8,s5,out=fp32-split,page=1,csr]":
            (544.0, 1.0, 0, 0, 1, 206, 168960, 0),
        "mla_decode[bfloat16,16x64,w8,s5,out=fp32-split,page=1,csr,split-kv]":
            (544.0, 1.0, 0, 0, 1, 207, 168960, 0),
        "mla_decode[bfloat16,64x64,w8,s2,out=fp32-split,page=1,csr,split-kv,pipe]":
            (152.0, 1.529, 0, 0, 1, 252, 221184, 0),
        "mla_decode[bfloat16,16x64,w8,s5,out=fp32-split,page=16,split-kv]":
            (544.0, 1.0, 0, 0, 1, 208, 168960, 0),
        "mla_decode[bfloat16,16x64,w8,s5,out=fp32-split,sq,causal]":
            (544.0, 1.0, 0, 0, 1, 208, 168960, 0),
        "mla_decode[bfloat16,64x64,w8,s2,out=fp32-split,sq,causal,tma]":
            (152.0, 1.529, 0, 8, 1, 235, 221200, 0),
        "mla_sparse[bfloat16,64x32,w8,s2,out=fp32-split,split-kv,pipe]":
            (296.0, 1.529, 0, 0, 1, 250, 147584, 0),
        "mla_decode[float32,16x16,w16,s5,out=fp32-split]":
            (0.0, None, 0, 0, 1, 128, 111936, 24),
        "mla_sparse[float32,16x16,w16,s5,out=fp32-split]":
            (0.0, None, 0, 0, 1, 128, 112064, 16),
        # FP8 caches (656-byte entries, bf16 queries; _variants.FP8)
        "mla_decode-fp8[bfloat16,16x32,w8,s5,out=fp32-split]":
            (832.0, 1.529, 0, 0, 1, 233, 126464, 0),
        "mla_decode-fp8[bfloat16,64x16,w8,s5,out=fp32-split]":
            (584.0, 1.529, 0, 0, 1, 242, 131072, 0),
        "mla_decode-fp8[bfloat16,64x16,w8,s5,out=bfloat16]":
            (584.0, 1.529, 0, 0, 1, 250, 113408, 0),
        "mla_sparse-fp8[bfloat16,64x16,w8,s5,out=fp32-split]":
            (584.0, 1.529, 0, 0, 1, 254, 131072, 0),
        "mla_decode-fp8[bfloat16,16x32,w8,s5,out=fp32-split,page=1,csr,split-kv]":
            (832.0, 1.529, 0, 0, 1, 238, 126464, 0),
        "mla_decode-fp8[bfloat16,64x16,w8,s5,out=fp32-split,sq,causal]":
            (584.0, 1.529, 0, 0, 1, 242, 131072, 0),
        "mla_sparse-fp8[bfloat16,64x16,w8,s5,out=fp32-split,split-kv]":
            (584.0, 1.529, 0, 0, 1, 254, 131072, 0),
    },
    "3.9.0": {
        "mla_decode[bfloat16,16x64,w8,s5,out=fp32-split]":
            (544.0, 1.0, 0, 0, 1, 188, 168960, 0),
        "mla_decode[bfloat16,16x64,w8,s5,out=bfloat16]":
            (544.0, 1.0, 0, 0, 1, 189, 168960, 0),
        "mla_decode[bfloat16,32x32,w8,s5,out=fp32-split]":
            (1664.0, 1.529, 0, 0, 1, 175, 113152, 0),
        "mla_decode[bfloat16,32x32,w8,s5,out=bfloat16]":
            (1664.0, 1.529, 0, 0, 1, 180, 113152, 0),
        "mla_sparse[bfloat16,16x32,w8,s5,out=fp32-split]":
            (832.0, 1.529, 0, 0, 2, 119, 93952, 0),
        "mla_decode[bfloat16,16x64,w8,s5,out=fp32-split,page=1,csr]":
            (544.0, 1.0, 0, 0, 1, 186, 168960, 0),
        "mla_decode[bfloat16,16x64,w8,s5,out=fp32-split,page=1,csr,split-kv]":
            (544.0, 1.0, 0, 0, 1, 186, 168960, 0),
        "mla_decode[bfloat16,32x32,w8,s5,out=fp32-split,page=1,csr,split-kv]":
            (1664.0, 1.529, 0, 0, 1, 168, 113152, 0),
        "mla_decode[bfloat16,16x64,w8,s5,out=fp32-split,page=16,split-kv]":
            (544.0, 1.0, 0, 0, 1, 188, 168960, 0),
        "mla_decode[bfloat16,16x64,w8,s5,out=fp32-split,sq,causal]":
            (544.0, 1.0, 0, 0, 1, 188, 168960, 0),
        "mla_decode[bfloat16,32x32,w8,s5,out=fp32-split,sq,causal]":
            (1664.0, 1.529, 0, 0, 1, 175, 113152, 0),
        "mla_sparse[bfloat16,16x32,w8,s5,out=fp32-split,split-kv]":
            (832.0, 1.529, 0, 0, 2, 117, 93952, 0),
        "mla_decode[float32,16x16,w16,s5,out=fp32-split]":
            (0.0, None, 0, 0, 1, 128, 111936, 0),
        "mla_sparse[float32,16x16,w16,s5,out=fp32-split]":
            (0.0, None, 0, 0, 1, 128, 112064, 0),
        # FP8 caches (656-byte entries, bf16 queries; _variants.FP8)
        "mla_decode-fp8[bfloat16,16x32,w8,s5,out=fp32-split]":
            (832.0, 1.529, 0, 0, 1, 226, 126464, 0),
        "mla_decode-fp8[bfloat16,16x32,w8,s5,out=bfloat16]":
            (832.0, 1.529, 0, 0, 1, 226, 126464, 0),
        "mla_sparse-fp8[bfloat16,16x32,w8,s5,out=fp32-split]":
            (832.0, 1.529, 0, 0, 1, 225, 126720, 0),
        "mla_sparse-fp8[bfloat16,16x32,w8,s5,out=bfloat16]":
            (832.0, 1.529, 0, 0, 1, 224, 126720, 0),
        "mla_decode-fp8[bfloat16,16x32,w8,s5,out=fp32-split,page=1,csr,split-kv]":
            (832.0, 1.529, 0, 0, 1, 226, 126464, 0),
        "mla_decode-fp8[bfloat16,16x32,w8,s5,out=bfloat16,sq,causal]":
            (832.0, 1.529, 0, 0, 1, 226, 126464, 0),
        "mla_sparse-fp8[bfloat16,16x32,w8,s5,out=fp32-split,split-kv]":
            (832.0, 1.529, 0, 0, 1, 225, 126720, 0),
    },
}
# fmt: on
_SCHEDULE_KEYS = (
    "mma_per_64",
    "redundancy",
    "in_flight",
    "tma",
    "cta_per_sm",
    "registers",
    "shared",
    "spill",
)
# Which way each gets worse: more instructions, redundancy, registers, shared memory or spills;
# fewer waits in flight, TMA loads or CTAs per SM.
_WORSE_IF_MORE = {"mma_per_64", "redundancy", "registers", "shared", "spill"}


def schedule_regressions(name: str, evidence: dict, pinned: tuple) -> list[str]:
    """What in ``evidence`` (``mla_evidence``'s dict) is worse than ``pinned``."""
    got = {**evidence, "in_flight": int(evidence["wgmma_waits"].split("/")[0])}
    out = []
    for key, pin in zip(_SCHEDULE_KEYS, pinned, strict=True):
        value = got[key]
        if pin is None or value is None:
            if value != pin:
                out.append(f"{name}: {key} {value}, pinned {pin}")
        elif (value > pin) if key in _WORSE_IF_MORE else (value < pin):
            out.append(f"{name}: {key} {value}, pinned {pin}")
    return out


@pytest.mark.parametrize("name", [n for n in VARIANTS if n.startswith("mla_")])
def test_default_mla_schedule_does_not_regress(compiled, name):
    """Each default MLA variant's static schedule is no worse than its pinned row under this
    triton (``SCHEDULE``; other versions have no pins and skip)."""
    version = triton.__version__
    if version not in SCHEDULE:
        pytest.skip(f"no schedule pinned for triton {version}")
    assert name in SCHEDULE[version], f"{name}: pin its schedule for triton {version}"
    ev = compiled[name]["evidence"]
    print(f"triton {version} {name}: {ev}")
    assert schedule_regressions(name, ev, SCHEDULE[version][name]) == []


def test_schedule_regressions_names_what_got_worse():
    pinned = (296.0, 1.529, 0, 0, 1, 228, 147712, 0)
    ev = {
        "mma_per_64": 296.0,
        "redundancy": 1.529,
        "wgmma_waits": "0/3",
        "tma": 0,
        "cta_per_sm": 1,
        "registers": 228,
        "shared": 147712,
        "spill": 0,
    }
    assert schedule_regressions("v", ev, pinned) == []
    better = {**ev, "redundancy": 1.0, "wgmma_waits": "2/3", "tma": 4, "registers": 200}
    assert schedule_regressions("v", better, pinned) == []
    worse = {**ev, "redundancy": 2.0, "cta_per_sm": 0, "spill": 8, "shared": 150000}
    assert schedule_regressions("v", worse, pinned) == [
        "v: redundancy 2.0, pinned 1.529",
        "v: cta_per_sm 0, pinned 1",
        "v: shared 150000, pinned 147712",
        "v: spill 8, pinned 0",
    ]
    assert schedule_regressions("v", {**ev, "redundancy": None}, pinned) == [
        "v: redundancy None, pinned 1.529"
    ]


def test_mma_macs_and_wgmma_waits_read_the_sass():
    """The schedule's counts from SASS text: an HGMMA.64xNxK is 64 N K multiply-accumulates per
    warpgroup, an HMMA.16816 16 8 16 per warp; ``WARPGROUP.DEPBAR.LE gsb0, N`` leaves N wgmma
    groups in flight."""
    from mqnc.triton_kernels.sm90.compile import mma_macs, wgmma_waits

    sass = "\n".join(
        [
            "        /*3980*/   HGMMA.64x16x16.F32.BF16 R160, gdesc[UR56], RZ, !UPT ;",
            "        /*39d0*/   HGMMA.64x256x16.F32.BF16 R24, gdesc[UR32], R24 ;",
            "        /*5450*/   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;",
            "        /*5460*/   WARPGROUP.DEPBAR.LE gsb0, 0x1 ;",
        ]
    )
    assert mma_macs(sass, 8) == 2 * (64 * 16 * 16 + 64 * 256 * 16)
    assert wgmma_waits(sass) == (0, 1)
    hmma = "        /*0100*/   HMMA.16816.F32.BF16 R4, R8, R12, R4 ;"
    assert mma_macs(hmma, 8) == 8 * 16 * 8 * 16
    with pytest.raises(ValueError, match="num_warps: expected a positive int, got 0"):
        mma_macs(hmma, 0)
    with pytest.raises(ValueError, match="HMMA.999 is not a shape"):
        mma_macs("  HMMA.999.F32 R0 ;", 4)


_SWEEP = """
import json
from mqnc.triton_kernels.sm90.compile import compile_launch, resources
from mqnc.triton_kernels.mla.plan import SWEEP_TILES, forced_tile
from mqnc.triton_kernels.sm90.variants import Shape, shape_launches
rows = []
for kind, tiles in SWEEP_TILES.items():
    sparse = kind == "sparse"
    op, n = ("mla_sparse", 2048) if sparse else ("mla_decode", 8192)
    for tile in tiles:
        for B in (1, 64):  # split (fp32 partials) and, dense, unsplit (bf16 out)
            with forced_tile(tile, sparse=sparse):
                ln = shape_launches(Shape(op, B=B, H=128, ct=n))[0]
            r = resources(ln.name, compile_launch(ln.kernel, ln.args, ln.kwargs, grid=ln.grid))
            rows.append([tile.label, ln.name, r.registers, r.stack + r.local, r.shared])
print(json.dumps(rows))
"""


def test_sweep_candidates_compile_without_spills_under_triton_3_6():
    """Every candidate of the next H200 sweep (``mla.plan.SWEEP_TILES``) compiles for sm_90
    under triton 3.6 (the GPU's; ``make compat``) at 128 heads, split and unsplit, without
    spills and within a CTA's shared memory. Other tritons skip: there the wide tiles spill,
    which is why the launcher does not choose them."""
    if not triton.__version__.startswith("3.6."):
        pytest.skip(f"the sweep runs under triton 3.6 on the GPU, this is {triton.__version__}")
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    r = subprocess.run(
        [sys.executable, "-c", _SWEEP], capture_output=True, text=True, env=env, timeout=1200
    )
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(r.stdout.strip().splitlines()[-1])
    for tile, name, regs, spill, shared in rows:
        print(f"{tile}: {name} {regs} regs, {spill} B spilled, {shared} B shared")
    assert [row for row in rows if row[3] or row[4] > SM90.shared_per_cta] == []
    assert any(row[0] == "64x64w8s3" for row in rows)


_CEILINGS = """
import json, torch
from mqnc.triton_kernels.sm90.compile import compile_launch, resources
from perf.bench_copy import BLOCK, copy_launch, programs, read_launch
n = BLOCK * 64  # (the 4 GiB buffer's 2**30 words specialise alike: divisible by 16)
src, part = torch.empty(n, dtype=torch.int32), torch.empty(programs(132), dtype=torch.int32)
rows = []
for ln in (read_launch(src, part), copy_launch(src, torch.empty_like(src), programs(132))):
    c = compile_launch(ln.kernel, ln.args, ln.kwargs, grid=ln.grid)
    r, ptx = resources(ln.name, c), c.asm["ptx"]
    rows.append([ln.name, r.registers, r.stack + r.local, r.shared,
                 ptx.count("ld.global.cg.v4.b32"), ptx.count("st.global.cs.v4.b32")])
from perf.bench_copy import TMA_CTAS_PER_SM, read_tma_launch
tma = read_tma_launch(src, torch.empty(programs(132, TMA_CTAS_PER_SM), dtype=torch.int32))
c = compile_launch(tma.kernel, tma.args, tma.kwargs, grid=tma.grid)
r = resources(tma.name, c)
rows.append([tma.name, r.registers, r.stack + r.local, r.shared,
             c.asm["ptx"].count("cp.async.bulk.tensor"), 0])
print(json.dumps(rows))
"""


def test_memory_ceiling_kernels_compile_with_16_byte_accesses_and_no_spills():
    """perf/bench_copy.py's read and copy ceiling kernels, at their launch values (persistent
    grid of 132 SMs x 4, 8192-word blocks on 8 warps), compile for sm_90 without spills, every
    thread moving its 32 words of a block with eight 16-byte ``.cg`` loads (and, copying, eight
    16-byte streaming stores): the widest accesses there are, or the ceiling they measure is
    the instruction issue's, not the memory's. The TMA read kernel (132 SMs x 2, 32 KiB boxes)
    compiles to bulk tensor copies, without spills, two programs' shared memory within an
    SM's."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    r = _run_script(_CEILINGS, timeout=600, cwd=root)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(r.stdout.strip().splitlines()[-1])
    for name, regs, spill, shared, loads, stores in rows:
        print(f"triton {triton.__version__} {name}: {regs} regs, {spill} B spilled, {shared} B "
              f"shared, {loads} x ld.global.cg.v4 (TMA: cp.async.bulk.tensor), {stores} x "
              "st.global.cs.v4")  # fmt: skip
        assert spill == 0 and regs <= 128, (name, regs, spill)
        assert loads == 8 or (name.startswith("ceiling_read_tma") and loads >= 1), (name, loads)
    assert [(row[0], row[5]) for row in rows] == [
        ("ceiling_read[int32]", 0),
        ("ceiling_copy[int32]", 8),
        ("ceiling_read_tma[int32]", 0),
    ]
    # two TMA programs an SM: their shared memory (the box ring) must fit twice
    assert 2 * (rows[2][3] + 1024) <= SM90.shared, rows[2]


_GLUON = """
import json
from mqnc.triton_kernels.sm90.compile import mla_evidence, resources
from mqnc.triton_kernels.sm90.gluon_compile import compile_gluon_decode
rows = []
for block_n, splits in ((64, 2), (64, 1), (128, 2)):
    name, c = compile_gluon_decode(
        batch=64, heads=128, max_blocks=128, num_splits=splits, block_n=block_n)
    r = resources(name, c)
    rows.append({"name": name, "block_n": block_n, "sass": r.sass, "mma_macs": r.mma_macs,
                 "evidence": mla_evidence(r, 64, block_n, 576, 512), "ttgir": r.ttgir})
print(json.dumps(rows))
"""


def test_gluon_decode_compiles_for_sm90_on_its_schedule():
    """The opt-in Gluon decode kernel (``mla.gluon``) compiles for sm_90 under triton 3.6
    (the GPU's) at the production launch (H 128, B 64, c_t 8192: two CTAs a row; split and
    unsplit, and the 128-entry variant) without spills, within 255 registers and a CTA's shared
    memory, one CTA per SM; HGMMA multiply-accumulates equal the ideal tile's (redundancy 1.0:
    each warpgroup computes QK^T for its own entries and PV for its own 256 columns, none
    recomputed), the cache and Q arrive by TMA (UTMALDG, no cp.async), and ptxas kept the async
    wgmma groups (one wait per wait in the TTGIR, not one per HGMMA: a serialized pipeline).
    Other tritons skip: the kernel is written against triton 3.6.0's Gluon API (3.9.0 renamed
    ``tma.async_copy_global_to_shared`` to ``tma.async_load``)."""
    if not triton.__version__.startswith("3.6."):
        pytest.skip(f"the Gluon kernel targets triton 3.6's Gluon API, not {triton.__version__}")
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    r = subprocess.run(
        [sys.executable, "-c", _GLUON], capture_output=True, text=True, env=env, timeout=600
    )
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(rows) == 3
    for row in rows:
        ev, sass, bn = row["evidence"], row["sass"], row["block_n"]
        print(row["name"], ev, sass)
        assert ev["spill"] == 0 and ev["registers"] <= 255, ev
        assert ev["shared"] <= SM90.shared_per_cta and ev["cta_per_sm"] == 1, ev
        assert ev["mma"] == "HGMMA" and ev["redundancy"] == 1.0, ev
        # per warpgroup and block: QK^T 576 / 16 instructions of N = bn / 2, PV 64x256 x bn / 16
        assert sass["HGMMA"] == 576 // 16 + bn // 16, sass
        assert row["mma_macs"] == 64 * bn * (576 + 512)
        assert sass.get("UTMALDG", 0) > 0 and not any(k.startswith("LDGSTS") for k in sass)
        assert row["ttgir"]["tma_copies"] > 0 and row["ttgir"]["wgmma"] == 3
        in_flight, waits = map(int, ev["wgmma_waits"].split("/"))
        pendings = row["ttgir"]["wgmma_pendings"]
        assert (in_flight, waits) == (sum(p > 0 for p in pendings), len(pendings)), ev


_TP = """
import json
import torch
from mqnc.triton_kernels.sm90.compile import compile_launch, resources
from mqnc.triton_kernels.tp.scores import scores_launch
from mqnc.triton_kernels.tp.values import values_launch
rows = []
B, T = 8, 4096  # decode: 8 tokens, a 4096-token chunk or top-k
# 16 heads (V2-Lite: 16-head programs, mma.sync) and 128 (V3: 64-head programs, wgmma); TP 1
# routes through the MLA kernels
for n, H in ((2, 16), (4, 16), (2, 128), (4, 128)):
    w, dv = 576 // n, 512 // n
    q = torch.empty(B, H, w, dtype=torch.bfloat16)
    pool = torch.empty(128, 64, w, dtype=torch.bfloat16)
    slots = torch.empty(B, T, dtype=torch.int32)
    s = torch.empty(B, H, T, dtype=torch.float32)
    o, lse = torch.empty(B, H, dv, dtype=torch.bfloat16), torch.empty(B, H)
    launches = scores_launch(q, pool, slots, dv, s), values_launch(s, pool, slots, 0.1, dv, o, lse)
    for ln in launches:
        r = resources(ln.name, compile_launch(ln.kernel, ln.args, ln.kwargs, grid=ln.grid))
        rows.append([ln.name, r.registers, r.stack + r.local, r.shared])
print(json.dumps(rows))
"""


def test_tp_kernels_compile_for_sm90_without_spills():
    """The tensor-parallel kernels (partial scores over a slice, softmax times a value slice)
    compile for sm_90 exactly as they launch at TP 2 and 4 (576 / N wide rows, 16 and 128
    heads, 4096 entries, bf16), without spills and within a CTA's shared memory, under this
    triton (3.6.0 is the GPU's: ``.venv-compat``)."""
    r = _run_script(_TP, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(r.stdout.strip().splitlines()[-1])
    for name, regs, spill, shared in rows:
        print(f"{name}: {regs} regs, {spill} B spilled, {shared} B shared")
    assert len(rows) == 8
    assert [row for row in rows if row[2] or row[3] > SM90.shared_per_cta] == []


_COMBINE_PDL = """
import json, torch
from mqnc.triton_kernels.sm90.compile import compile_launch, resources
from mqnc.triton_kernels.merge.partials import merge_launch
# the split-KV combine of the holder's partial (H 16, B 1, c_t 2048: 32 splits), fp32 partials
o, lse = torch.empty(32, 1, 16, 512), torch.empty(32, 1, 16)
o_out, lse_out = torch.empty(1, 16, 512, dtype=torch.bfloat16), torch.empty(1, 16)
rows = []
for pdl in (False, True):
    ln = merge_launch(o, lse, o_out, lse_out, pdl=pdl)
    c = compile_launch(ln.kernel, ln.args, ln.kwargs, grid=ln.grid)
    r = resources(ln.name, c)
    rows.append([ln.name, r.registers, r.stack + r.local, bool(c.metadata.launch_pdl),
                 c.asm["ptx"].count("griddepcontrol.wait")])
print(json.dumps(rows))
"""


def test_combine_with_programmatic_dependent_launch_compiles_for_sm90():
    """The opt-in PDL combine (``merge.partials.combine_pdl``) compiles for sm_90 at the holder
    partial's combine (32 fp32 partials of 16 heads x 512 into bf16) without spills, launched
    with ``launch_pdl`` and waiting with ``griddepcontrol.wait`` before its loads; the default
    combine has neither."""
    r = _run_script(_COMBINE_PDL, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    (plain, pdl) = json.loads(r.stdout.strip().splitlines()[-1])
    print(f"triton {triton.__version__}: {plain} / {pdl}")
    assert plain[2] == pdl[2] == 0
    assert (plain[3], plain[4]) == (False, 0)
    assert pdl[0].endswith(",pdl]") and pdl[3] is True and pdl[4] >= 1


# What decides the memory-bound numbers, per default MLA variant and triton
# (``sm90.compile.mla_evidence``): (KV tiles in the shared-memory ring, the longest chain of
# dependent global reads, TMA loads, CTAs per SM). Read off a launch-exact compile under each
# triton; a default variant with a shallower ring, a longer chain, fewer TMA loads or fewer CTAs
# per SM fails below (an improvement updates its row). The dense chain is 3 (the row's length,
# its page ids, the KV tile), the sparse one 2 (the indices, the KV tile); no default loads by
# TMA (the restructured ``-tma`` candidates do, docs/kernel-schedule.md).
# fmt: off
READS: dict[str, dict[str, tuple]] = {
    "3.6.0": {
        "mla_decode[bfloat16,16x64,w8,s5,out=fp32-split]":
            (2, 3, 0, 1),
        "mla_decode[bfloat16,16x64,w8,s5,out=bfloat16]":
            (2, 3, 0, 1),
        "mla_decode[bfloat16,64x64,w8,s2,out=fp32-split,tma]":
            (2, 3, 8, 1),
        "mla_decode[bfloat16,64x64,w8,s2,out=bfloat16,tma]":
            (2, 3, 8, 1),
        "mla_sparse[bfloat16,16x32,w8,s5,out=fp32-split]":
            (2, 2, 0, 1),
        "mla_sparse[bfloat16,64x32,w8,s2,out=fp32-split,pipe]":
            (2, 2, 0, 1),
        "mla_decode[bfloat16,16x64,w8,s5,out=fp32-split,page=1,csr]":
            (2, 3, 0, 1),
        "mla_decode[bfloat16,16x64,w8,s5,out=fp32-split,page=1,csr,split-kv]":
            (2, 3, 0, 1),
        "mla_decode[bfloat16,64x64,w8,s2,out=fp32-split,page=1,csr,split-kv,pipe]":
            (2, 3, 0, 1),
        "mla_decode[bfloat16,16x64,w8,s5,out=fp32-split,page=16,split-kv]":
            (2, 3, 0, 1),
        "mla_decode[bfloat16,16x64,w8,s5,out=fp32-split,sq,causal]":
            (2, 3, 0, 1),
        "mla_decode[bfloat16,64x64,w8,s2,out=fp32-split,sq,causal,tma]":
            (2, 3, 8, 1),
        "mla_sparse[bfloat16,64x32,w8,s2,out=fp32-split,split-kv,pipe]":
            (2, 2, 0, 1),
        "mla_decode[float32,16x16,w16,s5,out=fp32-split]":
            (2, 3, 0, 1),
        "mla_sparse[float32,16x16,w16,s5,out=fp32-split]":
            (2, 2, 0, 1),
        # FP8 caches (656-byte entries, bf16 queries; _variants.FP8)
        "mla_decode-fp8[bfloat16,16x32,w8,s5,out=fp32-split]":
            (2, 3, 0, 1),
        "mla_decode-fp8[bfloat16,64x16,w8,s5,out=fp32-split]":
            (2, 3, 0, 1),
        "mla_decode-fp8[bfloat16,64x16,w8,s5,out=bfloat16]":
            (2, 3, 0, 1),
        "mla_sparse-fp8[bfloat16,64x16,w8,s5,out=fp32-split]":
            (2, 2, 0, 1),
        "mla_decode-fp8[bfloat16,16x32,w8,s5,out=fp32-split,page=1,csr,split-kv]":
            (2, 3, 0, 1),
        "mla_decode-fp8[bfloat16,64x16,w8,s5,out=fp32-split,sq,causal]":
            (2, 3, 0, 1),
        "mla_sparse-fp8[bfloat16,64x16,w8,s5,out=fp32-split,split-kv]":
            (2, 2, 0, 1),
    },
    "3.9.0": {
        "mla_decode[bfloat16,16x64,w8,s5,out=fp32-split]":
            (2, 3, 0, 1),
        "mla_decode[bfloat16,16x64,w8,s5,out=bfloat16]":
            (2, 3, 0, 1),
        "mla_decode[bfloat16,32x32,w8,s5,out=fp32-split]":
            (2, 3, 0, 1),
        "mla_decode[bfloat16,32x32,w8,s5,out=bfloat16]":
            (2, 3, 0, 1),
        "mla_sparse[bfloat16,16x32,w8,s5,out=fp32-split]":
            (2, 2, 0, 2),
        "mla_decode[bfloat16,16x64,w8,s5,out=fp32-split,page=1,csr]":
            (2, 3, 0, 1),
        "mla_decode[bfloat16,16x64,w8,s5,out=fp32-split,page=1,csr,split-kv]":
            (2, 3, 0, 1),
        "mla_decode[bfloat16,32x32,w8,s5,out=fp32-split,page=1,csr,split-kv]":
            (2, 3, 0, 1),
        "mla_decode[bfloat16,16x64,w8,s5,out=fp32-split,page=16,split-kv]":
            (2, 3, 0, 1),
        "mla_decode[bfloat16,16x64,w8,s5,out=fp32-split,sq,causal]":
            (2, 3, 0, 1),
        "mla_decode[bfloat16,32x32,w8,s5,out=fp32-split,sq,causal]":
            (2, 3, 0, 1),
        "mla_sparse[bfloat16,16x32,w8,s5,out=fp32-split,split-kv]":
            (2, 2, 0, 2),
        "mla_decode[float32,16x16,w16,s5,out=fp32-split]":
            (2, 3, 0, 1),
        "mla_sparse[float32,16x16,w16,s5,out=fp32-split]":
            (2, 2, 0, 1),
        # FP8 caches (656-byte entries, bf16 queries; _variants.FP8)
        "mla_decode-fp8[bfloat16,16x32,w8,s5,out=fp32-split]":
            (2, 3, 0, 1),
        "mla_decode-fp8[bfloat16,16x32,w8,s5,out=bfloat16]":
            (2, 3, 0, 1),
        "mla_sparse-fp8[bfloat16,16x32,w8,s5,out=fp32-split]":
            (2, 2, 0, 1),
        "mla_sparse-fp8[bfloat16,16x32,w8,s5,out=bfloat16]":
            (2, 2, 0, 1),
        "mla_decode-fp8[bfloat16,16x32,w8,s5,out=fp32-split,page=1,csr,split-kv]":
            (2, 3, 0, 1),
        "mla_decode-fp8[bfloat16,16x32,w8,s5,out=bfloat16,sq,causal]":
            (2, 3, 0, 1),
        "mla_sparse-fp8[bfloat16,16x32,w8,s5,out=fp32-split,split-kv]":
            (2, 2, 0, 1),
    },
}
# fmt: on
_READ_KEYS = ("ring", "read_chain", "tma", "cta_per_sm")


def reads_regressions(name: str, evidence: dict, pinned: tuple) -> list[str]:
    """What in ``evidence`` (``mla_evidence``'s dict) is worse than ``pinned``: a longer
    dependent-read chain, or a shallower ring, fewer TMA loads or CTAs per SM."""
    out = []
    for key, pin in zip(_READ_KEYS, pinned, strict=True):
        value = evidence[key]
        if value is None or ((value > pin) if key == "read_chain" else (value < pin)):
            out.append(f"{name}: {key} {value}, pinned {pin}")
    return out


@pytest.mark.parametrize("name", [n for n in VARIANTS if n.startswith("mla_")])
def test_default_mla_reads_do_not_regress(compiled, name):
    """Each default MLA variant's ring, dependent-read chain, TMA loads and CTAs per SM are no
    worse than its pinned row under this triton (``READS``; other versions skip)."""
    version = triton.__version__
    if version not in READS:
        pytest.skip(f"no reads pinned for triton {version}")
    assert name in READS[version], f"{name}: pin its reads for triton {version}"
    ev = compiled[name]["evidence"]
    assert reads_regressions(name, ev, READS[version][name]) == []


def test_reads_regressions_names_what_got_worse():
    ev = {"ring": 2, "read_chain": 3, "tma": 0, "cta_per_sm": 1}
    assert reads_regressions("v", ev, (2, 3, 0, 1)) == []
    assert reads_regressions("v", {**ev, "ring": 3, "read_chain": 2, "tma": 8}, (2, 3, 0, 1)) == []
    worse = {"ring": 1, "read_chain": 4, "tma": 0, "cta_per_sm": 0}
    assert reads_regressions("v", worse, (2, 3, 0, 1)) == [
        "v: ring 1, pinned 2",
        "v: read_chain 4, pinned 3",
        "v: cta_per_sm 0, pinned 1",
    ]
    assert reads_regressions("v", {**ev, "read_chain": None}, (2, 3, 0, 1)) == [
        "v: read_chain None, pinned 3"
    ]


_PERSISTENT_SPLICE = """
import json
from mqnc.triton_kernels.sm90.compile import compile_launch, resources
from mqnc.triton_kernels.sm90.variants import Shape, shape_launches
from mqnc.triton_kernels.splice.rotate import persistent_splice
rows = []
for delta in ("int", "[T]"):
    for persistent in (False, True):
        with persistent_splice(persistent):
            (ln,) = shape_launches(Shape("splice", ct=2048, L=27, delta=delta))
        r = resources(ln.name, compile_launch(ln.kernel, ln.args, ln.kwargs, grid=ln.grid))
        rows.append([ln.name, list(ln.grid), r.registers, r.stack + r.local, r.shared])
print(json.dumps(rows))
"""


def test_persistent_splice_compiles_for_sm90_without_spills():
    """The persistent-grid splice candidate (``splice.rotate.persistent_splice``) at the goal shape
    (27 layers x 2048 tokens, one delta and a delta per token) compiles for sm_90 at its
    launch values (132 SMs x 4 programs) without spills, like the default splice beside it."""
    r = _run_script(_PERSISTENT_SPLICE, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(r.stdout.strip().splitlines()[-1])
    for name, grid, regs, spill, _shared in rows:
        print(f"triton {triton.__version__} {name} grid {grid}: {regs} regs, {spill} B spilled")
        assert spill == 0, (name, spill)
    assert [row[1] for row in rows if row[0].endswith(",persistent]")] == [[528], [528]]


_SEESAW_DEFAULT = """
import json
from mqnc.triton_kernels.sm90.compile import resources
from mqnc.triton_kernels.sm90.gluon_compile import compile_seesaw, compile_sparse_seesaw
rows = []
for kw in (dict(rows=64, heads=128, num_splits=1), dict(rows=8, heads=128, num_splits=4),
           dict(rows=1, heads=16, num_splits=8), dict(rows=16, heads=16, num_splits=1, page=128),
           dict(rows=4, heads=128, s_q=2, num_splits=2, csr=True),
           dict(rows=8, heads=128, num_splits=4, split_cache=True)):
    for name, c in compile_seesaw(**kw):
        r = resources(name, c)
        rows.append([name, r.registers, r.stack + r.local, r.shared, r.num_warps])
for kw in (dict(rows=8, heads=128, topk=2048, num_splits=4), dict(rows=1, heads=128, topk=2048,
           num_splits=1, page=1)):
    for name, c in compile_sparse_seesaw(**kw):
        r = resources(name, c)
        rows.append([name, r.registers, r.stack + r.local, r.shared, r.num_warps])
print(json.dumps(rows))
"""

# The default path's launches on sm_90 (the see-saw and the table kernel of its plan), compiled
# under triton 3.6.0: name -> (registers at launch, shared bytes, warps). 168 registers x 12
# warps at launch (the consumers raise theirs to 240, ``setmaxnreg``), one CTA per SM.
SEESAW_PINS = {
    "mla_decode_gluon[bfloat16,64x64,seesaw,w4+4+1,out=bf16]": (168, 222608, 12),
    "mla_decode_gluon[bfloat16,64x64,seesaw,w4+4+1,out=fp32-split]": (168, 222608, 12),
    "mla_decode_gluon[bfloat16,64x64,seesaw,w4+4+1,out=fp32-split,sq=2,causal]": (168, 222608, 12),
    "mla_decode_gluon[bfloat16,64x64,seesaw-split,w4+4+1,out=fp32-split]": (168, 222624, 12),
    "mla_sparse_gluon[bfloat16,64x64,seesaw-gather,w4+4+4,out=fp32-split]": (168, 222624, 12),
    "mla_sparse_gluon[bfloat16,64x64,seesaw-gather,w4+4+4,out=bf16]": (168, 222624, 12),
    "sparse_compact": (54, 128, 4),
    "seesaw_table[padded,sub=2]": (13, 0, 4),
    "seesaw_table[csr,sub=1]": (22, 0, 4),
}


def test_the_default_gluon_launches_compile_for_sm90_pinned():
    """Every launch the default path makes on an H200 through the see-saw's plan
    (``mla.gluon_plan``: FlashMLA's 128 heads at B 64 unsplit and B 8 split, the holder's
    16-head row split 8 ways, pages of 128 through the table kernel, MTP's ``s_q`` 2 causal over
    a CSR table) compiles for sm_90 under triton 3.6.0 (the GPU's) as a run makes it, without
    spills, at the pinned registers, shared memory and warps (one CTA per SM for the see-saw);
    and the opt-in split-cache variant over FlashInfer's ``ckv`` / ``kpe`` and the sparse
    gather variant (top-2048 at 128 heads, split and unsplit, pages of 64 and a token pool) with
    its compaction kernel the same way."""
    if not triton.__version__.startswith("3.6."):
        pytest.skip(f"the Gluon kernel targets triton 3.6's Gluon API, not {triton.__version__}")
    r = _run_script(_SEESAW_DEFAULT, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(r.stdout.strip().splitlines()[-1])
    seen = {}
    for name, regs, spill, shared, warps in rows:
        print(f"triton {triton.__version__} {name}: {regs} regs, {spill} B spilled, {shared} B")
        assert spill == 0, (name, spill)
        assert shared <= SM90.shared_per_cta, (name, shared)
        seen[name] = (regs, shared, warps)
    assert seen == SEESAW_PINS


_SEESAW = """
import json
import collections, re
from mqnc.triton_kernels.sm90.compile import _cuobjdump, resources
from mqnc.triton_kernels.sm90.gluon_compile import compile_gluon_decode
rows = []
for splits in (2, 1):
    name, c = compile_gluon_decode(
        batch=64, heads=128, max_blocks=128, num_splits=splits, schedule="seesaw")
    r = resources(name, c)
    ptx = c.asm["ptx"]
    rows.append({"name": name, "registers": r.registers, "spill": r.stack + r.local,
                 "shared": r.shared, "warps": r.num_warps, "sass": r.sass,
                 "mma_macs": r.mma_macs, "waits": list(r.wgmma_waits), "ttgir": r.ttgir,
                 "hgmma": collections.Counter(re.findall(
                     r"HGMMA\\.(\\d+x\\d+x\\d+)", _cuobjdump(c.asm["cubin"], "-sass"))),
                 "setmaxnreg": [int(x) for x in __import__("re").findall(
                     r"setmaxnreg\\.(?:inc|dec)\\.sync\\.aligned\\.u32\\s+(\\d+)", ptx)]})
print(json.dumps(rows))
"""


def test_gluon_seesaw_compiles_for_sm90_warp_specialized():
    """The warp-specialized see-saw schedule of the Gluon decode kernel (``schedule="seesaw"``)
    compiles for sm_90 under triton 3.6 at the production launch (H 128, B 64, c_t 8192, split
    and unsplit): 12 warps (two 4-warp consumers and a TMA warp) at a launch register count
    that fits the SM (<= 65,536 / 384), consumers raised to 240 by ``setmaxnreg``, no spills,
    one CTA's shared memory; each consumer's HGMMA computes ``QK^T`` for its own page (36 x
    64x64x16) and ``PV`` for its own 256 columns of both pages (2 x 4 x 64x256x16), so the
    multiply-accumulates per pair are the ideal ``64 x 128 x (576 + 512)`` (``resources``
    counts each HGMMA once per 4 of the CTA's 12 warps: 3 x), and ptxas kept the wgmma groups
    (one wait per TTGIR wait). Other tritons skip (3.9.0's Gluon renamed the TMA copy)."""
    if not triton.__version__.startswith("3.6."):
        pytest.skip(f"the Gluon kernel targets triton 3.6's Gluon API, not {triton.__version__}")
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    r = subprocess.run(
        [sys.executable, "-c", _SEESAW], capture_output=True, text=True, env=env, timeout=600
    )
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(rows) == 2
    for row in rows:
        print({k: v for k, v in row.items() if k != "ttgir"})
        assert row["warps"] == 12 and row["registers"] * 384 <= 65536, row
        assert row["spill"] == 0 and row["shared"] <= SM90.shared_per_cta, row
        assert 240 in row["setmaxnreg"] and 24 in row["setmaxnreg"], row["setmaxnreg"]
        # (counted by shape in the SASS text)
        assert row["hgmma"] == {"64x64x16": 2 * 576 // 16, "64x256x16": 2 * 2 * 4}, row["hgmma"]
        assert row["mma_macs"] == 3 * 64 * 128 * (576 + 512)
        assert row["sass"].get("UTMALDG", 0) > 0 and row["ttgir"]["tma_copies"] > 0
        assert not any(k.startswith("LDGSTS") for k in row["sass"])
        assert len(row["waits"]) == len(row["ttgir"]["wgmma_pendings"]), row["waits"]


# The device route's compile on one backend: ``local``, or ``nvshmem`` against NVSHMEM's device
# bitcode (linking it costs ~3 s of a CPU a kernel: those compiles, of the opt-in backend no
# default path launches, are in the long tier, by the ``nvshmem_device_bitcode`` fixture).
_ROUTE = """
import json
from mqnc.transport.device_route import compile_device_route
print(json.dumps(compile_device_route(90, nvshmem={nvshmem}, fp8={fp8})))
"""


def _route_compile(*, nvshmem: bool, fp8: bool) -> dict:
    r = _run_script(_ROUTE.format(nvshmem=nvshmem, fp8=fp8), timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def _check_route(kernels: dict, nvshmem: bool) -> None:
    assert len(kernels) == 12, sorted(kernels)
    for name, res in kernels.items():
        print(f"{name}: {res}")
        assert res["stack"] == 0 and res["local"] == 0, f"{name} spills: {res}"
        assert res["registers"] <= 255 and res["shared"] <= SM90.shared_per_cta, res
        if name.startswith(("route_wait", "route_merge")):
            # (the requester's one-CTA wait and per-row merge: 28-32 registers, 3.6.0 and 3.9.0)
            assert res["registers"] <= 48 and res["shared"] <= 256, (name, res)
        if name.startswith(("route_take", "route_reply", "route_gather")):
            # (the pass's take, vectors over the slots, and its row copies: 64-80 registers)
            assert res["registers"] <= 128 and res["shared"] <= 256, (name, res)
        if not nvshmem:
            assert res["calls"] == [], name
        elif not name.startswith(("route_merge", "route_wait", "route_take", "route_gather")):
            assert {"nvshmemx_putmem_signal_nbi_block", "nvshmem_fence"} <= set(res["calls"])


def test_device_route_kernels_compile_without_spills():
    """The device route's kernels (the holder kernel dense and sparse, one-shot and persistent;
    the requester's put, dense and sparse; the wait and the merge; the pass's take, one-shot and
    persistent, its gather and its reply) compile for sm_90 at their
    launches' values without spills, on the ``local`` backend (no NVSHMEM call)."""
    _check_route(_route_compile(nvshmem=False, fp8=False), nvshmem=False)


def test_device_route_kernels_compile_without_spills_over_nvshmem(nvshmem_device_bitcode):
    """The same twelve kernels on the ``nvshmem`` backend (where NVSHMEM's device bitcode is
    installed): the same bounds, and the variants call NVSHMEM's block-scope put (with signal),
    fence and (persistent holder, put) quiet. Long tier (the bitcode's link)."""
    _check_route(_route_compile(nvshmem=True, fp8=False), nvshmem=True)


def _check_fp8_holder(kernels: dict) -> None:
    assert len(kernels) == 4, sorted(kernels)
    for name, res in kernels.items():
        print(f"triton {triton.__version__} {name}: {res}")
        assert name.startswith("holder_loop-fp8[bfloat16,"), name
        assert res["stack"] == 0 and res["local"] == 0, f"{name} spills: {res}"
        assert res["registers"] <= 255 and res["shared"] <= SM90.shared_per_cta, res


def test_device_holder_kernel_over_fp8_entries_compiles_without_spills():
    """The holder kernel's FP8 variants (656-byte entries read in place, bf16 slots; dense and
    sparse, one-shot and persistent; ``local``) compile for sm_90 at their launch values
    (``route.holder_loop.fp8_holder_tile``: 16 x 16, on 8 warps under triton 3.6, 4 under 3.9)
    without spills."""
    _check_fp8_holder(_route_compile(nvshmem=False, fp8=True))


def test_device_holder_kernel_over_fp8_entries_compiles_without_spills_over_nvshmem(
    nvshmem_device_bitcode,
):
    """The same four FP8 variants on the ``nvshmem`` backend, where NVSHMEM's device bitcode is
    installed. Long tier (the bitcode's link)."""
    _check_fp8_holder(_route_compile(nvshmem=True, fp8=True))


_FP8_QUANT = """
import json, torch
from mqnc.triton_kernels.sm90.compile import compile_launch, resources
from mqnc.triton_kernels.fp8.quant import dequantize_launch, quantize_launch
rows = []
N = 4096  # a 4096-token chunk of one layer, DeepSeek-V3.2's 512 + 64 (656-byte entries)
for dt in (torch.bfloat16, torch.float32):
    x = torch.empty(N, 576, dtype=dt)
    c = torch.empty(N, 656, dtype=torch.uint8)
    for ln in (quantize_launch(x, 512, c), dequantize_launch(c, 512, 64, x)):
        k = compile_launch(ln.kernel, ln.args, ln.kwargs, grid=ln.grid)
        r = resources(ln.name, k)
        ptx = k.asm["ptx"]
        rows.append([ln.name, r.registers, r.stack + r.local, r.shared,
                     "div.full.f32" in ptx, ptx.count("st.global.v4.b32")])
print(json.dumps(rows))
"""


def test_fp8_quantizer_compiles_for_sm90_without_spills():
    """The FP8 cache quantizer and its inverse compile for sm_90 at their launch values (4096
    rows of 512 + 64, bf16 and fp32 rows) without spills, under this triton (3.6.0 is the GPU's:
    ``.venv-compat``); the scale's ``amax / 448`` is the IEEE division (``div.rn``: the scale
    must be bit-exact, ``div.full`` is approximate) and the rows are written with 16-byte
    stores."""
    r = _run_script(_FP8_QUANT, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(r.stdout.strip().splitlines()[-1])
    for name, regs, spill, shared, _, _ in rows:
        print(f"{name}: {regs} regs, {spill} B spilled, {shared} B shared")
    assert len(rows) == 4
    assert [row for row in rows if row[2] or row[3] > SM90.shared_per_cta] == []
    assert [row[0] for row in rows if row[4] or row[5] < 4] == []


_FP8_SPLICE = """
import json, re
import torch
from mqnc.triton_kernels.sm90.compile import compile_launch, resources
from mqnc.triton_kernels.splice.rotate import (
    PlainRope, fp8_entry_views, persistent_splice, splice_launch,
)
rope = PlainRope(tuple(10000.0 ** (-i / 32) for i in range(32)), 64, "interleaved")
freq = torch.tensor(rope.inv_freq, dtype=torch.float64)
L, T, bs = 27, 2048, 64
chunk = torch.zeros(L, T, 656, dtype=torch.uint8)
pool = torch.zeros(L, 2 * T // bs, bs, 656, dtype=torch.uint8)
src, dst, unit = fp8_entry_views(chunk, pool, rope)
rows = []
for delta in (7, torch.zeros(T, dtype=torch.int64)):
    for persistent in (False, True):
        ln = splice_launch(src, dst, torch.arange(T), delta, freq, T, L, bs, src.stride()[:2],
                           dst.stride()[:3], rope, persistent=persistent, row_unit=unit,
                           entries="fp8_e4m3")
        c = compile_launch(ln.kernel, ln.args, ln.kwargs, grid=ln.grid)
        r = resources(ln.name, c)
        v4 = len(re.findall(r"st\\.global(?:\\.\\w+)*\\.v4", c.asm["ptx"]))
        rows.append([ln.name, unit, r.registers, r.stack + r.local, v4])
print(json.dumps(rows))
"""


def test_fp8_splice_compiles_for_sm90_without_spills():
    """The FP8 splice (the 16-bit splice kernel over 656-byte entries read as 328 bf16, its
    strides passed in 16-byte units) at the goal shape (27 layers x 2048 tokens, one delta and
    a delta per token, default and persistent grid) compiles for sm_90 without spills, and its
    latent-and-scale copy keeps 128-bit stores (three per row tile: 264 of the 328 values)."""
    r = _run_script(_FP8_SPLICE, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(r.stdout.strip().splitlines()[-1])
    for name, unit, regs, spill, v4 in rows:
        print(f"triton {triton.__version__} {name}: {regs} regs, {spill} B spilled, {v4} v4 stores")
        assert name.startswith("splice[fp8_e4m3,") and unit == 8
        assert spill == 0 and regs <= 64, (name, regs, spill)
        assert v4 >= 3, (name, v4)


def test_fp8_variants_are_compiled_at_the_goal_heads():
    """The FP8 cache's launches (``sm90.variants.FP8``: 656-byte entries, bf16 queries) are among
    the compiled variants (so the spill, double-buffering, schedule and occupancy-table checks
    above cover them): dense at 16, 64 and 128 heads, sparse top-2048 at 64 and 128."""
    from mqnc.triton_kernels.sm90.variants import FP8

    heads = {(s.op, s.H, s.ct if s.op == "mla_sparse" else None) for s in FP8}
    for want in (("mla_decode", 16, None), ("mla_decode", 64, None), ("mla_decode", 128, None),
                 ("mla_sparse", 64, 2048), ("mla_sparse", 128, 2048)):  # fmt: skip
        assert want in heads, want
    fp8 = [v for v in production_variants() if "-fp8[" in v.name]
    assert {v.name.split("[")[0] for v in fp8} == {"mla_decode-fp8", "mla_sparse-fp8"}
    assert all(v.name in VARIANTS and v.name.split("[")[1].startswith("bfloat16,") for v in fp8)


_FP8_SWEEP = """
import json
from mqnc.triton_kernels.sm90.compile import compile_launch, resources
from mqnc.triton_kernels.mla.plan import FP8_SWEEP_TILES, forced_tile
from mqnc.triton_kernels.sm90.variants import Shape, shape_launches
rows = []
for kind, tiles in FP8_SWEEP_TILES.items():
    sparse = kind == "sparse"
    op, n = ("mla_sparse", 2048) if sparse else ("mla_decode", 8192)
    for tile in tiles:
        for B in (1, 64):  # split (fp32 partials) and unsplit (bf16 out)
            with forced_tile(tile, sparse=sparse):
                ln = shape_launches(Shape(op, B=B, H=128, ct=n, fp8=True))[0]
            r = resources(ln.name, compile_launch(ln.kernel, ln.args, ln.kwargs, grid=ln.grid))
            rows.append([tile.label, ln.name, r.registers, r.stack + r.local, r.shared])
print(json.dumps(rows))
"""


def test_fp8_sweep_candidates_compile_without_spills_under_triton_3_6():
    """Every FP8 candidate of a GPU sweep (``mla.plan.FP8_SWEEP_TILES``: classic and
    restructured tiles over 656-byte entries, bf16 queries) compiles for sm_90 under triton 3.6
    (the GPU's) at 128 heads, split and unsplit, without spills and within a CTA's shared
    memory. Other tritons skip (as for the 16-bit sweep)."""
    if not triton.__version__.startswith("3.6."):
        pytest.skip(f"the sweep runs under triton 3.6 on the GPU, this is {triton.__version__}")
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    r = subprocess.run(
        [sys.executable, "-c", _FP8_SWEEP], capture_output=True, text=True, env=env, timeout=900
    )
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(r.stdout.strip().splitlines()[-1])
    for tile, name, regs, spill, shared in rows:
        print(f"{tile}: {name} {regs} regs, {spill} B spilled, {shared} B shared")
    assert all("-fp8[" in row[1] for row in rows)
    assert [row for row in rows if row[3] or row[4] > SM90.shared_per_cta] == []


_FP8_SEESAW = """
import collections, json, re
from mqnc.triton_kernels.sm90.compile import _cuobjdump, resources
from mqnc.triton_kernels.sm90.gluon_compile import compile_fp8_seesaw
rows = []
for kw in (dict(rows=64, heads=128, num_splits=1),
           dict(rows=16, heads=16, num_splits=8, blocks=512),
           dict(rows=4, heads=128, num_splits=2, s_q=2),
           dict(rows=8, heads=128, num_splits=4, page=16, blocks=12),
           dict(rows=8, heads=128, topk=2048, num_splits=4),
           dict(rows=1, heads=128, topk=2048, num_splits=1, page=1)):
    for name, c in compile_fp8_seesaw(**kw):
        r = resources(name, c)
        row = [name, r.registers, r.stack + r.local, r.shared, r.num_warps]
        if name.startswith("mla_"):
            sass = _cuobjdump(c.asm["cubin"], "-sass")
            row.append(dict(collections.Counter(re.findall(r"HGMMA\\.(\\d+x\\d+x\\d+)", sass))))
            row.append(len(re.findall(r"F2FP\\.F16\\.E4M3\\.UNPACK_B", sass)))
            row.append(sorted(set(int(x) for x in re.findall(
                r"setmaxnreg\\.(?:inc|dec)\\.sync\\.aligned\\.u32\\s+(\\d+)", c.asm["ptx"]))))
        rows.append(row)
print(json.dumps(rows))
"""

# The FP8 see-saw's launches (opt-in until a GPU verifies them), compiled under triton 3.6.0:
# name -> (registers at launch, shared bytes, warps); the see-saw's 222,624 B plus 2 KB of
# scales, one CTA per SM.
FP8_SEESAW_PINS = {
    "mla_decode_gluon[bfloat16,fp8,64x64,seesaw-fp8,w4+4+4,out=bf16]": (168, 224704, 12),
    "mla_decode_gluon[bfloat16,fp8,64x64,seesaw-fp8,w4+4+4,out=fp32-split]": (168, 224704, 12),
    "mla_decode_gluon[bfloat16,fp8,64x64,seesaw-fp8,w4+4+4,out=fp32-split,sq=2,causal]": (
        168,
        224704,
        12,
    ),  # fmt: skip
    "mla_sparse_gluon[bfloat16,fp8,64x64,seesaw-fp8-gather,w4+4+4,out=fp32-split]": (
        168,
        224704,
        12,
    ),  # fmt: skip
    "mla_sparse_gluon[bfloat16,fp8,64x64,seesaw-fp8-gather,w4+4+4,out=bf16]": (168, 224704, 12),
    "sparse_compact": (54, 128, 4),
}


def test_the_fp8_seesaw_compiles_for_sm90_pinned():
    """The FP8 see-saw (DeepSeek-V3.2's 656-byte entries; opt-in until a GPU run verifies it)
    compiles for sm_90 under triton 3.6.0 as a run makes each launch: dense over a padded
    table (FlashMLA's 128 heads unsplit, the 16-head row split 8 ways, ``s_q`` 2 causal, pages
    of 16), sparse top-2048 split and unsplit over a token pool, without spills, at the pinned
    registers, shared memory (the see-saw's plus 2 KB of scales: one CTA per SM) and warps.
    Its consumers are the see-saw's (the same HGMMA count: 72 of 64x64x16 for ``QK^T``, 16 of
    64x256x16 for ``PV``), the dequantizing warpgroup converts with the hardware's e4m3 unpack
    (no emulated conversion) and the register split is the see-saw's (240 for each consumer
    warpgroup, 32 for the dequantizing one)."""
    if not triton.__version__.startswith("3.6."):
        pytest.skip(f"the Gluon kernel targets triton 3.6's Gluon API, not {triton.__version__}")
    r = _run_script(_FP8_SEESAW, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(r.stdout.strip().splitlines()[-1])
    seen = {}
    for name, regs, spill, shared, warps, *sass in rows:
        print(f"triton {triton.__version__} {name}: {regs} regs, {spill} B spilled, {shared} B")
        assert spill == 0, (name, spill)
        assert shared <= SM90.shared_per_cta, (name, shared)
        seen[name] = (regs, shared, warps)
        if sass:
            hgmma, unpack, maxnreg = sass
            assert hgmma == {"64x64x16": 72, "64x256x16": 16}, (name, hgmma)
            assert unpack > 0, name
            assert {32, 240} <= set(maxnreg), (name, maxnreg)
    assert seen == FP8_SEESAW_PINS
