"""The one comparison helper of the package, and the tolerance table it is used with.

Every test, benchmark sanity check and the demo's verification compare through
:func:`assert_close`: it reports the max-abs error, the max relative error and the RMS relative
error, and requires the inf / NaN masks of the two tensors to match exactly (an unwritten,
NaN-poisoned element, or a -inf LSE where a finite one was due, fails whatever the tolerance).

Tolerances live in :data:`TOLERANCES`, one entry per (op, dtype) with the reason for its size.
They are bounds the implementation must meet, never loosened to make a test pass.
"""

from __future__ import annotations

import dataclasses

import torch

from mqnc.base.runtime import interpreted, kernel_device

__all__ = [
    "Tolerance",
    "TOLERANCES",
    "INTERPRETER_TOLERANCES",
    "tolerance",
    "ulp",
    "CloseStats",
    "compare",
    "assert_close",
    "default_device",
]


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """A bound on each element's error and on the RMS error relative to the RMS of the
    expected tensor (``rms_rtol``), with the reason for its size.

    Each element's error is bounded by ``max(atol, rtol * |expected|)``: ``atol`` alone (the
    default ``rtol=0``) where the error does not scale with the value; where it does (a
    rounding to a narrower type is a fixed fraction of the value rounded), ``rtol`` takes over
    above ``atol / rtol`` and ``atol`` stays the bound below it, unchanged. Or, with ``ulps``,
    by ``atol + ulps * ulp(expected)`` in ``ulp_dtype``."""

    atol: float
    rms_rtol: float
    reason: str
    rtol: float = 0.0
    ulps: float = 0.0
    """When nonzero, each element's bound is ``atol + ulps * ulp(expected)`` instead, the ulp
    of ``ulp_dtype`` at ``|expected|`` (a store rounded to nearest is half an ulp off, whatever
    the value's size; truncation a whole one): for an error known to the ulp."""
    ulp_dtype: str = ""


