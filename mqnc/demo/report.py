"""The demo's report: per primitive, measured time per cost term beside the model's
prediction (§4) with this machine's constants, wire bytes, MAPE and the largest error; printed
as a table and drawn as measured against predicted per call. :func:`predict_call`,
:func:`primitive_rows`, :func:`print_table` and :func:`plot` serve both demos (``mqnc demo``
and ``mqnc demo --hf``, :mod:`mqnc.demo.hf`)."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

from mqnc.cost import mape, t_local, t_pull, t_route, t_splice
from mqnc.demo.calibration import Calibration
from mqnc.demo.config import DemoConfig
from mqnc.demo.workload import Corpus
from mqnc.model import MLAGeometry
from mqnc.serving import CostRecord

__all__ = ["Report", "predict_call", "primitive_rows", "print_table", "plot"]

TERMS = ("probe", "transfer", "compute", "return_", "merge", "splice", "prefill")


def predict_call(
    rec: CostRecord,
    geometry: MLAGeometry,
    fabric,
    *,
    tokens: int,
    compute_us_per_row_token: float,
    c_us: float,
    batch_work: int | None = None,
    splice_us: float = 0.0,
    prefill_tokens: int | None = None,
) -> dict[str, float]:
    """The model's terms (§4, microseconds) for one recorded call over a chunk of ``tokens``,
    with this machine's constants: a route's holder compute over ``batch_work`` rows x tokens
    (the batch it was answered in; default its own ``m_q x tokens``), a fetch's pull plus
    ``splice_us``, a local re-prefill of ``prefill_tokens`` (default ``tokens``) at ``c_us``
    per token-layer."""
    g = geometry
    if rec.primitive == "route":
        work = rec.m_q * tokens if batch_work is None else batch_work
        compute = compute_us_per_row_token * work
        r = t_route(g, fabric, rec.m_q, t_compute_us=compute, t_merge_us=0.0)
        return dict(
            probe=r.probe + r.turnaround,
            transfer=r.transfer,
            compute=r.compute,
            return_=r.return_,
            total=r.total,
        )
    if rec.primitive == "fetch":
        pull = t_pull(g, fabric, tokens)
        return dict(transfer=pull, splice=splice_us, total=pull + splice_us)
    prefill = t_local(g, tokens if prefill_tokens is None else prefill_tokens, c_us)
    return dict(prefill=prefill, total=prefill)


def primitive_rows(
    records: list[CostRecord],
    predict: Callable[[CostRecord], dict[str, float]],
    errors: dict[str, list[float]],
) -> dict:
    """Per primitive (route, fetch, local) of the successful ``records``: count, wire bytes,
    measured and predicted us per term (``predict(record) -> {term: us}``), MAPE, each call's
    measured and predicted total, the largest error of its partials in ``errors``."""
    rows = {}
    for prim in ("route", "fetch", "local"):
        recs = [r for r in records if r.primitive == prim and r.ok]
        if recs:
            rows[prim] = _row(prim, recs, predict, errors)
    return rows


def _row(prim: str, recs: list[CostRecord], predict, errors: dict) -> dict:
    preds = [predict(r) for r in recs]
    measured = dict(
        transfer=sum(r.transfer_us for r in recs),
        compute=sum(r.compute_us for r in recs),
        return_=sum(r.return_us for r in recs),
        merge=sum(r.merge_us for r in recs),
        splice=sum(r.splice_us for r in recs),
        prefill=sum(r.prefill_us for r in recs),
        total=sum(r.total_us for r in recs),
    )
    if prim == "fetch":
        measured["transfer"] = sum(r.return_us for r in recs)
        measured["return_"] = 0.0
    predicted = defaultdict(float)
    for p in preds:
        for k, v in p.items():
            predicted[k] += v
    return dict(
        count=len(recs),
        wire_bytes=sum(r.bytes_sent + r.bytes_recv for r in recs),
        measured_us=measured,
        predicted_us=dict(predicted),
        mape=mape([p["total"] for p in preds], [r.total_us for r in recs]),
        per_call=[
            dict(measured=r.total_us, predicted=p["total"], m_q=r.m_q, chunk=r.chunk_id)
            for r, p in zip(recs, preds, strict=True)
        ],
        max_abs_error=max(errors.get(prim, [0.0])),
    )


class Report:
    """Measured against predicted, per primitive, for a finished run's cost records.

    ``batch_work`` and ``deltas`` map ``id(record)`` to the rows x tokens of the holder batch
    the call was answered in and to the call's delta (:class:`mqnc.demo.step.Decoder`).
    """

    def __init__(
        self,
        cfg: DemoConfig,
        geometry: MLAGeometry,
        corpus: Corpus,
        cal: Calibration,
        batch_work: dict[int, int],
        deltas: dict[int, int],
    ) -> None:
        self.cfg, self.geometry, self.corpus, self.cal = cfg, geometry, corpus, cal
        self.batch_work, self.deltas = batch_work, deltas

    def predict(self, rec: CostRecord) -> dict[str, float]:
        """The model's terms for one recorded call, with this machine's constants."""
        ct = self.corpus.lengths[rec.chunk_id]
        splice = 0.0
        if rec.primitive == "fetch" and self.deltas.get(id(rec), 1):
            splice = t_splice(ct, self.cal.splice_profile(self.cfg))
        return predict_call(
            rec,
            self.geometry,
            self.cal.fabric,
            tokens=ct,
            compute_us_per_row_token=self.cal.compute_us_per_row_token,
            c_us=self.cal.c_us,
            batch_work=self.batch_work.get(id(rec)),
            splice_us=splice,
        )

    def rows(self, costs: list[CostRecord], errors: dict[str, list[float]]) -> dict:
        """:func:`primitive_rows` with :meth:`predict`."""
        return primitive_rows(costs, self.predict, errors)


def print_table(rows: dict, errors: dict, decisions: dict, fallbacks: list, cal: dict) -> None:
    """The calibration, the decisions and one line per primitive (measured / predicted ms)."""
    f = cal["fabric"]
    print(
        f"\ncalibrated fabric: T_probe {f['t_probe_us']:.1f} us, BW {f['bw_gbps']:.3f} GB/s, "
        f"turnaround {f['turnaround_us']:.1f} us; holder compute "
        f"{cal['compute_us_per_row_token']:.2f} us/(row x token), merge {cal['merge_us']:.0f} us, "
        f"splice {cal['splice_us_per_token']:.1f} us/token, "
        f"prefill c = {cal['c_us']:.1f} us/token-layer"
    )
    chosen = defaultdict(int)
    for d in decisions.values():
        chosen[d["primitive"]] += 1
    print(
        "decisions per (chunk, agent): " + ", ".join(f"{k} {v}" for k, v in sorted(chosen.items()))
    )
    if fallbacks:
        print(f"fallbacks: {len(fallbacks)} (a primitive failed; the next in order answered)")
    head = f"{'primitive':<9} {'calls':>5} {'wire MB':>8}  " + "  ".join(
        f"{t.rstrip('_'):>15}" for t in TERMS
    )
    print("\n" + head + f"  {'total ms':>17} {'MAPE':>6} {'max|err|':>9}")
    print("-" * len(head) + "-" * 36)
    for prim, r in rows.items():
        print(_table_line(prim, r))
    print("(each cell: measured / predicted, milliseconds summed over the calls)")
    merged = max(errors.get("merged", [0.0]))
    print(
        f"merged answers: {len(errors.get('merged', []))} checked against the fp64 reference, "
        f"max |err| {merged:.2e}"
    )


def _table_line(prim: str, r: dict) -> str:
    cells = []
    for t in TERMS:
        m = r["measured_us"].get(t)
        p = r["predicted_us"].get(t)
        ms = "-" if m is None else f"{m / 1e3:.1f}"
        ps = "-" if p is None else f"{p / 1e3:.1f}"
        cells.append(f"{ms:>7}/{ps:>7}")
    tot = f"{r['measured_us']['total'] / 1e3:8.1f}/{r['predicted_us']['total'] / 1e3:8.1f}"
    return (
        f"{prim:<9} {r['count']:>5} {r['wire_bytes'] / 1e6:8.2f}  "
        + "  ".join(cells)
        + f"  {tot} {r['mape'] * 100:5.0f}% {r['max_abs_error']:9.2e}"
    )


def plot(rows: dict, path: Path) -> None:
    """Measured against predicted time per call, one colour per primitive (log-log)."""
    import matplotlib  # here: an optional dependency (the notebooks extra), only for the PNG

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 4.5))
    colors = {"route": "tab:green", "fetch": "tab:red", "local": "tab:purple"}
    lo, hi = math.inf, 0.0
    for prim, r in rows.items():
        xs = [c["predicted"] for c in r["per_call"]]
        ys = [c["measured"] for c in r["per_call"]]
        ax.scatter(
            xs,
            ys,
            s=14,
            alpha=0.7,
            color=colors[prim],
            label=f"{prim} (n={r['count']}, MAPE {r['mape'] * 100:.0f}%)",
        )
        lo, hi = min(lo, *xs, *ys), max(hi, *xs, *ys)
    if hi > 0:
        ax.plot([lo, hi], [lo, hi], "k--", lw=1, label="measured = predicted")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("predicted per call (us)")
    ax.set_ylabel("measured per call (us)")
    ax.set_title("mqnc demo: measured vs the cost model")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
