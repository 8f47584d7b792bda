"""Which backend serves a call: one table, by op, device and dtype; a forced backend by name.

Every op has the portable ``tl`` backend (``triton.language`` kernels: the interpreter, CPUs,
any GPU Triton compiles for). An op may also have a Hopper backend, ``gluon``
(``triton.experimental.gluon``: TMA, warp specialization, asynchronous warpgroup MMA), which
serves the cases its kernel was written for on an sm_90 device, and only while the GPU
evidence of :mod:`mqnc.triton_kernels.evidence` covers its current device code and the Triton
in use; elsewhere, or when the evidence lapses, the ``tl`` kernel serves and the choice says why.

:data:`TABLE` is the table: one :class:`Rule` per (op, backend), first match wins. The planning
functions ask :func:`choose` once per plan (an eager call plans once per call signature), so a
choice costs nothing per launch. ``mqnc env`` and ``mqnc kernel-report`` print the table
(:func:`table_text`), with each Gluon kernel's evidence.

Forcing a backend (benchmarks, A/B checks, bisecting a wrong answer): :func:`force_backend`
(a context manager, process-wide) or ``MQNC_BACKEND`` (``op=backend`` pairs, comma separated,
e.g. ``MQNC_BACKEND=mla_decode=tl``). A forced ``gluon`` runs even without evidence (an
opt-in), but only where its kernel can run: elsewhere it is a ``ValueError`` saying why. Plans
made while a backend is forced keep it (the forced map is part of every cached plan's key).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import re
from collections.abc import Callable

import torch

from mqnc.base.env import MQNC_BACKEND, backend_overrides
from mqnc.triton_kernels import evidence
from mqnc.triton_kernels._core.execution import interpreted
from mqnc.triton_kernels._core.op import plan_context_env, set_plan_context

__all__ = [
    "BACKENDS",
    "CSR_TABLE_ENTRIES",
    "Case",
    "Choice",
    "Rule",
    "TABLE",
    "Target",
    "choose",
    "force_backend",
    "forced_backend",
    "table_rows",
    "table_text",
]

BACKENDS = ("tl", "gluon")


@dataclasses.dataclass(frozen=True)
class Target:
    """The device a call runs on, as the table reads it: ``kind`` ``"interpreter"`` (Triton's
    CPU interpreter), ``"cuda"``, or the tensors' device type otherwise; ``arch`` ``"sm_90"``
    (a CUDA device's compute capability) or None; ``triton`` the ``(major, minor)`` in use;
    ``gluon``: that Triton has ``triton.experimental.gluon``."""

    kind: str
    arch: str | None
    triton: tuple[int, int]
    gluon: bool

    @classmethod
    def of(cls, device: torch.device) -> Target:
        """The target of tensors on ``device`` (a CUDA device's capability read once)."""
        device = torch.device(device)
        if interpreted(device):
            return _target("interpreter", None)
        if device.type != "cuda":
            return _target(device.type, None)
        index = device.index if device.index is not None else torch.cuda.current_device()
        return _target("cuda", _arch(index))

    @classmethod
    def sm90(cls) -> Target:
        """An sm_90 CUDA device (Hopper: the H100, H200) under the Triton in use: what the
        table would choose there (``mqnc kernel-report``, a CPU asking about a GPU)."""
        return _target("cuda", "sm_90")


@functools.cache
def _arch(index: int) -> str:
    major, minor = torch.cuda.get_device_capability(index)
    return f"sm_{major}{minor}"


@functools.cache
def _triton_version() -> tuple[tuple[int, int], bool]:
    import triton

    major, minor = (int(x) for x in re.findall(r"\d+", triton.__version__)[:2])
    try:
        import triton.experimental.gluon  # noqa: F401
    except ImportError:
        return (major, minor), False
    return (major, minor), True


def _target(kind: str, arch: str | None) -> Target:
    version, gluon = _triton_version()
    return Target(kind, arch, version, gluon)


@dataclasses.dataclass(frozen=True)
class Case:
    """What a call is, as the table reads it. ``op``: the op's name (``mla_decode``,
    ``mla_sparse``, ``merge``, ``splice``, ...); for the attention ops: ``q_dtype`` (``"bf16"``,
    ``"fp16"``, ``"fp32"``), ``kv`` (the cache's element: the same names, or ``"fp8"`` for
    656-byte entries), ``split_cache`` (FlashInfer's ``ckv`` / ``kpe`` tensors; a query's
    rope part apart is joined per run, never a case of its own), ``d_qk`` /
    ``d_v`` (576 / 512 for DeepSeek's MLA), ``page`` (entries per page), ``tma_rows`` (the
    cache's entries are 16-byte aligned rows of one 2-D tensor, a multiple of 8 elements
    apart: what a TMA descriptor reads in place), ``table_entries`` (a CSR table's expansion
    to a padded one of 64-entry pages, ``S x nnz x page / 64``; 0 for a padded table),
    ``split_q`` (the query's rope part in a tensor of its own: the dense see-saws join it per
    run, the sparse one does not)."""

    op: str
    q_dtype: str = "bf16"
    kv: str = "bf16"
    split_cache: bool = False
    d_qk: int = 576
    d_v: int = 512
    page: int = 64
    tma_rows: bool = True
    table_entries: int = 0
    split_q: bool = False

    @classmethod
    def of_dtypes(cls, op: str, q_dtype: torch.dtype, kv_dtype: torch.dtype | None, **fields):
        """A case with ``q_dtype`` / ``kv_dtype`` as the table names them (``kv_dtype`` None:
        FP8 entries)."""
        kv = "fp8" if kv_dtype is None else DTYPES.get(kv_dtype, str(kv_dtype))
        return cls(op, q_dtype=DTYPES.get(q_dtype, str(q_dtype)), kv=kv, **fields)


DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}

CSR_TABLE_ENTRIES = 1 << 24
"""The largest padded table of 64-entry pages a CSR call on the Gluon kernel expands to (``S``
rows of ``nnz x page / 64`` entries: 64 MiB of int32); a larger CSR call runs the ``tl``
kernel, which reads the CSR table in place."""


@dataclasses.dataclass(frozen=True)
class Choice:
    """The backend that serves a case, its kernel (for a Gluon one, the evidence's name) and
    why (the rule's text, or why the preferred backend does not serve it)."""

    backend: str
    kernel: str
    why: str


@dataclasses.dataclass(frozen=True)
class Rule:
    """One row of the table: ``backend`` serves ``op`` with ``kernel`` when ``when`` (a
    sentence) holds; ``serves(case, target)`` is None when it does, else why not. ``evidence``:
    the Gluon kernel's name in :data:`mqnc.triton_kernels.evidence.VERIFIED` (a default only
    while verified)."""

    op: str
    backend: str
    kernel: str
    when: str
    serves: Callable[[Case, Target], str | None]
    evidence: str | None = None


def _always(case: Case, target: Target) -> None:
    return None


def _gluon_target(target: Target) -> str | None:
    """None when ``target`` runs the Gluon kernels (a CUDA sm_90 device, a Triton with Gluon),
    else why not."""
    if target.kind != "cuda" or target.arch != "sm_90":
        where = target.arch or target.kind
        return f"the Gluon kernel runs on a CUDA sm_90 device only, not {where}"
    if not target.gluon:
        return f"triton {target.triton[0]}.{target.triton[1]} has no triton.experimental.gluon"
    return None


def _seesaw_serves(case: Case, target: Target) -> str | None:
    """None when the Gluon see-saw decode can run ``case`` on ``target``, else why not."""
    why = _gluon_target(target)
    if why is not None:
        return why
    if case.q_dtype != "bf16" or case.kv != "bf16":
        return f"the Gluon kernel reads bf16 queries and caches, not {case.q_dtype} / {case.kv}"
    if case.split_cache:
        return "the Gluon see-saw reads fused 576-wide entries, not split ckv / kpe tensors"
    return _seesaw_layout(case)


def _seesaw_split_serves(case: Case, target: Target) -> str | None:
    """None when the see-saw's split-cache variant can run ``case``, else why not."""
    why = _seesaw_serves(dataclasses.replace(case, split_cache=False), target)
    if why is None and not case.split_cache:
        return "the split-cache see-saw reads split ckv / kpe tensors, the cache is fused"
    return why


def _sparse_seesaw_serves(case: Case, target: Target) -> str | None:
    """None when the see-saw's gather variant can run a sparse ``case`` (it gathers entries, so
    any page size does), else why not."""
    why = _seesaw_serves(dataclasses.replace(case, page=64), target)
    if why is None and case.split_q:
        return "the gather see-saw reads fused 576-wide query rows, not q_nope / q_pe"
    return why


def _fp8_seesaw_serves(case: Case, target: Target) -> str | None:
    """None when the see-saw's FP8 variant can run ``case`` (dense over a padded page table of
    any page size, or sparse), else why not."""
    why = _gluon_target(target)
    if why is not None:
        return why
    if case.q_dtype != "bf16" or case.kv != "fp8":
        return f"the FP8 see-saw reads bf16 queries and FP8 caches, not {case.q_dtype} / {case.kv}"
    if case.split_cache:
        return "the FP8 see-saw reads fused 656-byte entries, not split ckv / kpe tensors"
    if (case.d_qk, case.d_v) != (576, 512):
        return f"the Gluon kernel is written for 576 = 512 + 64, not {case.d_qk} = {case.d_v} + .."
    if not case.tma_rows:
        return "the FP8 entries are not 16-byte aligned rows of one 2-D tensor (cp.async)"
    if case.split_q:
        return "the FP8 see-saw reads fused 576-wide query rows, not q_nope / q_pe"
    if case.table_entries:
        return "the FP8 see-saw reads padded page tables (a CSR table runs the tl kernel)"
    return None


def _seesaw_layout(case: Case) -> str | None:
    """What both see-saws need of the layout (None: they can read it)."""
    if (case.d_qk, case.d_v) != (576, 512):
        return f"the Gluon kernel is written for 576 = 512 + 64, not {case.d_qk} = {case.d_v} + .."
    if case.page % 64:
        return f"the Gluon kernel reads pages in 64-entry TMA boxes, not pages of {case.page}"
    if not case.tma_rows:
        return "the cache's entries are not 16-byte aligned rows of one 2-D tensor (TMA)"
    if case.table_entries > CSR_TABLE_ENTRIES:
        return (
            f"its CSR table expands to {case.table_entries} padded entries (more than "
            f"{CSR_TABLE_ENTRIES}; the tl kernel reads CSR in place)"
        )
    return None


TABLE: tuple[Rule, ...] = (
    Rule(
        "mla_decode",
        "gluon",
        "mla_decode_gluon[seesaw]",
        "sm_90, bf16 queries and cache, fused 576-wide entries, pages a multiple of 64; any "
        "head count (blocks of 64), padded or CSR page tables, s_q >= 1 (causal or not), "
        "split-KV, out=, plans and CUDA graphs",
        _seesaw_serves,
        evidence="mla_decode_gluon[seesaw]",
    ),
    Rule(
        "mla_decode",
        "gluon",
        "mla_decode_gluon[seesaw-split]",
        "as the see-saw, over FlashInfer's split ckv [.., 512] / kpe [.., 64] cache (read in "
        "place through two TMA descriptors)",
        _seesaw_split_serves,
        evidence="mla_decode_gluon[seesaw-split]",
    ),
    Rule(
        "mla_decode",
        "gluon",
        "mla_decode_gluon[seesaw-fp8]",
        "sm_90, bf16 queries over DeepSeek-V3.2's 656-byte FP8 entries (fused, 16-byte aligned "
        "rows), any page size through a padded page table, s_q >= 1, split-KV: the see-saw's "
        "consumers, a warpgroup dequantizing each page into shared memory",
        _fp8_seesaw_serves,
        evidence="mla_decode_gluon[seesaw-fp8]",
    ),
    Rule("mla_decode", "tl", "mla_decode", "every other case (any device Triton runs on)", _always),
    Rule(
        "mla_sparse",
        "gluon",
        "mla_sparse_gluon[seesaw]",
        "sm_90, bf16 queries and cache, fused 576-wide entries in rows of one 2-D tensor, any "
        "page size and top-k (blocks of 64 selected entries gathered by cp.async), split-KV",
        _sparse_seesaw_serves,
        evidence="mla_sparse_gluon[seesaw]",
    ),
    Rule(
        "mla_sparse",
        "gluon",
        "mla_sparse_gluon[seesaw-fp8]",
        "sm_90, bf16 queries over 656-byte FP8 entries, any page size and top-k: the FP8 "
        "see-saw over the compacted selection",
        _fp8_seesaw_serves,
        evidence="mla_sparse_gluon[seesaw-fp8]",
    ),
    Rule("mla_sparse", "tl", "mla_sparse", "every other case", _always),
    Rule("merge", "tl", "merge", "every case", _always),
    Rule("splice", "tl", "rope_splice / rope_rotate", "every case", _always),
    Rule("fp8_quant", "tl", "fp8_quantize / fp8_dequantize", "every case", _always),
    Rule("tp", "tl", "tp_partial_scores / tp_partial_values", "every case", _always),
    Rule(
        "route",
        "tl",
        "route_take / route_gather / route_reply (around the dense plan), "
        "holder_loop, route_put / route_wait / route_merge",
        "every case",
        _always,
    ),
)
"""The dispatch table, first matching rule per op wins."""

OPS = tuple(dict.fromkeys(r.op for r in TABLE))

_FORCED: dict[str, str] = {}


def _check_forced(op: str, backend: str) -> None:
    if op not in OPS:
        raise ValueError(f"op: expected one of {OPS}, got {op!r}")
    have = tuple(r.backend for r in TABLE if r.op == op)
    if backend not in have:
        raise ValueError(f"backend: expected one of {have} for {op}, got {backend!r}")


def forced_backend(op: str) -> str | None:
    """The backend forced for ``op`` (:func:`force_backend` first, then ``MQNC_BACKEND``)."""
    forced = _FORCED.get(op)
    if forced is not None:
        return forced
    env = backend_overrides()
    if op in env:
        _check_forced(op, env[op])
        return env[op]
    return None


@contextlib.contextmanager
def force_backend(op: str, backend: str | None):
    """Inside the block, ``op`` runs on ``backend`` (``"tl"``, or ``"gluon"`` where its kernel
    can run; None: the table's choice). Process-wide, not thread-safe: for benchmarks and
    checks, not for serving. Plans made inside keep their backend after the block."""
    if backend is not None:
        _check_forced(op, backend)
    before = _FORCED.pop(op, None)
    if backend is not None:
        _FORCED[op] = backend
    set_plan_context(f"backend:{op}", backend)
    try:
        yield
    finally:
        _FORCED.pop(op, None)
        if before is not None:
            _FORCED[op] = before
        set_plan_context(f"backend:{op}", before)


def choose(case: Case, target: Target) -> Choice:
    """The backend serving ``case`` on ``target``: the forced one (a ``ValueError`` where it
    cannot run), else the first rule of ``case.op`` that serves it and whose Gluon kernel (if
    any) is verified for this tree and Triton."""
    rules = [r for r in TABLE if r.op == case.op]
    if not rules:
        raise ValueError(f"op: expected one of {OPS}, got {case.op!r}")
    forced = forced_backend(case.op)
    if forced is not None:
        whys = []
        for rule in (r for r in rules if r.backend == forced):
            why = rule.serves(case, target)
            if why is None:
                return Choice(rule.backend, rule.kernel, f"forced ({forced})")
            whys.append(why)
        whys = "; ".join(dict.fromkeys(whys))
        raise ValueError(f"backend {forced!r} forced for {case.op}, but {whys}")
    passed = []
    for rule in rules:
        why = rule.serves(case, target)
        if why is None and rule.evidence is not None:
            why = evidence.why_unverified(rule.evidence, target.triton)
        if why is None:
            reason = rule.when if not passed else f"{rule.when} ({'; '.join(passed)})"
            return Choice(rule.backend, rule.kernel, reason)
        passed.append(f"not {rule.backend}: {why}")
    raise AssertionError(f"no rule serves {case}")  # (the last rule of every op serves all)


def table_rows(target: Target | None = None) -> list[dict]:
    """The table as rows (op, backend, kernel, when, status): ``status`` says, for a Gluon
    kernel, whether it is a default (its evidence) or opt-in and why; with ``target``, whether
    that device runs it at all."""
    rows = []
    for rule in TABLE:
        status = "default"
        if rule.evidence is not None:
            version = target.triton if target is not None else None
            why = evidence.why_unverified(rule.evidence, version)
            if why is None:
                e = evidence.VERIFIED[rule.evidence]
                status = (
                    f"default where it runs (verified against fp64 on {e.device}, triton "
                    f"{e.triton[0]}.{e.triton[1]}, {e.commit})"
                )
            else:
                status = f"opt-in: {why}"
        if target is not None and rule.serves is not _always:
            probe = Case(rule.op)
            why_not = rule.serves(probe, target)
            if why_not is not None:
                status += f"; not on this device: {why_not}"
        row = dict(op=rule.op, backend=rule.backend, kernel=rule.kernel, when=rule.when)
        rows.append({**row, "status": status})
    return rows


def table_text(target: Target | None = None) -> str:
    """The table as text (``mqnc env``, ``mqnc kernel-report``), one block per rule."""
    lines = []
    for row in table_rows(target):
        lines.append(f"{row['op']:<11s} {row['backend']:<6s} {row['kernel']}")
        lines.append(f"{'':18s}when: {row['when']}")
        lines.append(f"{'':18s}{row['status']}")
    return "\n".join(lines)


# A forced backend changes what a call plans to: part of every cached plan's key.
plan_context_env(MQNC_BACKEND)