# Unit roundoff: fp32 2^-24 = 6.0e-8, fp16 2^-11 = 4.9e-4, bf16 2^-8 = 3.9e-3.
TOLERANCES: dict[tuple[str, str], Tolerance] = {
    ("merge", "float32"): Tolerance(
        21 * 4 * 2.0**-24,
        float("inf"),
        "the worst case of an fp32 merge of M <= 8 partials with |o| <= 4 (the tests' range): "
        "the numerator's M products and M - 1 additions and the denominator's M - 1 additions "
        "round once each (u = 2^-24 relative), and exp and the exponent's subtraction perturb "
        "each weight by at most 2u in proportion (a weight far below the max is small: "
        "gap e^-gap <= 1/e), so |do| <= (2M + 5) u max|o_i| = 21 x 2^-24 x 4 = 5.0e-6. No RMS "
        "bound relative to the result: partials of both signs can cancel to a small o whose "
        "relative error no rounding analysis bounds (random draws: 1.1e-6 of a 0.09 result, "
        "n = 1). Typical draws sit far below the element bound (the paper measures <= 4e-7 "
        "max-abs at attention outputs, §3.3); random draws have reached 1.08e-6 at M = 8.",
    ),
    ("merge", "float16"): Tolerance(
        1e-3,
        5e-4,
        "the fp32 result is rounded once to fp16 on store (round to nearest): half an fp16 ulp "
        "at |o| < 4 is 9.8e-4; the inputs are compared after the same rounding.",
    ),
    ("merge", "bfloat16"): Tolerance(
        8e-3,
        4e-3,
        "the fp32 result is rounded once to bf16 on store (round to nearest even; under the "
        "interpreter in software, since its cast truncates): half a bf16 ulp at |o| < 4 is "
        "7.8e-3, the bf16 floor.",
    ),
    ("merge_wire", "float32"): Tolerance(
        1e-6,
        1e-6,
        "partials cross the wire in fp32 (one rounding of o and lse each) and merge in fp32: "
        "a few fp32 ulp at |o| < 4, the project's 1e-6 bound (paper §3.3: <= 4e-7).",
    ),
    ("merge_wire", "bfloat16"): Tolerance(
        1.6e-2,
        8e-3,
        "partials cross the wire in bf16 (half an ulp each, convexly combined) and the merged "
        "result is stored in bf16 (another half ulp): one bf16 ulp at |o| < 4 is 1.56e-2.",
    ),
    ("merge_lse", "float32"): Tolerance(
        1e-5,
        1e-6,
        "fp32 log/exp of values up to ~1e4 in magnitude (the extreme-gap tests): "
        "ulp(1e4) in fp32 is 1e-3, so the bound is relative; 1e-5 absolute holds for |lse| <= 30.",
    ),
    # Partial absorbed-MLA attention (mla_decode_partial, mla_sparse_partial), inputs ~N(0, 1),
    # 576-wide rows, the DeepSeek scale (~0.115): |o| <= max |kv| < ~6, |lse| < ~40.
    ("mla", "float32"): Tolerance(
        3e-5,
        2e-6,
        "fp32 scores and an fp32 online softmax over <= a few thousand entries. On a GPU each "
        "576-term score is one sequential fp32 FMA chain (ieee, no tensor cores): ~sqrt(576) u "
        "|q.k terms| ~ 3e-5 on the dot, ~3e-6 on a score scaled by ~0.1, so ~3e-6 relative in "
        "each weight and, with |v - o| up to ~4 over 64k outputs, ~1e-5 max-abs (an H200 "
        "measured 1.05e-5 at H 128, top-64; the same inputs with their scores summed in that "
        "order in numpy give 1.0e-5, test_mla_sparse); 3x that. (numpy's own pairwise sum, "
        "what the interpreter runs, gives 3.6e-6.)",
    ),
    ("mla", "float16"): Tolerance(
        4e-3,
        1e-3,
        "o is rounded once to fp16 on store (half an ulp at |o| < 8 is 2e-3) and the softmax "
        "weights p to fp16 for the PV product (2^-11 relative, a convex combination of values "
        "< ~6: < 2e-3 more); scores are exact products accumulated in fp32.",
    ),
    ("mla", "bfloat16"): Tolerance(
        3.2e-2,
        8e-3,
        "o is rounded once to bf16 on store (half an ulp at 4 <= |o| < 8 is 1.6e-2) and, on the "
        "GPU, p to bf16 for the PV product (2^-9 relative on a convex combination of values "
        "< ~6: < 1.2e-2 worst case, far less on average); bounded at one bf16 ulp.",
    ),
    ("mla_lse", "float32"): Tolerance(
        5e-5,
        1e-6,
        "natural-log LSE in fp32 from scores that are exact products of the stored inputs "
        "accumulated in fp32 over 576 dims (|q.k| < ~150, scaled by ~0.115: a few 1e-6), plus "
        "exp2/log2 in fp32; the same bound for every input dtype (the inputs are exact).",
    ),
    # The attention kernels over an FP8 cache (656-byte entries), against the fp64 reference
    # over the DEQUANTIZED cache (``mqnc.reference.dequantized_cache``: each latent value
    # fp8 * scale rounded to fp32, then to the query's dtype; the RoPE part converted). The
    # kernel dequantizes to exactly those values before its dots (one fp32 multiply, one
    # rounding, as the reference), so its error is its 16-bit path's over those rows: the
    # ("mla", dtype) bounds, with their reasons. The quantization error against the original
    # cache (fp8_ref's per-value bound, propagated through the softmax) is a separate bound,
    # measured by correctness/test_fp8_kernels.py, never added here.
    ("mla_fp8", "float32"): Tolerance(
        3e-5,
        2e-6,
        "the ('mla', 'float32') bound: fp32 scores and online softmax over the dequantized fp32 "
        "rows, which the kernel forms exactly as the reference (fp8 * scale, rounded once).",
    ),
    ("mla_fp8", "float16"): Tolerance(
        4e-3,
        1e-3,
        "the ('mla', 'float16') bound: o rounded once to fp16 and p to fp16 for the PV product; "
        "the dequantized rows are the reference's (fp32 product rounded once to fp16).",
    ),
    ("mla_fp8", "bfloat16"): Tolerance(
        3.2e-2,
        8e-3,
        "the ('mla', 'bfloat16') bound: o rounded once to bf16, p to bf16 for the PV product "
        "on the GPU; the dequantized rows are the reference's (e4m3 x power-of-two scale is a "
        "bf16 value: exact; another scale's fp32 product rounded once to bf16, as there).",
    ),
    ("mla_routed", "float32"): Tolerance(
        1e-6,
        1e-6,
        "M-way merge of disjoint holder partials vs one call over the union, fp32 inputs: the "
        "kernels' fp32 arithmetic differs only in grouping; the paper measures <= 4e-7 (§3.3).",
    ),
    ("mla_hf", "float32"): Tolerance(
        2e-5,
        1e-5,
        "mqnc's absorbed pipeline (W_UK folded into the query, W_UV after the merge, the Triton "
        "kernel over M holders) vs Hugging Face's expanded DeepseekV3Attention, both fp32 with "
        "O(1) activations: the same sums in another association (512- and 576-term dots, "
        "o_proj over H * v_head), a few fp32 ulp each; no rounding to a narrower type.",
    ),
    ("mla_routed", "bfloat16"): Tolerance(
        2e-3,
        6e-3,
        "routed (per-holder partials rounded to bf16, merged, rounded again) vs one call over the "
        "union (rounded once). Each element: max(2e-3, 2^-7 |o|). The routed result's last "
        "store and the single call's store are one bf16 rounding each, <= 2^-8 |o| relative "
        "(half an ulp): 2^-7 |o| together, one ulp of |o| at most, at any magnitude. Where "
        "|o| < 0.256 that is below the project's absolute 2e-3 (paper: 0.0012-0.0014 on "
        "FlashMLA, §3.3), which stays the bound there (the partials' own roundings, convexly "
        "combined, ride in it, as for attention spread over hundreds of entries): at the "
        "routed tests' |o| < 0.25 the bound is 2e-3 exactly, as before. RMS: three "
        "independent bf16 roundings (partial, merged, union), each ~2^-9 / sqrt(3) relative.",
        rtol=2**-7,
    ),
    # Routed over the wire (mqnc.serving: holder / requester): each holder's partial o is rounded to
    # bf16 on the holder (it travels in bf16, §3.2), the M-way merge rounds again; one call over
    # the union rounds once. Measured (fp64 simulation with round-to-nearest everywhere, 4
    # holders, |o| < 0.25): max-abs 4.9e-4, RMS relative 2.7e-3.
    ("route_wire", "bfloat16"): Tolerance(
        2e-3,
        3.9e-3,
        "routed-and-merged vs one call over the union: three independent bf16 roundings (partial, "
        "merged, single), each <= half an ulp (max-abs: one ulp of |o| < 0.25 is 9.8e-4, so 2e-3 "
        "is the project's bound) and each ulp(x)/sqrt(12) <= 2^-7/sqrt(12) RMS relative, so "
        "sqrt(3) * 2^-7 / sqrt(12) = 2^-8 = 3.9e-3 RMS (mla_routed's 1e-3 is below that floor).",
    ),
    # The ecosystem adapters (FlashMLA / FlashInfer layouts, CSR and page-1 tables, split caches,
    # per-layer splice lists, the merge's layout=) vs the package's own call on the same data.
    **{
        ("same_kernel", dt): Tolerance(
            0.0,
            0.0,
            "the same kernel arithmetic on the same values, reached through other pointers, "
            "strides or page tables (same tiles, same split count, same order): bit-identical, "
            "so any difference is a wrong address, a wrong length or an unwritten element.",
        )
        for dt in ("float32", "float16", "bfloat16")
    },
    # RoPE delta rotation (rope_splice, rope_rotate) vs the fp64 reference, inputs |x| <= 4 per
    # dim so |out| <= 4*sqrt(2) < 8. Kernel: angle reduced exactly in fp64, fp32 cos/sin ~1 ulp.
    ("rope", "float32"): Tolerance(
        1e-6,
        2e-7,
        "fp32 rotation: reduced angle rounded to fp32 (<= 5e-8 rad), cos/sin polynomials ~1 ulp, "
        "two products and a sum of |x| <= 4 (ulp(4) = 4.8e-7): measured <= 4e-7 for any "
        "|delta| < 2^31; the fp32 angle a naive kernel forms would be off by 4e-3 rad at 1e5.",
    ),
    ("rope", "float16"): Tolerance(
        1.96e-3,
        5e-4,
        "the fp32 result is rounded once to fp16: half an ulp at 4 <= |out| < 8 is 1.953e-3 "
        "(plus the <= 1e-6 fp32 error that can only tip a near-tie).",
    ),
    ("rope", "bfloat16"): Tolerance(
        1.563e-2,
        3e-3,
        "the fp32 result is rounded once to bf16: half an ulp at 4 <= |out| < 8 is 1.5625e-2 "
        "(plus the <= 1e-6 fp32 error that can only tip a near-tie); RMS below u = 3.9e-3.",
    ),
    # Two roundings: a rotated input that was itself rounded (delta then -delta; a splice of keys
    # encoded at p vs encoding at p + delta): the input's rounding error, rotated (<= sqrt(2) half
    # ulps per component), plus the output's half ulp, i.e. (1 + sqrt(2)) half ulps at |x| < 8.
    ("rope_twice", "float32"): Tolerance(
        1.6e-6,
        3e-7,
        "(1 + sqrt 2) * half an fp32 ulp at |x| < 8 (2.4e-7 each) plus the kernel's <= 1e-6.",
    ),
    ("rope_twice", "float16"): Tolerance(
        4.8e-3,
        1e-3,
        "(1 + sqrt 2) * half an fp16 ulp at 4 <= |x| < 8 (1.953e-3) = 4.72e-3.",
    ),
    ("rope_twice", "bfloat16"): Tolerance(
        3.8e-2,
        6e-3,
        "(1 + sqrt 2) * half a bf16 ulp at 4 <= |x| < 8 (1.5625e-2) = 3.77e-2.",
    ),
    ("rope_vs_hf", "float32"): Tolerance(
        1.5e-3,
        3e-4,
        "vs transformers' own RoPE at positions < 4096: it forms angles p * inv_freq in fp32, "
        "off by up to half an ulp of 4096 (1.2e-4 rad), i.e. <= 4*sqrt(2)*1.2e-4 = 6.9e-4 per "
        "component at |x| <= 4; twice that when both the old and new positions come from it.",
    ),
    ("rope_scores", "float32"): Tolerance(
        6e-4,
        1e-6,
        "q.k over 576 dims after rotating q and k in fp32: only the 64 rope dims move, each by "
        "<= 1e-6 at |x| <= 4 (<= 2 * 64 * 4 * 1e-6 = 5.1e-4 worst case), plus fp32 dot rounding.",
    ),
    # The demo (mqnc.demo): per-chunk partials and merged answers vs the fp64 single-instance
    # reference over the same keys (canonical bf16 cache re-homed by an exact fp64 rotation).
    # Bounds RELATIVE to the largest |o| of the reference (the demo multiplies atol by it):
    # its model's c_KV entries reach |c| ~ 4.6, so |o| spans binades where one bf16 ulp is
    # 2^-7 of the value at the top of a binade.
    ("demo_partial", "bfloat16"): Tolerance(
        2**-7,
        2**-7,
        "x max|o_ref|. A partial's o is stored in bf16 (half an ulp, <= 2^-9 |o| relative) from "
        "a bf16 query (route: rotated by -delta then rounded again) and bf16 keys (fetch: k_pe "
        "rotated by the splice and rounded; local: re-prefilled at the new offset and rounded), "
        "each rounding perturbing scores by ~2^-9 relative: one ulp of the largest |o| in all.",
    ),
    ("prefill_forms", "float64"): Tolerance(
        1e-11,
        1e-12,
        "the decompressed and the absorbed prefill are the same sums in another order (W_UK, "
        "W_UV applied before or after the T-long reductions): fp64 roundoff 1.1e-16 times "
        "sums of <= 512 terms of |x| <= ~10 over 2 layers, with room.",
    ),
    ("demo_merged", "bfloat16"): Tolerance(
        2**-7,
        2**-7,
        "x max|o_ref|. The merged answer adds one more bf16 store rounding (half an ulp) to "
        "partials that are convexly combined, so it stays within one ulp of the largest |o|.",
    ),
    ("demo_lse", "float32"): Tolerance(
        2e-2,
        2e-3,
        "natural-log LSE from bf16 queries and keys: the rounded q (and, for fetch/local, k) "
        "perturb each score by ~2^-9 |s| with |s| < ~5, so lse moves by < ~1e-2.",
    ),
    # A transformers DeepSeek model generating over holders (mqnc.integrations.hf) vs the same
    # model's own generate on the whole prompt: multipliers of transformers' own error, see
    # mqnc.integrations.hf_exactness (bound = rho * (E + S): E = transformers' logits vs the
    # float64 model on the same tokens, S = its own change when the sequence is shifted).
    ("hf_logits", "float32"): Tolerance(
        3.0,
        3.0,
        "x (E + S), max-abs and RMS. Per layer the absorbed path rounds at most as often as "
        "transformers' expanded one (both share its projections, RoPE, o_proj, MLP, norms): "
        "W_UK absorption of q (1 rounding) and one store of each holder partial (1), scores, "
        "softmax, W_UV and the merge in fp32, one store (1); transformers rounds k_nope and v "
        "(2), QK^T (1), the softmax weights (1) and PV (1). Allowing twice its rounding count, "
        "|ours - exact| <= 2 E (+ S for a shifted context, whose RoPE angles transformers forms "
        "in fp32 at other positions), so |ours - transformers| <= 3 (E + S).",
    ),
    ("hf_logits", "bfloat16"): Tolerance(
        3.0,
        3.0,
        "x (E + S), the fp32 entry's count with bf16 roundings: the absorbed query, each "
        "holder's partial (bf16 on the wire) and the merged output are rounded to bf16, as "
        "transformers rounds its expanded keys, scores, weights and PV output; at most twice "
        "its rounding count gives 2 E, the triangle inequality 3 (E + S).",
    ),
}


