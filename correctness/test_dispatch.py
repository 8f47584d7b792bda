"""The dispatch table (``mqnc.triton_kernels.dispatch``), case by case; the evidence a Gluon
kernel needs before it is a default (``mqnc.triton_kernels.evidence``); and the host side of
the see-saw's plan (``mla.gluon_plan``) that a CPU can run: its page-table kernel against a torch
reference, its launch arguments, and the converted tables attended by the ``tl`` kernel against
fp64 (the Gluon kernel itself runs on an sm_90 GPU only: ``perf/gpu_fastpath.sh``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from mqnc.reference import mla_decode_reference
from mqnc.testing import assert_close, default_device, tolerance
from mqnc.triton_kernels import dispatch, evidence, mla_decode_partial
from mqnc.triton_kernels.dispatch import Case, Target, choose, force_backend
from mqnc.triton_kernels.mla.gluon_plan import plan_seesaw, table_launch

ROOT = Path(__file__).resolve().parents[1]
DEVICE = default_device()
SCALE = 576**-0.5
SM90 = Target("cuda", "sm_90", (3, 6), True)
SEESAW = "mla_decode_gluon[seesaw]"


@pytest.mark.parametrize(
    ("case", "target", "backend", "why"),
    [
        (Case("mla_decode"), SM90, "gluon", "sm_90, bf16"),
        (Case("mla_decode", page=128), SM90, "gluon", "pages a multiple of 64"),
        (Case("mla_decode", page=256, table_entries=1 << 20), SM90, "gluon", "CSR"),
        (Case("mla_decode", q_dtype="fp16", kv="fp16"), SM90, "tl", "not fp16 / fp16"),
        (Case("mla_decode", kv="fp8"), SM90, "tl", "not bf16 / fp8"),
        (Case("mla_decode", q_dtype="fp32", kv="fp32"), SM90, "tl", "bf16 queries"),
        (Case("mla_decode", split_cache=True), SM90, "tl", "no GPU record"),
        (Case("mla_decode", d_qk=192, d_v=128), SM90, "tl", "576 = 512 + 64"),
        (Case("mla_decode", page=32), SM90, "tl", "not pages of 32"),
        (Case("mla_decode", page=1), SM90, "tl", "not pages of 1"),
        (Case("mla_decode", tma_rows=False), SM90, "tl", "rows of one 2-D tensor"),
        (Case("mla_decode", table_entries=(1 << 24) + 1), SM90, "tl", "reads CSR in place"),
        (Case("mla_decode"), Target("interpreter", None, (3, 9), True), "tl", "not interpreter"),
        (Case("mla_decode"), Target("cpu", None, (3, 6), True), "tl", "not cpu"),
        (Case("mla_decode"), Target("cuda", "sm_80", (3, 6), True), "tl", "not sm_80"),
        (Case("mla_decode"), Target("cuda", "sm_100", (3, 6), True), "tl", "not sm_100"),
        (Case("mla_decode"), Target("cuda", "sm_90", (3, 6), False), "tl", "no triton.exp"),
        (Case("mla_decode"), Target("cuda", "sm_90", (3, 9), True), "tl", "under triton 3.6"),
        (Case("mla_sparse"), SM90, "tl", "mla_sparse_gluon[seesaw] has no GPU record"),
        (Case("mla_sparse", page=1), SM90, "tl", "mla_sparse_gluon[seesaw] has no GPU record"),
        (Case("mla_sparse", split_q=True), SM90, "tl", "not q_nope / q_pe"),
        (Case("mla_sparse", kv="fp8"), SM90, "tl", "not bf16 / fp8"),
        (Case("merge"), SM90, "tl", "every case"),
        (Case("splice"), SM90, "tl", "every case"),
    ],
)
def test_the_table_serves_each_case_by_its_rule(case, target, backend, why):
    """Each row: the backend the table picks for a case on a device, and the reason it gives
    (for a case the Gluon kernel cannot take, why not)."""
    choice = choose(case, target)
    assert choice.backend == backend, choice
    assert why in choice.why, choice
    assert choice.kernel == (SEESAW if backend == "gluon" else choice.kernel)


def test_a_forced_backend_wins_where_it_can_run(monkeypatch):
    """``force_backend`` (and ``MQNC_BACKEND``) pick the backend by name: ``tl`` anywhere,
    ``gluon`` only where its kernel runs (a ValueError saying why elsewhere); a bad op or
    backend name is a ValueError naming the choices; the block restores the table's choice."""
    with force_backend("mla_decode", "tl"):
        assert choose(Case("mla_decode"), SM90).backend == "tl"
        assert "forced" in choose(Case("mla_decode"), SM90).why
    assert choose(Case("mla_decode"), SM90).backend == "gluon"
    interp = Target("interpreter", None, (3, 9), True)
    with force_backend("mla_decode", "gluon"), pytest.raises(ValueError, match="sm_90"):
        choose(Case("mla_decode"), interp)
    with pytest.raises(ValueError, match=r"backend: expected one of \('tl',\) for merge"):
        with force_backend("merge", "gluon"):
            pass
    with pytest.raises(ValueError, match="op: expected one of"):
        with force_backend("attention", "tl"):
            pass
    monkeypatch.setenv("MQNC_BACKEND", "mla_decode=tl")
    assert choose(Case("mla_decode"), SM90).backend == "tl"
    monkeypatch.setenv("MQNC_BACKEND", "mla_decode")
    with pytest.raises(ValueError, match="MQNC_BACKEND: expected op=backend"):
        choose(Case("mla_decode"), SM90)
    monkeypatch.setenv("MQNC_BACKEND", "mla_decode=cutlass")
    with pytest.raises(ValueError, match="backend: expected one of"):
        choose(Case("mla_decode"), SM90)


