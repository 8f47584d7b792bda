"""Static performance report of the kernels at the goal shapes, compiled for sm_90 exactly as
launched. Every time in it is a PREDICTION, not a measurement.

``mqnc kernel-report [--out FILE] [--ops mla_decode,merge] [--measured RESULTS]
[--kv-dtype bf16|fp8|both]`` (or ``python -m mqnc.measure.kernel_report ...``, the same).

For each goal shape (``mqnc.triton_kernels.sm90.variants.GOALS``) and each launch the op makes there
(an MLA call: the attention kernel, then the combine when split), it compiles the launch through
Triton's own launch path for sm_90 (``sm90.compile.compile_launch``: same specialisation, constexprs
and options as the real launch; no GPU needed) and reports:

- ``regs`` / ``spill`` (stack + local bytes) / ``smem`` from the cubin (cuobjdump) and metadata;
- ``cta/sm``: CTAs resident per SM at those resources (``_core.grid.Occupancy``, sm_90 limits),
  ``ctas`` in the grid the launcher plans at that occupancy, ``waves`` of ``132 * cta/sm``, and
  ``fill``, the fraction of the waves' CTA slots the grid uses;
- ``MB``: the bytes the launch must move to or from DRAM once (the cache entries a token's
  programs share are counted once: its head blocks run side by side and share them through L2);
- the load and MMA mix from the SASS: ``LDGSTS`` (cp.async, all widths), ``LDG128`` (16-byte
  loads), ``LDG<128`` (narrower ones), ``TMA`` (UTMALDG), ``HMMA``, ``HGMMA``;
- an MLA attention launch's schedule (``sm90.compile.mla_evidence``): ``mma/64`` tensor-core
  instructions a CTA issues per 64 cache entries, ``ideal/64`` the ideal tile's (``BLOCK_H x
  BLOCK_N x 576`` for ``QK^T`` plus ``x 512`` for ``PV``, in ``HGMMA.64xNx16`` units),
  ``redund`` issued over ideal multiply-accumulates (1.0: no warpgroup recomputes another's
  ``QK^T``), ``wg_waits`` the wgmma waits leaving work in flight over all of them;
- what decides the memory-bound numbers, per MLA attention launch: ``ring``, the KV tiles in
  its shared-memory ring (``sm90.compile.ring_depth``, from the TTGIR's allocations: 2 = one tile
  in flight while one is attended), ``chain``, the longest chain of dependent global reads
  (``sm90.compile.read_chain``, counted on the TTGIR's SSA def-use graph, each read whose address,
  coordinates or mask come from the one before: 3 for the dense kernel's length, page id, KV
  tile; 2 for the sparse kernel's indices, KV tile), ``TMA`` (above), ``cta_per_sm`` and
  ``grid/SMs``, the grid's CTAs over sm_90's 132 SMs;
- ``pred_us = MB / ceiling / fill``: the time at the memory ceiling (``--ceiling-tbps``; else the
  measured device's kernel-measured read ceiling in ``--measured``
  (:func:`mqnc.cost.ceilings.memory_ceiling`: the median of ``perf/bench_copy``'s exact Triton read
  records), else the median of its torch ``copy`` records (2.71 TB/s on the H200 that ran it);
  else 4.3 TB/s, the H200 copy ceiling the goal shapes were set against) when the SMs in use
  stream at their share of it (``fill``: the used fraction of the waves' CTA slots, or, for a grid
  of less than one wave, of the 132 SMs, since the CTAs spread one per SM first); a shape's total
  adds ``LAUNCH_US`` (2 us) per
  dependent launch after the first, and ``pct_of_ceiling`` is the op's essential bytes (cache,
  queries, outputs: what the benchmarks' GB/s count, not the split partials) at the ceiling
  over it.

``--kv-dtype fp8`` reports the FP8 cache's shapes instead (:data:`FP8_SHAPES`: the FP8 twins of
the holder partial, the FP8 goals' shapes and the H 128 ones, each ``fp8`` in its label; the
launches read 656-byte entries, ``b_KV`` of DeepSeek-V3.2's format, so ``MB`` and ``pred_us``
count 656 B per cache token), ``--kv-dtype both`` the goal shapes and those, with a table of
each FP8 shape against its bf16 twin: predicted times and their ratio (the cache tokens per
second FP8 gains at the read ceiling), and with ``--measured`` the measured ones. The default
is ``bf16``, the goal shapes alone.

``--candidates all`` (or a comma list of labels) adds the launch rows of the next sweep's
candidate tiles (``mla.plan.SWEEP_TILES``: the restructured ``-pipe`` / ``-tma`` / ``-fused``
kernels, the 16-head two-CTA tiles) at their kind's shapes (:data:`CANDIDATE_SHAPES`), planned
inside ``forced_tile`` as the sweep runs them, each ``"candidate": true`` with its ``tile``.

Records are JSON lines (one per launch, ``"kind": "launch"``, and one per shape, ``"shape"``)
appended to ``--out`` (default ``out/kernel_report.jsonl`` under the working directory,
untracked in the repository; never the benchmarks' ``perf/results/results.jsonl``).
``--measured FILE`` joins the p50 of benchmark records whose ``extra.shape`` is a goal shape's
label (what ``--goals`` sweeps record) into the table: GPU-timed records only
(``extra.timing.method`` not ``host-clock``), of one device (the last such record's), at the
launcher's own tile (a tile sweep's forced tiles, ``extra.tile``, are left out); of several
records of a shape, the last; a record whose ``extra.launcher_tile`` is not the tile predicted
(the choice depends on the triton version) shows it beside its p50, ``(at ?)`` where the record
does not say (records older than that field).
Runs in compiled mode, ``TRITON_INTERPRET=0``, which it sets itself when the variable is unset (it
compiles; it never launches; on a CPU-only torch importing the kernels would otherwise choose the
interpreter); ``TRITON_INTERPRET=1`` is refused.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from mqnc.base.runtime import use_compiled_kernels
from mqnc.cost.ceilings import memory_ceiling
from mqnc.measure.options import positive_float
from mqnc.model.kv_format import kv_bytes_per_token

DEFAULT_OUT = Path("out") / "kernel_report.jsonl"
D_QK, D_V, PAGE = 576, 512, 64
FP8_ENTRY = kv_bytes_per_token("fp8_e4m3", D_V, D_QK - D_V)  # 656 B: DeepSeek-V3.2's entry
KV_DTYPES = ("bf16", "fp8", "both")

# The FP8 cache's shapes (``--kv-dtype fp8``): (op, B, H, c_t or top-k, goal). The holder
# partial, the FP8 goals' shapes (perf/speed_targets.py, FP8_TARGETS) and the H 128 dense one
# where the bf16 kernel is bound by its MMAs.
FP8_SHAPES = (
    ("mla_decode", 1, 16, 2048, ""),
    ("mla_decode", 16, 16, 32768, ">= 1.6x the bf16 cache tokens/s"),
    ("mla_decode", 8, 128, 32768, ""),
    ("mla_sparse", 1, 128, 2048, ""),
    ("mla_sparse", 8, 128, 2048, "no slower than bf16"),
)


def entry_bytes(shape) -> int:
    """Bytes of one cache entry of an MLA ``shape``: 656 for FP8 entries, else 576 bf16."""
    return FP8_ENTRY if getattr(shape, "fp8", False) else D_QK * 2


def fp8_shapes() -> list:
    """:data:`FP8_SHAPES` as ``sm90.variants.Shape`` s (``fp8=True``)."""
    from mqnc.triton_kernels.sm90.variants import Shape

    return [Shape(op, B=B, H=H, ct=n, goal=goal, fp8=True) for op, B, H, n, goal in FP8_SHAPES]


def launch_bytes(shape, index: int, launch) -> int:
    """DRAM bytes launch ``index`` of ``shape`` moves once (module docstring)."""
    elt = 2  # bf16
    if shape.op in ("mla_decode", "mla_sparse"):
        B, H, n = shape.B, shape.H, shape.ct
        splits = launch.grid[1] if index == 0 else None  # grid (row blocks, splits)
        rows = B * H
        part = rows * (D_V * 4 + 4)  # one split's fp32 partials
        if index == 1:  # the combine: read every split's partials, write the outputs
            m = launch.args[0].shape[0]  # the merge's o [M, B, H, D]
            return m * part + rows * (D_V * elt + 4)
        index_bytes = B * (n // PAGE if shape.op == "mla_decode" else n) * 4
        out = rows * (D_V * elt + 4) if splits == 1 else splits * part
        return B * n * entry_bytes(shape) + index_bytes + rows * D_QK * elt + out
    if shape.op == "merge":
        rows = shape.B * shape.H
        return shape.M * rows * (D_V * elt + 4) + rows * (D_V * elt + 4)
    if shape.op == "splice":
        per_token = 8 + (8 if shape.delta != "int" else 0)
        return 2 * shape.L * shape.ct * D_QK * elt + shape.ct * per_token
    rows = shape.B * shape.H
    return 2 * rows * D_QK * elt + (rows * 8 if shape.delta != "int" else 0)


def essential_bytes(shape) -> int:
    """The bytes the op itself needs (what the benchmarks' GB/s count): for an MLA call the
    cache entries, the query rows and the outputs, not the split-KV partials."""
    if shape.op in ("mla_decode", "mla_sparse"):
        rows = shape.B * shape.H
        return shape.B * shape.ct * entry_bytes(shape) + rows * D_QK * 2 + rows * (D_V * 2 + 4)
    return launch_bytes(shape, 0, None)


def _mix(sass: dict) -> dict:
    ldgsts = sum(v for k, v in sass.items() if k.startswith("LDGSTS"))
    narrow = sum(v for k, v in sass.items() if k.startswith("LDG.") and k != "LDG.128")
    return {
        "LDGSTS": ldgsts,
        "LDG128": sass.get("LDG.128", 0),
        "LDG<128": narrow,
        "TMA": sass.get("UTMALDG", 0),
        "HMMA": sass.get("HMMA", 0),
        "HGMMA": sass.get("HGMMA", 0),
    }


def _schedule(shape, index: int, launch, res) -> dict:
    """An MLA attention launch's static schedule (``sm90.compile.mla_evidence``): tensor-core
    instructions per CTA per 64 entries against the ideal tile's, their redundancy (issued over
    ideal multiply-accumulates: 1.0 = no recomputed ``QK^T``) and the wgmma waits that leave
    work in flight; None for the other launches."""
    keys = ("mma_per_64", "mma_ideal_per_64", "redundancy", "wgmma_waits", "ring", "read_chain")
    if not (shape.op.startswith("mla") and index == 0):
        return dict.fromkeys(keys)
    from mqnc.triton_kernels.sm90.compile import mla_evidence, tile_bodies

    kw = launch.kwargs
    ev = mla_evidence(res, kw["BLOCK_H"], kw["BLOCK_N"], D_QK, D_V, tile_bodies(kw))
    return {k: ev[k] for k in keys}


def _check_ops(ops) -> None:
    """``ops``: None (all) or a non-empty set of the goal shapes' op names (a ``ValueError``
    saying which are known)."""
    if ops is None:  # (no import: the names come from the kernels' module, torch and Triton)
        return
    from mqnc.triton_kernels.sm90.variants import GOALS

    known = sorted({s.op for s in GOALS})
    if not ops or set(ops) - set(known):
        raise ValueError(f"expected names out of {','.join(known)}, got {sorted(ops)}")


def _ops_arg(text: str) -> set[str]:
    """``--ops``: the comma list as a set (checked by :func:`run` once the kernel mode is
    chosen: the names come from the kernels' module, whose import would choose it)."""
    return {t.strip() for t in text.split(",") if t.strip()}


DEFAULT_CEILING_TBPS = 4.3  # the goals' H200 copy ceiling, where no measured one is given


class _Compiled:
    """Each variant compiled once for ``arch``: ``(resources, occupancy)`` by launch name."""

    def __init__(self, arch: int) -> None:
        self.arch = arch
        self._seen: dict[str, tuple] = {}

    def __call__(self, launch) -> tuple:
        from mqnc.triton_kernels._core.grid import Occupancy
        from mqnc.triton_kernels.sm90.compile import compile_launch, resources

        if launch.name not in self._seen:
            k = compile_launch(
                launch.kernel, launch.args, launch.kwargs, grid=launch.grid, arch=self.arch
            )
            res = resources(launch.name, k)
            occ = Occupancy(res.registers, 32 * res.num_warps, res.shared)
            self._seen[launch.name] = (res, occ)
        return self._seen[launch.name]


def _plan(shape, compiled: _Compiled) -> list:
    """The shape's launches planned at the occupancy this triton really compiles (not the
    checked-in table): first with the default plan to find the split variant, then again at
    its compiled occupancy."""
    from mqnc.triton_kernels._core.grid import Occupancy
    from mqnc.triton_kernels.sm90.variants import shape_launches

    first = shape_launches(shape)
    occ = compiled(first[0])[1] if shape.op.startswith("mla") else None
    if occ is not None:
        split = [ln for ln in first if "fp32-split" in ln.name]
        if split:
            occ = compiled(split[0])[1]
        else:  # the planned split variant, compiled to read its occupancy
            probe = shape_launches(shape, Occupancy(255, 256, 0))  # 1 CTA/SM: splits
            probe_split = [ln for ln in probe if "fp32-split" in ln.name]
            occ = compiled(probe_split[0])[1] if probe_split else occ
    return shape_launches(shape, occ) if occ is not None else first


def _launch_row(shape, i: int, launch, compiled: _Compiled, ceiling_tbps: float) -> tuple:
    """The prediction of the ``i``-th launch of ``shape``: its waves over sm_90's SMs at its
    compiled occupancy, and its bytes at the copy ceiling scaled by the share of SMs it fills.
    Returns ``(row, predicted us unrounded)``."""
    from mqnc.triton_kernels._core.grid import SM90, waves

    res, o = compiled(launch)
    per_sm = o.ctas_per_sm(SM90)
    slots = SM90.sms * per_sm
    ctas = launch.programs
    w = waves(ctas, slots)
    # Less than a wave spreads one CTA per SM first: the SMs in use set the share.
    fill = ctas / (w * slots) if ctas >= slots else min(ctas, SM90.sms) / SM90.sms
    nbytes = launch_bytes(shape, i, launch)
    pred = nbytes / (ceiling_tbps * 1e6) / fill
    row = {
        "kind": "launch",
        "shape": shape.label,
        "op": shape.op,
        "variant": launch.name,
        "regs": res.registers,
        "spill": res.stack + res.local,
        "smem": res.shared,
        "cta_per_sm": per_sm,
        "ctas": ctas,
        "grid": list(launch.grid),
        "grid_per_sms": round(ctas / SM90.sms, 2),
        "waves": w,
        "fill": round(fill, 3),
        "bytes": nbytes,
        **_mix(res.sass),
        **_schedule(shape, i, launch, res),
        "pred_us": round(pred, 2),
        "triton": res.triton,
        "ceiling_tbps": ceiling_tbps,
        "prediction": True,
    }
    return row, pred


def _shapes(kv_dtype: str) -> list:
    """The shapes of cache format ``kv_dtype``: ``bf16`` the goal shapes, ``fp8``
    :func:`fp8_shapes`, ``both`` the two lists."""
    from mqnc.triton_kernels.sm90.variants import GOALS

    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype: expected one of {', '.join(KV_DTYPES)}, got {kv_dtype!r}")
    return [*(GOALS if kv_dtype != "fp8" else ()), *(fp8_shapes() if kv_dtype != "bf16" else ())]


def report(
    ops=None, ceiling_tbps: float = DEFAULT_CEILING_TBPS, arch: int = 90, kv_dtype: str = "bf16"
):
    """Compile and predict every shape of cache format ``kv_dtype`` (:func:`_shapes`: the goal
    shapes by default); returns (launch rows, shape rows)."""
    from mqnc.triton_kernels._core.grid import LAUNCH_US
    from mqnc.triton_kernels.mla.plan import TileConfig

    try:
        _check_ops(ops)
    except ValueError as exc:
        raise ValueError(f"ops: {exc}") from None
    compiled = _Compiled(arch)
    launches_out, shapes_out = [], []
    for shape in _shapes(kv_dtype):
        if ops and shape.op not in ops:
            continue
        plan = _plan(shape, compiled)
        total_us, total_bytes = 0.0, 0
        for i, launch in enumerate(plan):
            row, pred = _launch_row(shape, i, launch, compiled, ceiling_tbps)
            launches_out.append(row)
            total_us += pred + (LAUNCH_US if i else 0.0)  # each launch after the first: its latency
            total_bytes += row["bytes"]
        shapes_out.append(
            {
                "kind": "shape",
                "shape": shape.label,
                "op": shape.op,
                "goal": shape.goal,
                "launches": len(plan),
                "tile": TileConfig.of_launch(plan[0]).label if shape.op.startswith("mla") else None,
                "bytes": total_bytes,
                "pred_us": round(total_us, 2),
                "essential_bytes": essential_bytes(shape),
                "kv_dtype": "fp8" if getattr(shape, "fp8", False) else "bf16",
                "pct_of_ceiling": round(
                    100 * essential_bytes(shape) / (ceiling_tbps * 1e6) / total_us, 1
                ),
                "triton": launches_out[-1]["triton"],
                "prediction": True,
            }
        )
    return launches_out, shapes_out


# The shapes each kind of sweep candidate (``mla.plan.SWEEP_TILES``) is reported at: the
# 128-head goals (and FlashMLA's benchmark shape), the sparse top-2048 ones, and the 16-head
# memory-bound ones (B >= 16 at c_t 32768; the one-row holder partial).
CANDIDATE_SHAPES = {
    "dense": (("mla_decode", 64, 128, 8192), ("mla_decode", 8, 128, 32768),
              ("mla_decode", 128, 128, 4096)),
    "sparse": (("mla_sparse", 1, 128, 2048), ("mla_sparse", 8, 128, 2048)),
    "dense16": (("mla_decode", 16, 16, 32768), ("mla_decode", 1, 16, 2048)),
}  # fmt: skip


def candidates(
    tiles=None, ops=None, ceiling_tbps: float = DEFAULT_CEILING_TBPS, arch: int = 90
) -> list[dict]:
    """The launch rows of every sweep candidate (``tiles``: a set of labels, None: all) at its
    kind's shapes (:data:`CANDIDATE_SHAPES`; ``ops`` keeps those ops only), planned inside
    ``forced_tile`` as the sweep runs them; each row ``"candidate": True`` with its ``tile``
    (the default tile of a shape is among them: its row is the production one)."""
    from mqnc.triton_kernels.mla.plan import SWEEP_TILES, forced_tile
    from mqnc.triton_kernels.sm90.variants import Shape

    compiled = _Compiled(arch)
    rows = []
    for kind, kind_tiles in SWEEP_TILES.items():
        for tile in kind_tiles:
            if tiles is not None and tile.label not in tiles:
                continue
            for op, B, H, ct in CANDIDATE_SHAPES[kind]:
                if ops and op not in ops:
                    continue
                shape = Shape(op, B=B, H=H, ct=ct)
                with forced_tile(tile, sparse=op == "mla_sparse"):
                    plan = _plan(shape, compiled)
                for i, launch in enumerate(plan):
                    row, _ = _launch_row(shape, i, launch, compiled, ceiling_tbps)
                    rows.append({**row, "candidate": True, "tile": tile.label})
    return rows


def _measured(path: str) -> tuple[dict[str, tuple], tuple[float, str] | None, str | None]:
    """``({goal label: (p50, the launcher's tile or None)}, (ceiling TB/s, its source) or None,
    device or None)`` from a results file (see the module docstring: one device's GPU-timed
    records at the launcher's own tiles)."""
    recs = []
    with open(path) as f:
        for line in f:
            if line.strip():
                rec = json.loads(line)
                extra = rec.get("extra") or {}
                if (extra.get("timing") or {}).get("method", "host-clock") != "host-clock":
                    recs.append(rec)
    if not recs:
        return {}, None, None
    device = recs[-1].get("device")
    recs = [r for r in recs if r.get("device") == device]
    out = {}
    for rec in recs:
        extra = rec["extra"]
        if extra.get("shape") and rec.get("backend") == "triton" and "tile" not in extra:
            out[extra["shape"]] = (rec["p50"], extra.get("launcher_tile"))
    ceilings = memory_ceiling(recs, device)
    if ceilings.read_tbps:
        return out, (ceilings.read_tbps, f"{device}'s read ceiling (perf/bench_copy)"), device
    if ceilings.torch_copy_tbps:
        return out, (ceilings.torch_copy_tbps, f"{device}'s copy records"), device
    return out, None, device


def format_table(launches: list[dict], shapes: list[dict], measured: dict | None = None) -> str:
    cols = (
        "shape",
        "variant",
        "regs",
        "spill",
        "smem",
        "cta_per_sm",
        "ctas",
        "waves",
        "fill",
        "bytes",
        "LDGSTS",
        "LDG128",
        "LDG<128",
        "TMA",
        "HMMA",
        "HGMMA",
        "mma_per_64",
        "mma_ideal_per_64",
        "redundancy",
        "wgmma_waits",
        "ring",
        "read_chain",
        "grid_per_sms",
        "pred_us",
    )
    names = {
        "bytes": "MB",
        "mma_per_64": "mma/64",
        "mma_ideal_per_64": "ideal/64",
        "redundancy": "redund",
        "wgmma_waits": "wg_waits",
        "read_chain": "chain",
        "grid_per_sms": "grid/SMs",
    }
    head = "| " + " | ".join(names.get(c, c) for c in cols) + " |"
    lines = [head, "|" + "---|" * len(cols)]
    for r in launches:
        vals = [f"{r[c] / 1e6:.2f}" if c == "bytes" else str(r.get(c, "-")) for c in cols]
        vals = [v if v != "None" else "-" for v in vals]
        vals[4] = f"{r['smem'] // 1024}K"
        lines.append("| " + " | ".join(vals) + " |")
    lines += ["", "| shape | goal | launches | MB | pred_us | % of ceiling | measured p50 us |"]
    lines.append("|---|---|---|---|---|---|---|")
    for s in shapes:
        got = (measured or {}).get(s["shape"])
        cell = "-"
        if got is not None:  # a record of another tile than the one predicted says so
            p50, tile = got
            if s.get("tile") and tile != s["tile"]:  # (records before launcher_tile: "?")
                cell = f"{p50:.1f} (at {tile or '?'})"
            else:
                cell = f"{p50:.1f}"
        lines.append(
            f"| {s['shape']} | {s['goal']} | {s['launches']} | {s['bytes'] / 1e6:.2f} | "
            f"{s['pred_us']} | {s['pct_of_ceiling']} | {cell} |"
        )
    return "\n".join(lines)


def format_matrix(shapes: list[dict]) -> str:
    """Dense decode at a glance: predicted us (% of the ceiling) per H, B (rows) and c_t."""
    dense = {}
    for s in shapes:
        if s["op"] == "mla_decode" and s.get("kv_dtype", "bf16") == "bf16":
            f = dict(kv.split("=") for kv in s["shape"].split()[1:])
            dense[(int(f["H"]), int(f["B"]), int(f["ct"]))] = s
    cts = sorted({k[2] for k in dense})
    lines = ["| H | B | " + " | ".join(f"c_t {c}" for c in cts) + " |"]
    lines.append("|---|---|" + "---|" * len(cts))
    for H, B in sorted({k[:2] for k in dense}):
        cells = [dense.get((H, B, c)) for c in cts]
        vals = [f"{x['pred_us']} us ({x['pct_of_ceiling']:.0f}%)" if x else "-" for x in cells]
        lines.append(f"| {H} | {B} | " + " | ".join(vals) + " |")
    return "\n".join(lines)


def _bf16_label(label: str) -> str:
    """The bf16 twin's label of an FP8 shape's (``... fp8``)."""
    return label[: -len(" fp8")] if label.endswith(" fp8") else label


def format_fp8(shapes: list[dict], measured: dict | None = None) -> str:
    """Each FP8 shape against its bf16 twin (both in ``shapes``): the predicted times and their
    ratio (bf16 over FP8: the cache tokens per second FP8 gains), and the measured p50s and
    their ratio where ``measured`` has both (``-`` where not)."""
    by_label = {s["shape"]: s for s in shapes}
    got = measured or {}
    lines = [
        "| FP8 shape | goal | bf16 pred us | fp8 pred us | pred ratio | bf16 p50 us | fp8 p50 us "
        "| measured ratio |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for s in shapes:
        twin = by_label.get(_bf16_label(s["shape"]))
        if s.get("kv_dtype") != "fp8" or twin is None:
            continue
        ratio = f"{twin['pred_us'] / s['pred_us']:.2f}x"
        m16, m8 = got.get(twin["shape"]), got.get(s["shape"])
        cells = [f"{m[0]:.1f}" if m else "-" for m in (m16, m8)]
        mratio = f"{m16[0] / m8[0]:.2f}x" if m16 and m8 else "-"
        lines.append(
            f"| {s['shape']} | {s['goal'] or '-'} | {twin['pred_us']} | {s['pred_us']} | {ratio} "
            f"| {cells[0]} | {cells[1]} | {mratio} |"
        )
    return "\n".join(lines)


def add_args(ap: argparse.ArgumentParser) -> None:
    """The report's options (``mqnc kernel-report``, ``python -m mqnc.measure.kernel_report``)."""
    ap.add_argument("--out", default=str(DEFAULT_OUT), help="JSON-lines file to append to")
    ap.add_argument(
        "--ops", type=_ops_arg, default=None, help="comma list: mla_decode,mla_sparse,merge,..."
    )
    ap.add_argument(
        "--ceiling-tbps",
        type=positive_float,
        default=None,
        help="memory ceiling, TB/s (default: the --measured device's read ceiling, else its copy "
        "records, else 4.3)",
    )
    ap.add_argument("--measured", default=None, help="benchmark results.jsonl to join")
    ap.add_argument(
        "--kv-dtype",
        choices=KV_DTYPES,
        default="bf16",
        help="cache format of the MLA shapes: bf16 (the goal shapes), fp8 (the FP8 cache's "
        "shapes, 656 B per token) or both (and each FP8 shape against its bf16 twin)",
    )
    ap.add_argument(
        "--candidates",
        default=None,
        help="also report the sweep's candidate tiles at their shapes: 'all' or a comma list "
        "of labels (e.g. 64x64w8s2-tma,16x32w8s2-pipe-fused)",
    )
    ap.add_argument("--arch", type=int, default=90)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_args(ap)
    return run(ap.parse_args(argv))


def run(args: argparse.Namespace) -> int:
    """Compile, predict, record and print (the options of :func:`add_args`)."""
    if not use_compiled_kernels():
        sys.exit("set TRITON_INTERPRET=0: the report compiles for a GPU target (it never launches)")
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    if args.measured and not Path(args.measured).is_file():  # (checked before the kernels load)
        print(f"kernel-report: error: --measured: no such file: {args.measured}", file=sys.stderr)
        return 2
    try:
        _check_ops(args.ops)  # before anything compiles or the output file is opened
    except ValueError as exc:
        print(f"kernel-report: error: --ops: {exc}", file=sys.stderr)
        return 2
    measured, found, device = _measured(args.measured) if args.measured else ({}, None, None)
    ceiling = args.ceiling_tbps or (found[0] if found else DEFAULT_CEILING_TBPS)
    launches, shapes = report(args.ops, ceiling, args.arch, args.kv_dtype)
    if not shapes:
        print(
            f"kernel-report: error: --ops: no shape of --kv-dtype {args.kv_dtype} has op "
            f"{','.join(sorted(args.ops or ()))} (the FP8 shapes are mla_decode, mla_sparse)",
            file=sys.stderr,
        )
        return 2
    extra = []
    if args.candidates:
        from mqnc.triton_kernels.mla.plan import SWEEP_TILES

        known = {t.label for tiles in SWEEP_TILES.values() for t in tiles}
        wanted = None if args.candidates == "all" else _ops_arg(args.candidates)
        if wanted is not None and (not wanted or wanted - known):
            print(
                f"kernel-report: error: --candidates: expected 'all' or labels out of "
                f"{','.join(sorted(known))}, got {args.candidates!r}",
                file=sys.stderr,
            )
            return 2
        extra = candidates(wanted, args.ops, ceiling, args.arch)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a") as f:
        for row in launches + shapes + extra:
            f.write(json.dumps(row) + "\n")
    source = (
        "--ceiling-tbps"
        if args.ceiling_tbps
        else found[1]
        if found
        else "the goals' H200 copy ceiling"
    )
    print(f"PREDICTIONS (sm_90, triton {launches[0]['triton']}, {ceiling:.3g} TB/s: {source}):")
    if args.measured:
        print(f"measured p50: {len(measured)} goal shapes of {device or 'no GPU-timed record'}")
    print(format_table(launches, shapes, measured))
    if any(s["op"] == "mla_decode" and s["kv_dtype"] == "bf16" for s in shapes):
        print("\nDense decode, predicted us (% of the ceiling):")
        print(format_matrix(shapes))
    if args.kv_dtype == "both":
        print("\nFP8 cache against bf16 (predicted at the ceiling; measured p50 where joined):")
        print(format_fp8(shapes, measured))
    if extra:
        print("\nSweep candidates (forced tiles) at their shapes:")
        print(format_table(extra, []).split("\n\n")[0])
    from mqnc.triton_kernels.dispatch import Target, table_text

    print(
        "\nWhich backend serves which case on sm_90 under this triton "
        "(mqnc.triton_kernels.dispatch; the predictions above are the tl kernels'):"
    )
    print(table_text(Target.sm90()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