# Bounds of the Triton kernels under the interpreter, tighter than the compiled path's above
# where the interpreter's arithmetic is known exactly: every dot in fp32 (bf16 operands upcast,
# never rounded), one software round-to-nearest-even store. Looked up by :func:`tolerance` when
# the kernels run interpreted; the entries above stay the GPU's bounds.
INTERPRETER_TOLERANCES: dict[tuple[str, str], Tolerance] = {
    ("mla", "bfloat16"): Tolerance(
        3e-5,
        8e-3,
        "under the interpreter the scores, softmax and PV product are fp32 from the exact bf16 "
        "inputs (the fp32 bound, 3e-5, for the fp32 arithmetic) and o is rounded once to bf16 "
        "on store, to nearest even: half a bf16 ulp of |o| at every size (a truncating store "
        "is a whole ulp off and fails it, where the GPU's 3.2e-2 admits both).",
        ulps=0.5,
        ulp_dtype="bfloat16",
    ),
    ("mla_fp8", "bfloat16"): Tolerance(
        3e-5,
        8e-3,
        "the interpreter's ('mla', 'bfloat16') bound over the dequantized rows: fp32 arithmetic "
        "(3e-5) plus one round-to-nearest-even bf16 store, half an ulp of |o|.",
        ulps=0.5,
        ulp_dtype="bfloat16",
    ),
}


