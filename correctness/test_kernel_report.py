"""The kernel report (``python -m mqnc.measure.kernel_report``, ``mqnc kernel-report``) runs on a
CPU machine (it compiles for sm_90, never launches) and records its predictions, labelled as such,
into the file it is given."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from preloaded import compiled_mode, run_module

ROOT = Path(__file__).resolve().parent.parent


def _env(interpret: str | None) -> dict[str, str]:
    """This environment with ``TRITON_INTERPRET`` set to ``interpret`` (None: unset; "0" is
    compiled mode, no launch, even on a CPU-only torch)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret is not None:
        env["TRITON_INTERPRET"] = interpret
    return env


# The compiled-mode runs: ``python -m`` each, alone in a child forked from one interpreter that
# imported torch, Triton and the kernels in compiled mode once (correctness/preloaded.py)
_COMPILED: list = []


@pytest.fixture(scope="module", autouse=True)
def _close_the_preloaded_interpreter():
    yield
    while _COMPILED:
        _COMPILED.pop().close()


def _report(module: str, *args: str, cwd=ROOT, interpret: str | None = "0"):
    """``python -m <module> <args>`` with ``TRITON_INTERPRET`` set to ``interpret``: "0" forked
    from the preloaded compiled-mode interpreter, otherwise a new Python (the mode is chosen at
    its start)."""
    if interpret == "0":
        if not _COMPILED:
            _COMPILED.append(compiled_mode())
        module, *sub = module.split()
        return run_module(_COMPILED[0], module, *sub, *args, timeout=600, cwd=cwd)
    return subprocess.run(
        [sys.executable, "-m", *module.split(), *args],
        capture_output=True,
        text=True,
        env=_env(interpret),
        cwd=cwd,
        timeout=600,
    )