def test_every_default_gluon_kernel_is_the_code_a_gpu_verified():
    """Evidence before default: every Gluon kernel the table would pick has, today, the
    fingerprint its GPU record verified. A change to its device code fails here until a GPU run
    (``perf/gpu_fastpath.sh``) verifies the new code against fp64 and its fingerprint is
    recorded in ``evidence.VERIFIED``."""
    gluon_rules = [r for r in dispatch.TABLE if r.evidence in evidence.VERIFIED]
    assert [r.kernel for r in gluon_rules] == [SEESAW], gluon_rules
    for rule in gluon_rules:
        e = evidence.VERIFIED[rule.evidence]
        now = evidence.fingerprint(evidence.kernel_source(e.module), e.function)
        assert now == e.fingerprint, (
            f"{rule.kernel}: its device code changed since {e.commit} on {e.device} "
            f"(fingerprint {now} != {e.fingerprint}); run perf/gpu_fastpath.sh on an H200 and "
            f"record the new fingerprint with its records"
        )
        assert evidence.verified(rule.evidence, e.triton)


def test_a_gluon_kernel_without_gpu_evidence_is_opt_in():
    """The see-saw's split-cache variant (FlashInfer's ``ckv`` / ``kpe``) and its sparse gather
    variant have no GPU record: the table serves those cases with ``tl`` on an H200 and says
    why; forced, ``gluon`` picks the split variant for a split cache, the see-saw for a fused
    one, the gather variant for a sparse call; every Gluon kernel of the table has a
    fingerprint to record (``evidence.KERNELS``)."""
    split = Case("mla_decode", split_cache=True)
    choice = choose(split, SM90)
    assert choice.backend == "tl" and "seesaw-split] has no GPU record" in choice.why, choice
    with force_backend("mla_decode", "gluon"):
        assert choose(split, SM90).kernel == "mla_decode_gluon[seesaw-split]"
        assert choose(Case("mla_decode"), SM90).kernel == SEESAW
        with pytest.raises(ValueError, match="not fp16 / fp16"):
            choose(Case("mla_decode", q_dtype="fp16", kv="fp16", split_cache=True), SM90)
    with force_backend("mla_sparse", "gluon"):
        assert choose(Case("mla_sparse", page=1), SM90).kernel == "mla_sparse_gluon[seesaw]"
    for rule in dispatch.TABLE:
        if rule.evidence is not None:
            assert len(evidence.current_fingerprint(rule.evidence)) == 64
    assert "opt-in: mla_decode_gluon[seesaw-split] has no GPU record" in dispatch.table_text()