def tolerance(op: str, dtype: torch.dtype | str, *, backend: str | None = None) -> Tolerance:
    """Look up the tolerance of ``op`` at ``dtype``; a missing entry is an error, not a default.

    ``backend``: ``"interpreter"`` (the Triton kernels interpreted: the tighter
    :data:`INTERPRETER_TOLERANCES` entry where there is one) or ``"compiled"`` (the GPU's
    :data:`TOLERANCES`); None: the kernels' mode on :func:`default_device`."""
    name = dtype if isinstance(dtype, str) else str(dtype).replace("torch.", "")
    if backend is None:
        backend = "interpreter" if interpreted(default_device()) else "compiled"
    if backend not in ("interpreter", "compiled"):
        raise ValueError(f"backend: expected 'interpreter', 'compiled' or None, got {backend!r}")
    if backend == "interpreter" and (op, name) in INTERPRETER_TOLERANCES:
        return INTERPRETER_TOLERANCES[(op, name)]
    try:
        return TOLERANCES[(op, name)]
    except KeyError:
        have = sorted(k for k in TOLERANCES if k[0] == op)
        raise KeyError(f"no tolerance for ({op!r}, {name!r}); the table has {have}") from None


@dataclasses.dataclass(frozen=True)
class CloseStats:
    max_abs: float
    max_rel: float
    rms_rel: float
    n: int

    def __str__(self) -> str:
        return (
            f"max_abs={self.max_abs:.3e} max_rel={self.max_rel:.3e} "
            f"rms_rel={self.rms_rel:.3e} n={self.n}"
        )