def test_kernel_report_predicts_and_records(tmp_path):
    out = tmp_path / "report.jsonl"
    r = _report("mqnc.measure.kernel_report", "--ops", "merge,rotate", "--out", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "PREDICTIONS" in r.stdout and "| merge M=8 rows=256 | <= 8 us |" in r.stdout
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    launches = [x for x in rows if x["kind"] == "launch"]
    shapes = [x for x in rows if x["kind"] == "shape"]
    assert {s["shape"] for s in shapes} == {
        "merge M=8 rows=256",
        "merge M=2 rows=256",
        "rotate rows=256 delta=int",
        "rotate rows=256 delta=[T]",
    }
    for x in rows:
        assert x["prediction"] is True and x["pred_us"] > 0
    for x in launches:
        assert x["spill"] == 0 and 0 < x["fill"] <= 1 and x["cta_per_sm"] >= 1
        if x["op"] == "merge":
            assert x["LDG128"] > 0


def test_mqnc_kernel_report_subcommand(tmp_path):
    """``mqnc kernel-report`` is the same report (the CLI imports nothing of perf/); it chooses
    compiled mode itself when ``TRITON_INTERPRET`` is unset and refuses the interpreter."""
    out = tmp_path / "cli.jsonl"
    args = ("--ops", "rotate", "--out", str(out))
    r = _report("mqnc kernel-report", *args, cwd=tmp_path, interpret=None)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "PREDICTIONS" in r.stdout and "| rotate rows=256 delta=int |" in r.stdout
    assert "Which backend serves which case on sm_90" in r.stdout
    assert "mla_decode  gluon  mla_decode_gluon[seesaw]" in r.stdout
    assert {json.loads(x)["shape"] for x in out.read_text().splitlines()} == {
        "rotate rows=256 delta=int",
        "rotate rows=256 delta=[T]",
    }
    r = _report("mqnc kernel-report", *args, cwd=tmp_path, interpret="1")
    assert r.returncode != 0 and "set TRITON_INTERPRET=0" in r.stderr


def test_an_unknown_op_is_one_line_before_anything_compiles(tmp_path):
    out = tmp_path / "typo.jsonl"
    missing = tmp_path / "nope.jsonl"
    cases = [  # both front ends share the options and their checks: one of them past --ops
        ("mqnc kernel-report", ("--ops", "mla_decod"), "--ops: expected names out of merge,"),
        (
            "mqnc.measure.kernel_report",
            ("--ops", "mla_decod"),
            "--ops: expected names out of merge,",
        ),
        (
            "mqnc.measure.kernel_report",
            ("--ceiling-tbps", "0"),
            "--ceiling-tbps: expected a number > 0",
        ),
        ("mqnc.measure.kernel_report", ("--ceiling-tbps", "-1"), "expected a number > 0, got '-1'"),
        (
            "mqnc.measure.kernel_report",
            ("--ceiling-tbps", "inf"),
            "expected a finite number, got 'inf'",
        ),
        ("mqnc.measure.kernel_report", ("--measured", str(missing)), f"no such file: {missing}"),
    ]
    for module, args, message in cases:  # (before the kernels' compile, in compiled mode)
        r = _report(module, *args, "--out", str(out), cwd=ROOT)
        assert r.returncode == 2, r.stderr[-2000:]
        assert message in r.stderr, r.stderr[-2000:]
        assert "Traceback" not in r.stderr and not out.exists()


def test_mla_shapes_count_their_bytes_and_join_the_measured_p50(tmp_path):
    """The MLA rows of the report (the GPU check's ``report`` step failed on them once: a launch
    argument read by position after the launch's arguments had moved). A shape's bytes are the
    op's own (cache, page or index table, queries, outputs) plus, when split, each split's fp32
    partials written once and read once by the combine; ``--measured`` joins a record's p50:
    the last GPU-timed one of the last GPU's, at the launcher's own tile, and predicts at that
    GPU's median copy record."""
    measured = tmp_path / "results.jsonl"
    label = "mla_decode H=16 B=1 ct=2048"

    sparse, older = "mla_sparse H=128 B=1 topk=2048", "mla_decode H=16 B=2 ct=2048"

    def rec(p50, device="NVIDIA H200", method="cuda-graph", bench="mla_decode", **extra):
        timing = {"timing": {"method": method}}
        backend = extra.pop("backend", "triton")
        extra = {"shape": label, **extra, **timing}
        return {
            **{"bench": bench, "backend": backend, "p50": p50, "device": device},
            **{"gbps": extra.pop("gbps", None), "extra": extra},
        }

    recs = [
        rec(2.0, device="NVIDIA H100"),  # another GPU, before the H200's run
        rec(99.0),  # an older run of the same GPU: the last record wins
        rec(12.5, launcher_tile="16x64w8s5"),  # the tile the report predicts: no mark
        rec(12.9, shape=older),  # a record from before launcher_tile: its tile unknown
        rec(1.0, tile="64x32w8s3"),  # a forced tile of a sweep: not the launcher's
        rec(32.8, bench="mla_sparse", shape=sparse, launcher_tile="1024x16w8s5"),  # another tile
        *(
            rec(1.0, bench="copy", gbps=g, shape=None, backend="torch")
            for g in (2700.0, 2710.0, 9000.0)
        ),
        rec(3.0, method="host-clock", device="CPU"),  # interpreted on a CPU, last
    ]
    measured.write_text("".join(json.dumps(r) + "\n" for r in recs))
    out = tmp_path / "mla.jsonl"
    r = _report(
        "mqnc.measure.kernel_report",
        "--ops",
        "mla_decode,mla_sparse",
        "--measured",
        str(measured),
        "--out",
        str(out),
    )
    assert r.returncode == 0, r.stderr[-3000:]
    shape_row = f"| {label} | holder partial <= 15 us | 2 |"
    assert [x for x in r.stdout.splitlines() if x.startswith(shape_row)][0].endswith("| 12.5 |")
    assert "2.71 TB/s: NVIDIA H200's copy records" in r.stdout
    sparse_row = [x for x in r.stdout.splitlines() if x.startswith(f"| {sparse} | <= 30 us |")][0]
    assert sparse_row.endswith("| 32.8 (at 1024x16w8s5) |"), sparse_row
    assert [x for x in r.stdout.splitlines() if x.startswith(f"| {older} | >= 80%")][0].endswith(
        "| 12.9 (at ?) |"
    )
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    shapes = {x["shape"]: x for x in rows if x["kind"] == "shape"}
    launches = [x for x in rows if x["kind"] == "launch"]
    assert {s["op"] for s in shapes.values()} == {"mla_decode", "mla_sparse"}
    D_QK, D_V = 576, 512
    split_seen = False
    for name, s in shapes.items():
        words = dict(w.split("=") for w in name.split()[1:])
        H, B = int(words["H"]), int(words["B"])
        n = int(words.get("ct") or words["topk"])
        rows_ = B * H
        table = B * (n // 64 if s["op"] == "mla_decode" else n) * 4
        own = B * n * D_QK * 2 + table + rows_ * D_QK * 2 + rows_ * (D_V * 2 + 4)
        mine = [x for x in launches if x["shape"] == name]
        splits = mine[0]["grid"][1]
        assert len(mine) == (2 if splits > 1 else 1), name
        partials = 2 * splits * rows_ * (D_V * 4 + 4) if splits > 1 else 0
        split_seen |= splits > 1
        assert s["bytes"] == own + partials, name
        assert sum(x["bytes"] for x in mine) == own + partials, name
    assert split_seen


def test_mla_rows_show_the_static_schedule(tmp_path):
    """Each MLA attention launch's row carries its static schedule (``sm90.compile.mla_evidence``):
    tensor-core instructions per 64 entries against the ideal tile's, the redundancy (issued
    over ideal multiply-accumulates, >= 1.0: 1.0 = no recomputed ``QK^T``) and the wgmma waits
    leaving work in flight; the combine's row has none. The table shows them."""
    out = tmp_path / "sched.jsonl"
    args = ("--ops", "mla_sparse", "--candidates", "16x32w8s5-pipe", "--out", str(out))
    r = _report("mqnc.measure.kernel_report", *args)
    assert r.returncode == 0, r.stderr[-3000:]
    head = [x for x in r.stdout.splitlines() if x.startswith("| shape | variant |")][0]
    assert "| mma/64 | ideal/64 | redund | wg_waits | ring | chain | grid/SMs |" in head, head
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    launches = [x for x in rows if x["kind"] == "launch" and not x.get("candidate")]
    # the memory-bound columns: the sparse kernel's index gather then its KV tiles (a chain of
    # 2), a multi-buffered ring, the grid against sm_90's 132 SMs
    for x in launches:
        assert x["grid_per_sms"] == round(x["ctas"] / 132, 2), x
        if x["variant"].startswith("mla_"):
            assert x["read_chain"] == 2 and x["ring"] >= 2, x
    cand = [x for x in rows if x.get("candidate")]
    assert {x["tile"] for x in cand} == {"16x32w8s5-pipe"}, cand
    assert {x["shape"] for x in cand} == {
        "mla_sparse H=128 B=1 topk=2048",
        "mla_sparse H=128 B=8 topk=2048",
    }
    attention = [x for x in cand if x["variant"].startswith("mla_")]
    assert attention and all(x["variant"].endswith(",pipe]") for x in attention), attention
    # its two tile bodies (loop, tail) count once; spill-free under triton 3.6, the sweep's
    # (test_compile_sm90 compiles every candidate there; 3.9 spills some)
    for x in attention:
        assert x["redundancy"] >= 1.0 and x["read_chain"] == 2 and x["ring"] >= 2, x
    assert "Sweep candidates (forced tiles)" in r.stdout
    attention = [x for x in launches if x["variant"].startswith("mla_")]
    assert attention and len(attention) < len(launches)  # B 1 at 16 heads splits: a combine
    for x in attention:
        tile = x["variant"].split(",")[1]
        bh, bn = (int(v) for v in tile.split("x"))
        assert x["redundancy"] >= 1.0 and x["mma_per_64"] > 0, x
        ideal = (bh / 64) * (576 / 16 + 2 * bn / 16) if x["HGMMA"] else bh * bn * 1088 / 2048
        assert x["mma_ideal_per_64"] == round(ideal * 64 / bn, 1), x
        done, total = (int(v) for v in x["wgmma_waits"].split("/"))
        assert 0 <= done <= total
        row = [
            ln for ln in r.stdout.splitlines() if ln.startswith(f"| {x['shape']} | {x['variant']}")
        ]
        assert f"| {x['redundancy']} | {x['wgmma_waits']} |" in row[0], row
    for x in launches:
        if not x["variant"].startswith("mla_"):
            assert x["redundancy"] is None and x["wgmma_waits"] is None, x


def test_unknown_candidates_are_one_line(tmp_path):
    r = _report("mqnc.measure.kernel_report", "--ops", "merge", "--candidates", "7x7w1s1")
    assert r.returncode == 2 and "--candidates: expected 'all' or labels out of" in r.stderr


_TTGIR = """
    %len = tt.load %lens_ptr : !tt.ptr<i32> loc(#loc1)
    %q = tt.load %q_ptrs, %qm : tensor<16x512x!tt.ptr<bf16>> loc(#loc2)
    %t = arith.cmpi slt, %offs, %len : tensor<64xi32>
    %page_3 = ttg.async_copy_global_to_local %pp, %buf mask %t : tensor<64x!tt.ptr<i32>> -> <64xi32>
    %tok = ttg.async_wait %page_3 {num = 0 : i32}
    %page_4 = ttg.local_load %buf token %tok : !ttg.memdesc<64xi32> -> tensor<64xi32>
    %rows = arith.muli %page_4, %stride : tensor<64xi32>
    %kv:2 = scf.for %i = %c0 to %n step %c1 iter_args(%a = %rows, %b = %q) -> (tensor<64xi32>) {
      %kv_5 = ttg.async_copy_global_to_local %a, %kvbuf : tensor<64x512x!tt.ptr<bf16>>
    }
    %kv_6 = ttg.async_copy_global_to_local %rows, %kvbuf : tensor<64x512x!tt.ptr<bf16>>
    %x = arith.addf %kv#1, %q : tensor<16x512xf32>
"""


def test_read_chain_and_ring_read_the_ttgir():
    """The dependent-read chain follows SSA values through a copy's token, its wait and the
    shared-memory load (length -> page ids -> KV tile: 3), a loop's iter_args start at 0 (its
    body's copy is 1 deep); the ring is the leading dim of the ``<n>x<block_n>x<d_v>``
    allocation."""
    from mqnc.triton_kernels.sm90.compile import read_chain, ring_depth

    assert read_chain(_TTGIR) == 3
    assert read_chain("%a = tt.load %p : !tt.ptr<i32>") == 1 and read_chain("") == 0
    allocs = ["1x1xi32", "2x64x512xbf16", "2x64x64xbf16", "64x512xbf16"]
    assert ring_depth(allocs, 64, 512) == 2 and ring_depth(["32x512xbf16"], 32, 512) == 1
    assert ring_depth(allocs, 32, 512) == 0


def test_measured_ceiling_is_the_read_ceiling_when_recorded(tmp_path):
    """The report predicts at the device's kernel-measured read ceiling (``perf/bench_copy``'s
    exact Triton read records, :func:`mqnc.cost.ceilings.memory_ceiling`) when the file has one,
    at its torch ``copy_`` median when it has none, and names which."""
    from mqnc.measure.kernel_report import _measured

    def rec(bench, variant, backend, gbps, **extra):
        extra = {"timing": {"method": "cuda-graph"}, **extra}
        return dict(bench=bench, variant=variant, backend=backend, gbps=gbps, p50=1.0,
                    device="NVIDIA H200", extra=extra)  # fmt: skip

    copies = [rec("copy", "d2d", "torch", g) for g in (2700.0, 2710.0, 2720.0)]
    reads = [rec("ceiling", "read", "triton", g) for g in (4100.0, 4150.0, 4200.0)]
    wrong = rec("ceiling", "read", "triton", 9000.0, exact=False)  # read wrongly: no ceiling
    path = tmp_path / "results.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in copies))
    assert _measured(str(path))[1] == (2710.0 / 1e3, "NVIDIA H200's copy records")
    path.write_text("".join(json.dumps(r) + "\n" for r in [*copies, *reads, wrong]))
    tbps, source = _measured(str(path))[1]
    assert tbps == 4150.0 / 1e3 and source == "NVIDIA H200's read ceiling (perf/bench_copy)"


def test_sass_mix_counts_instructions_past_address_0xffff():
    """nvdisasm writes an instruction's address with as many hex digits as it needs: a long
    kernel's instructions past 0xffff (``/*10a30*/``) count like the first ones."""
    from mqnc.triton_kernels.sm90.compile import sass_mix

    sass = "\n".join(
        [
            "        /*0a30*/  HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], R24 ;",
            "        /*ffff0*/  @!UP0 UTMALDG.2D [UR8], [UR12] ;",
            "        /*10a30*/  HGMMA.64x256x16.F32.BF16 R88, gdesc[UR8], R88 ;",
            "        /*1a3b40*/  LDG.E.128 R4, desc[UR6][R2.64] ;",
        ]
    )
    assert sass_mix(sass) == {"HGMMA": 2, "LDG.128": 1, "UTMALDG": 1}