def test_a_changed_gluon_source_is_no_longer_a_default(monkeypatch):
    """The mechanism the test above relies on: a see-saw whose device code differs from the
    verified code (one constant of a helper it reaches) is not the default on an H200; the
    table serves the case with ``tl`` and says why, and the table's text marks it opt-in. A
    forced ``gluon`` still runs it (the opt-in)."""
    e = evidence.VERIFIED[SEESAW]
    source = evidence.kernel_source(e.module)
    line = 'return gl.where((offs < n)[None, :], s * qk_scale, -float("inf"))'  # _ss_scores
    changed = source.replace(line, line.replace("s * qk_scale", "s * (qk_scale * 1.0001)"))
    assert changed != source
    monkeypatch.setattr(evidence, "kernel_source", lambda module: changed)
    evidence.current_fingerprint.cache_clear()
    try:
        choice = choose(Case("mla_decode"), SM90)
        assert choice.backend == "tl" and "device code changed" in choice.why, choice
        assert "opt-in" in dispatch.table_text(SM90)
        with force_backend("mla_decode", "gluon"):
            assert choose(Case("mla_decode"), SM90).backend == "gluon"
    finally:
        monkeypatch.undo()
        evidence.current_fingerprint.cache_clear()
    assert choose(Case("mla_decode"), SM90).backend == "gluon"


def test_the_fingerprint_is_the_code_not_its_text():
    """Comments, docstrings, formatting and unreached definitions leave a fingerprint as it is;
    a changed constant, an operator, or a helper's body does not."""
    src = '''
"""module doc"""
import x
K = 3
UNUSED = 1


def helper(a):
    """doc"""
    return a * K


def kernel(a):
    return helper(a) + 1
'''
    fp = evidence.fingerprint(src, "kernel")
    assert evidence.fingerprint(src.replace('"""doc"""', '"""other doc"""'), "kernel") == fp
    assert evidence.fingerprint(src.replace("a * K", "a  *  K  # why"), "kernel") == fp
    assert evidence.fingerprint(src.replace("UNUSED = 1", "UNUSED = 2"), "kernel") == fp
    assert evidence.fingerprint(src.replace("import x", "import y"), "kernel") == fp
    for a, b in (("K = 3", "K = 4"), ("a * K", "a + K"), ("+ 1", "+ 2")):
        assert evidence.fingerprint(src.replace(a, b), "kernel") != fp, (a, b)
    with pytest.raises(ValueError, match="function"):
        evidence.fingerprint(src, "missing")


def test_the_evidence_names_records_that_passed_fp64():
    """Each verified kernel's records are in ``perf/results/results.jsonl``, from the named
    commit and device, and each passed its fp64 check (``extra.vs_fp64.ok``)."""
    records = [json.loads(line) for line in (ROOT / "perf/results/results.jsonl").open()]
    for e in evidence.VERIFIED.values():
        for bench, variant in e.records:
            found = [
                r
                for r in records
                if r["bench"] == bench
                and r["variant"] == variant
                and r["commit"] == e.commit
                and r["device"] == e.device
            ]
            assert found, (bench, variant, e.commit)
            assert all(r["extra"]["vs_fp64"]["ok"] for r in found), found


def test_the_table_prints_every_op():
    text = dispatch.table_text()
    for op in dispatch.OPS:
        assert op in text
    assert SEESAW in text and "default where it runs" in text
    assert "not on this device" in dispatch.table_text(Target("interpreter", None, (3, 9), True))