def _finite(actual: torch.Tensor, expected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The elements of both (fp64, on the CPU, flattened) where ``expected`` is finite, after
    checking the shapes and the NaN / +inf / -inf masks agree (an ``AssertionError`` if not)."""
    if actual.shape != expected.shape:
        raise AssertionError(
            f"shape mismatch: actual {tuple(actual.shape)} vs expected {tuple(expected.shape)}"
        )
    a = actual.detach().to(device="cpu", dtype=torch.float64)
    e = expected.detach().to(device="cpu", dtype=torch.float64)
    for label, fn in (("NaN", torch.isnan), ("+inf", torch.isposinf), ("-inf", torch.isneginf)):
        ma, me = fn(a), fn(e)
        if not torch.equal(ma, me):
            bad = (ma != me).nonzero()[:5].tolist()
            raise AssertionError(
                f"{label} masks differ at {int((ma != me).sum())} elements (first: {bad}); "
                f"actual has {int(ma.sum())}, expected {int(me.sum())}"
            )
    finite = torch.isfinite(e)
    return a[finite], e[finite]


def compare(actual: torch.Tensor, expected: torch.Tensor) -> CloseStats:
    """Error statistics over the elements where both tensors are finite (fp64 arithmetic).

    Raises ``AssertionError`` when shapes differ or when the NaN, +inf or -inf masks differ.
    """
    a, e = _finite(actual, expected)
    if not e.numel():
        return CloseStats(0.0, 0.0, 0.0, 0)
    diff = (a - e).abs()
    max_abs = float(diff.max())
    max_rel = float((diff / e.abs().clamp_min(1e-30)).max())
    rms_e = float(e.pow(2).mean().sqrt())
    rms_rel = (
        float(diff.pow(2).mean().sqrt()) / rms_e if rms_e > 0 else float(diff.pow(2).mean().sqrt())
    )
    return CloseStats(max_abs, max_rel, rms_rel, int(e.numel()))


def assert_close(
    actual: torch.Tensor,
    expected: torch.Tensor,
    tol: Tolerance | None = None,
    *,
    atol: float | None = None,
    rms_rtol: float | None = None,
    rtol: float | None = None,
    name: str = "tensor",
) -> CloseStats:
    """Assert ``actual`` matches ``expected`` within ``tol`` (or explicit ``atol``/``rms_rtol``/
    ``rtol``): each element within ``max(atol, rtol * |expected|)`` (``rtol``: 0 unless given
    or the tolerance's), the RMS relative error within ``rms_rtol``.

    Returns the :class:`CloseStats` so callers can report the observed error.
    """
    if tol is not None:
        atol = tol.atol if atol is None else atol
        rms_rtol = tol.rms_rtol if rms_rtol is None else rms_rtol
        rtol = tol.rtol if rtol is None else rtol
    if atol is None:
        raise TypeError("assert_close: pass a Tolerance or atol=")
    stats = compare(actual, expected)
    over = stats.max_abs > atol
    ulps = tol.ulps if tol is not None else 0.0
    if ulps:  # each element within atol + ulps * ulp(expected)
        a, e = _finite(actual, expected)
        over = bool(((a - e).abs() > atol + ulps * ulp(e, tol.ulp_dtype)).any())
    elif over and rtol:  # (the element's own bound: atol, or rtol |expected| above atol / rtol)
        a, e = _finite(actual, expected)
        over = bool(((a - e).abs() > (rtol * e.abs()).clamp_min(atol)).any())
    if over or (rms_rtol is not None and stats.rms_rel > rms_rtol):
        rel = f" rtol={rtol:.3e}" if rtol else ""
        rel += f" + {ulps:g} ulp({tol.ulp_dtype})" if ulps else ""
        raise AssertionError(f"{name}: {stats} exceeds atol={atol:.3e}{rel} rms_rtol={rms_rtol}")
    return stats


_PRECISION = {"bfloat16": 8, "float16": 11, "float32": 24}  # significand bits, the implicit one
_MIN_EXP = {"bfloat16": -125, "float16": -13, "float32": -125}  # frexp exponent of the min normal


def ulp(x: torch.Tensor, dtype: str) -> torch.Tensor:
    """The unit in the last place of ``dtype`` (``"bfloat16"``, ``"float16"``, ``"float32"``) at
    each value of ``x`` (float64): ``2**(e - p)`` for ``|x|`` in ``[2**(e-1), 2**e)`` with ``p``
    significand bits; subnormals and zero share the smallest normal binade's ulp."""
    if dtype not in _PRECISION:
        raise ValueError(f"dtype: expected one of {sorted(_PRECISION)}, got {dtype!r}")
    m, e = torch.frexp(x.to(torch.float64))
    e = torch.where(m == 0, _MIN_EXP[dtype], e.clamp_min(_MIN_EXP[dtype])).to(torch.float64)
    return torch.pow(2.0, e - _PRECISION[dtype])


def default_device() -> torch.device:
    """Where the tests put tensors: the device that runs the kernels
    (:func:`mqnc.base.kernel_device`: the GPU when the kernels are compiled and CUDA exists,
    else the CPU, the interpreter's). Asks torch when called, never at import; test modules
    call it once at module level (Hypothesis tests cannot take function-scoped fixtures)."""
    return kernel_device()