def test_a_plan_says_its_backend():
    """On this machine's device (the interpreter, or a GPU other than sm_90 under a Triton the
    evidence does not cover) a dense plan runs the ``tl`` kernel and says so."""
    q = torch.randn(1, 16, 576, device=DEVICE)
    pool = torch.randn(2, 64, 576, device=DEVICE)
    table = torch.tensor([[0, 1]], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([100], dtype=torch.int32, device=DEVICE)
    from mqnc.triton_kernels import plan_mla_decode

    plan = plan_mla_decode(q, pool, table, lens, softmax_scale=SCALE)
    expect = choose(Case("mla_decode", q_dtype="fp32", kv="fp32"), Target.of(q.device))
    assert plan.backend == expect.backend == "tl"


def _table_reference(table, indptr, lens, page, csr, W):
    """The padded table of 64-entry pages (and CSR lengths) the table kernel must write."""
    sub = page // 64
    rows = []
    lengths = []
    S = indptr.numel() - 1 if csr else table.shape[0]
    for s in range(S):
        pages = table[indptr[s] : indptr[s + 1]] if csr else table[s]
        row = [int(p) * sub + i for p in pages.tolist() for i in range(sub)]
        rows.append((row + [0] * W)[:W])
        if csr:
            n = len(pages) * page if lens is None else int(lens[s])
            lengths.append(n)
    return torch.tensor(rows, dtype=torch.int32), torch.tensor(lengths, dtype=torch.int32)


@pytest.mark.parametrize(
    ("page", "csr", "with_lens", "strided"),
    [(128, False, True, False), (256, False, True, True), (64, False, True, True),
     (64, True, True, False), (64, True, False, False), (128, True, False, False)],
)  # fmt: skip
def test_the_seesaw_table_kernel_writes_64_entry_pages(page, csr, with_lens, strided):
    """The see-saw plan's table kernel (interpreted here): a padded table with pages of 64 k
    entries (any row stride) or a CSR table (with or without ``kv_lens``) becomes the padded
    table of 64-entry pages the Gluon kernel reads (and CSR's lengths), every entry written."""
    gen = torch.Generator().manual_seed(page + csr)
    counts = [3, 0, 5, 1]
    sub = page // 64
    if csr:
        indptr = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)
        table = torch.randperm(40, generator=gen)[: int(indptr[-1])].to(torch.int32)
        W = table.shape[0] * sub
    else:
        indptr = None
        full = torch.randint(0, 40, (4, 10 if strided else 5), generator=gen, dtype=torch.int32)
        table = full[:, ::2] if strided else full
        W = table.shape[1] * sub
    lens = torch.tensor([n * page - 7 for n in counts], dtype=torch.int32).clamp(min=0)
    lens = lens if with_lens else None
    ref, ref_lens = _table_reference(table, indptr, lens, page, csr, W)
    S = len(counts)
    out = torch.full((S, W), -(2**31), dtype=torch.int32, device=DEVICE)
    out_lens = torch.full((S,), -(2**31), dtype=torch.int32, device=DEVICE)
    dev = [t.to(DEVICE) if t is not None else None for t in (table, indptr, lens)]
    table_launch(*dev, out, out_lens, page=page, csr=csr)()
    if csr:
        for s, n in enumerate(counts):  # entries past a row's pages are never read
            assert torch.equal(out[s, : n * sub].cpu(), ref[s, : n * sub]), s
        assert torch.equal(out_lens.cpu(), ref_lens)
    else:
        assert torch.equal(out.cpu(), ref)


def _pool(lengths, page, gen):
    pages = [math.ceil(n / page) for n in lengths]
    n_blocks = sum(pages) + 1
    pool = torch.full((n_blocks, page, 576), float("nan"))
    perm = torch.randperm(n_blocks, generator=gen).tolist()
    table = torch.full((len(lengths), max(pages)), -1, dtype=torch.int32)
    k = 0
    for b, n in enumerate(lengths):
        for j in range(pages[b]):
            table[b, j] = perm[k]
            m = min(page, n - j * page)
            pool[perm[k], :m] = torch.randn(m, 576, generator=gen)
            k += 1
    return pool, table, torch.tensor(lengths, dtype=torch.int32)


@pytest.mark.parametrize(("page", "csr"), [(128, False), (64, True), (128, True)])
def test_the_converted_table_attends_what_the_call_asked(page, csr):
    """What the see-saw reads after the table kernel (the pool as 64-entry pages, the padded
    table, the lengths) is the call's attention: the ``tl`` kernel over those, FlashMLA's
    layout, equals the fp64 reference over the call's own pool and table (pages past each
    length NaN, unused table entries -1)."""
    gen = torch.Generator().manual_seed(page)
    lengths = [1, 200, 130, 0]
    pool, table, lens = _pool(lengths, page, gen)
    q = torch.randn(len(lengths), 16, 576, generator=gen)
    ref = mla_decode_reference(q.double(), pool.double(), table, lens, SCALE)
    S, sub = len(lengths), page // 64
    if csr:
        counts = [math.ceil(n / page) for n in lengths]
        indptr = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)
        indices = torch.cat([table[b, :c] for b, c in enumerate(counts)]).to(torch.int32)
        src, W = indices, indices.numel() * sub
    else:
        indptr, src, W = None, table, table.shape[1] * sub
    out = torch.empty((S, W), dtype=torch.int32, device=DEVICE)
    out_lens = torch.empty((S,), dtype=torch.int32, device=DEVICE)
    dev = [t.to(DEVICE) if t is not None else None for t in (src, indptr, lens)]
    table_launch(*dev, out, out_lens, page=page, csr=csr)()
    pool64 = pool.reshape(-1, 64, 576).to(DEVICE)
    o, lse = mla_decode_partial(
        q.to(DEVICE), pool64, out, out_lens if csr else lens.to(DEVICE), softmax_scale=SCALE
    )
    assert_close(o, ref[0], tolerance("mla", torch.float32), name="o")
    assert_close(lse, ref[1], tolerance("mla_lse", "float32"), name="lse")


@pytest.mark.parametrize(
    ("rows", "heads", "s_q", "page", "csr", "splits"),
    [(64, 128, 1, 64, False, None), (2, 128, 2, 64, False, 2), (16, 16, 1, 128, False, 1),
     (4, 64, 1, 64, True, 3)],
)  # fmt: skip
def test_the_seesaw_plan_launches_what_the_kernel_reads(rows, heads, s_q, page, csr, splits):
    """The see-saw plan's launch on CPU tensors (nothing runs): its grid (two 64-head blocks a
    row at 128 heads, one at 16 or 64; a split axis), the table width and row stride it gives
    the kernel (the call's table as is at page 64, else the table kernel's ``W`` wide one), its
    constexprs (``S_Q``, ``CAUSAL``), and the combine when split."""
    S = rows // s_q
    q = torch.randn(rows, heads, 576, dtype=torch.bfloat16)
    pool = torch.empty(64, page, 576, dtype=torch.bfloat16)
    lens = torch.full((S,), 300, dtype=torch.int32)
    if csr:
        indptr = torch.arange(S + 1, dtype=torch.int32) * 5
        table = torch.arange(S * 5, dtype=torch.int32)
        width = table.numel() * (page // 64)
    else:
        indptr, table = None, torch.zeros(S, 8, dtype=torch.int32)
        width = 8 * (page // 64)
    template, attend = plan_seesaw(
        q, pool, table, lens, indptr, scale=SCALE, num_splits=splits, s_q=s_q,
        causal=s_q > 1, csr=csr, max_kv_len=None,
    )  # fmt: skip
    kernel = template.launches[0]
    assert kernel.grid == (rows * math.ceil(heads / 64), template.num_splits)
    assert kernel.args[6:10] == (heads, width, width if attend.shape.convert else 8, kernel.grid[1])
    assert attend.shape.convert == (csr or page != 64)
    assert kernel.kwargs["S_Q"] == s_q and kernel.kwargs["CAUSAL"] == (s_q > 1)
    assert ("fp32-split" in kernel.name) == (template.num_splits > 1)
    assert len(template.launches) == (2 if template.num_splits > 1 else 1)
    assert template.o.shape == (rows, heads, 512) and template.o.dtype == torch.bfloat16


def test_the_split_cache_plan_reads_two_descriptors_and_joins_a_split_query():
    """FlashInfer's layout on the see-saw (the split-cache variant, forced where a GPU runs it):
    the kernel takes the query's descriptor, then the latent and rope caches' (seven leading
    run arguments, not six), its name says ``seesaw-split``; a query given as ``q_nope`` /
    ``q_pe`` is joined per run (``split_q``), never copied at plan time."""
    q = torch.randn(4, 128, 512, dtype=torch.bfloat16)
    q_pe = torch.randn(4, 128, 64, dtype=torch.bfloat16)
    ckv = torch.empty(16, 64, 512, dtype=torch.bfloat16)
    kpe = torch.empty(16, 64, 64, dtype=torch.bfloat16)
    table = torch.zeros(4, 4, dtype=torch.int32)
    lens = torch.full((4,), 200, dtype=torch.int32)
    template, attend = plan_seesaw(
        q, ckv, table, lens, None, scale=SCALE, num_splits=2, s_q=1, causal=False, csr=False,
        max_kv_len=None, q_pe=q_pe, kpe_pool=kpe,
    )  # fmt: skip
    kernel = template.launches[0]
    assert (
        "seesaw-split" in kernel.name and kernel.kernel.__name__ == "gluon_mla_seesaw_split_kernel"
    )
    assert kernel.args[:3] == (None, None, None) and kernel.args[7:11] == (128, 4, 4, 2)
    assert attend.shape.split_q and attend.shape.split_cache and not attend.shape.copy_q
    from mqnc.triton_kernels.mla.gluon_plan import tma_rows

    odd_rows = torch.empty(16, 64, 66, dtype=torch.bfloat16)[..., :64]  # rows 132 B apart
    odd_base = torch.empty(16 * 64 * 64 + 1, dtype=torch.bfloat16)[1:].view(16, 64, 64)
    assert tma_rows(ckv, kpe) and not tma_rows(ckv, odd_rows) and not tma_rows(ckv, odd_base)


def test_the_fp8_seesaw_is_opt_in_and_serves_what_it_reads():
    """DeepSeek-V3.2's FP8 cache on an H200: with no GPU record of the FP8 see-saw the table
    serves dense and sparse FP8 calls with ``tl`` and says why; forced, ``gluon`` picks the FP8
    see-saw for a padded table of any page size and for a sparse call, and names what it does
    not read (a CSR table, a query whose rope part came apart, split ``ckv`` / ``kpe``, an fp16
    query); a bf16 cache never reaches it."""
    fp8 = dict(kv="fp8")
    for op, kernel in (("mla_decode", "mla_decode_gluon[seesaw-fp8]"),
                       ("mla_sparse", "mla_sparse_gluon[seesaw-fp8]")):  # fmt: skip
        choice = choose(Case(op, **fp8), SM90)
        assert choice.backend == "tl" and f"{kernel} has no GPU record" in choice.why, choice
        with force_backend(op, "gluon"):
            assert choose(Case(op, page=16, **fp8), SM90).kernel == kernel
            assert choose(Case(op, page=1, **fp8), SM90).kernel == kernel
            assert choose(Case(op), SM90).kernel != kernel
            for bad, why in (
                (dict(split_q=True), "q_nope / q_pe"),
                (dict(split_cache=True), "split ckv / kpe"),
                (dict(q_dtype="fp16"), "not fp16 / fp8"),
                (dict(tma_rows=False), "16-byte aligned rows"),
            ):
                with pytest.raises(ValueError, match=why):
                    choose(Case(op, **fp8, **bad), SM90)
        assert f"opt-in: {kernel} has no GPU record" in dispatch.table_text()
    with force_backend("mla_decode", "gluon"), pytest.raises(ValueError, match="CSR table"):
        choose(Case("mla_decode", table_entries=1024, **fp8), SM90)
    interpreter = Target("interpreter", None, (3, 9), True)
    assert choose(Case("mla_sparse", **fp8), interpreter).backend == "tl"


def test_the_fp8_seesaws_views_read_the_entry_as_the_format_lays_it_out():
    """The FP8 see-saw reads one pool through three views (``mla.gluon_plan.fp8_views``): its
    FP8 bytes, fp32 words and bf16 halves. Read at the offsets the kernel reads (latent byte
    ``c``, scale word ``128 + g``, RoPE half ``264 + j``), they decode every entry to the rows
    of the fp64 reference's dequantization (``reference.dequantized_cache``), 0xFF entries
    included (NaN both ways)."""
    from mqnc.reference.attention_ref import dequantized_cache
    from mqnc.triton_kernels.fp8.quant import fp8_quantize
    from mqnc.triton_kernels.mla.gluon_plan import fp8_rows, fp8_views

    gen = torch.Generator().manual_seed(3)
    rows = (torch.randn(3 * 16, 576, generator=gen) * 4).to(torch.bfloat16)
    entries = fp8_quantize(rows.to(DEVICE), 512).view(3, 16, 656)
    entries[1, 5] = 0xFF
    padded = torch.zeros(3, 16, 664, dtype=torch.uint8, device=DEVICE)[..., :656]
    assert fp8_rows(entries) and not fp8_rows(padded) and not fp8_rows(entries.transpose(0, 1))
    kv8, kvs, kvb, stride = fp8_views(entries)
    assert stride == 656 and kvs.shape[1] == 164 and kvb.shape[1] == 328
    latent = kv8[:, :512].double().view(-1, 4, 128) * kvs[:, 128:132].double()[:, :, None]
    got = torch.cat([latent.view(-1, 512), kvb[:, 264:328].double()], dim=1)
    want = dequantized_cache(entries, 512, torch.float64).view(-1, 576)
    assert torch.equal(torch.isnan(got), torch.isnan(want)) and bool(torch.isnan(got[21]).all())
    assert torch.equal(got.nan_to_num(), want.nan_to_num())
