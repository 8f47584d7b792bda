"""This machine's constants for the demo's predicate (§4.3) and its predictions, each either
loaded from ``--profile`` or measured at start-up through the demo's own requester against its
holders, and each labelled with where it came from.

What is measured (only what the profile lacks):

- the fabric: ``T_probe`` (median of 9 probes after a warm-up), ``BW`` and the turnaround (an
  affine fit of isolated routes of 1, 4 and 16 query tokens, medians of 3, :func:`mqnc.cost.fit`);
- the routed call's two sides (:class:`~mqnc.demo.waves.RouteConstants`): the requester's send
  (median put time of an ``H``-row request, rotation included) and the holder's kernel call,
  ``fixed + per row-token x work``, fitted over the isolated routes and over waves of requests
  batched the way the run batches them (several chunks per holder call, dense and selection);
- the holder's host work per kernel call on its core (``host_us``: taking requests in, packing
  and putting replies, which the kernel time the holder reports leaves out): the one value for
  which the wave model (:func:`mqnc.demo.waves.predict_wave`, with the constants above and the
  run's CPU plan) gives the calibration's own waves (to one holder at a time, and to every
  holder at once as the run's waves go out) their measured summed time. These are the
  calibration's requests, sent before the run: nothing is taken from the run it predicts;
- fetch: an affine fit of the pull (the call less its splice) over the smallest and the largest
  chunk (its fixed part: the request's round trip; its slope: the bulk rate), the splice per
  token (median, at a new offset) and the pool write alone per token (median, at the canonical
  position);
- the merge of an agent's partials (median of 5) and the re-prefill cost per token-layer.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from collections import defaultdict

import numpy as np
import torch

from mqnc.cost import FabricProfile, SpliceProfile, fit
from mqnc.demo.config import LANES, DemoConfig
from mqnc.demo.profile import COMPUTE_TERMS, DEMO_PROFILE, DEMO_TERMS, LoadedProfile
from mqnc.demo.waves import RouteConstants, WaveCall, predict_wave
from mqnc.model import MLAGeometry
from mqnc.serving import ChunkInfo, Requester
from mqnc.serving.compute import kernel_ops

__all__ = ["Calibration", "calibrate", "FABRIC_TERMS"]

FABRIC_TERMS = ("t_probe_us", "bw_gbps", "turnaround_us", "bulk_bw_gbps")
"""The fabric's terms the demo uses (a profile's, or measured)."""


@dataclasses.dataclass
class Calibration:
    """The constants of one run: the fabric, the demo's terms (:data:`DEMO_TERMS`, us) and,
    per term, where it came from (``sources``)."""

    fabric: FabricProfile
    terms: dict[str, float]
    sources: dict[str, str]
    probe_samples_us: list[float] = dataclasses.field(default_factory=list)
    fit: dict | None = None
    fit_error: str | None = None
    samples: dict = dataclasses.field(default_factory=dict)
    profile: str | None = None

    @property
    def route(self) -> RouteConstants:
        """The routed call's requester and holder sides."""
        t = self.terms
        return RouteConstants(
            t["send_us"],
            t["send_alone_us"],
            t["compute_fixed_us"],
            t["compute_us_per_row_token"],
            t.get("host_us", 0.0),
        )

    def splice_profile(self, cfg: DemoConfig, moved: bool = True) -> SpliceProfile:
        """What a fetched chunk costs on arrival, linear in ``c_t`` over the corpus' chunk
        sizes: the measured splice (re-rotation and pool write) when it ``moved``, else the
        pool write alone (the scatter: a chunk used at its canonical position)."""
        per_tok = self.terms["splice_us_per_token" if moved else "scatter_us_per_token"]
        lo, hi = cfg.min_tokens, max(cfg.max_tokens, cfg.min_tokens + 1)
        name = "measured (demo calibration)" if moved else "pool write (demo calibration)"
        return SpliceProfile((lo, hi), (per_tok * lo, per_tok * hi), name)

    def to_dict(self) -> dict:
        """The JSON form (``demo.json``'s ``calibration``; :func:`mqnc.demo.report.print_table`
        reads it)."""
        return dict(
            fabric=self.fabric.to_dict(),
            **self.terms,
            sources=dict(self.sources),
            probe_samples_us=self.probe_samples_us,
            fit=self.fit,
            fit_error=self.fit_error,
            samples=self.samples,
            profile=self.profile,
        )

    def save_profile(self, path, cfg: DemoConfig, device_name: str) -> None:
        """Write everything as a demo profile (``--profile`` loads it, nothing recalibrated)."""
        data = dict(
            kind=DEMO_PROFILE,
            fabric=self.fabric.to_dict(),
            terms=dict(self.terms),
            measured_with=dict(
                device=cfg.device,
                kernels=cfg.kernels,
                transport=cfg.transport,
                device_name=device_name,
            ),
            sources=dict(self.sources),
        )
        with open(path, "w") as f:
            json.dump(data, f, indent=2)
            f.write("\n")


def _loaded(cfg: DemoConfig, profile: LoadedProfile | None):
    """``(fabric terms, demo terms, sources)`` a profile gives for this run: a demo profile's
    compute terms only when measured with the same kernels on the same device."""
    if profile is None:
        return {}, {}, {}
    name = "profile"
    fabric = {k: getattr(profile.fabric, k) for k in FABRIC_TERMS}
    fabric = {k: v for k, v in fabric.items() if v is not None}
    sources = dict.fromkeys(fabric, name)
    terms = dict(profile.terms)
    w = profile.measured_with
    if terms and (w.get("kernels"), w.get("device")) != (cfg.kernels, cfg.device):
        why = f"calibrated (profile's: kernels {w.get('kernels')} on {w.get('device')})"
        for k in COMPUTE_TERMS:
            if terms.pop(k, None) is not None:
                sources[k] = why
    sources.update({k: name for k in terms if k not in sources})
    return fabric, terms, sources


def calibrate(
    cfg: DemoConfig,
    req: Requester,
    geometry: MLAGeometry,
    profile: LoadedProfile | None,
    progress,
    cores: dict[int, int] | None = None,
) -> Calibration:
    """Load what ``profile`` holds, measure the rest with ``req`` against its holders (see the
    module docstring; ``cores``: the run's CPU plan, :func:`mqnc.demo.cluster.cpu_plan`, taken
    before this process was pinned); leaves ``req`` without cost records and with an empty
    pool (the calibration's calls are not the workload)."""
    fab, terms, sources = _loaded(cfg, profile)
    m = _Measure(cfg, req, geometry, cores)
    missing = [k for k in (*FABRIC_TERMS, *DEMO_TERMS) if k not in fab and k not in terms]
    with progress.bar(len(missing), "calibrate what the profile lacks (terms)") as bar:
        got = m.run(missing, fab, bar)
    for k, v in got.items():
        (fab if k in FABRIC_TERMS else terms)[k] = v
        sources.setdefault(k, m.notes.get(k, "calibrated"))
    req.costs.clear()
    req.clear_local()
    base = profile.fabric if profile is not None else None
    fabric = FabricProfile(
        base.name if base else "this-machine (demo calibration)",
        t_probe_us=fab["t_probe_us"],
        bw_gbps=fab["bw_gbps"],
        turnaround_us=fab["turnaround_us"],
        bulk_bw_gbps=fab["bulk_bw_gbps"],
        **_host_fields(base),
        source=base.source if base else "mqnc demo calibration",
    )
    path = None if profile is None else profile.path
    return Calibration(fabric, terms, sources, m.probes, m.fit, m.fit_error, m.samples, path)


def _host_fields(base: FabricProfile | None) -> dict:
    """A profile's host-overhead fields (``host_fixed_us``, ``host_per_row_us``) where the
    package's FabricProfile has them and the profile sets them."""
    if base is None:
        return {}
    fields = {f.name for f in dataclasses.fields(FabricProfile)}
    return {
        k: getattr(base, k)
        for k in ("host_fixed_us", "host_per_row_us")
        if k in fields and getattr(base, k) is not None
    }


def _median(xs) -> float:
    return float(statistics.median(xs))


class _Measure:
    """The measurements, each run only when a term it gives is missing."""

    def __init__(
        self, cfg: DemoConfig, req: Requester, g: MLAGeometry, cores: dict[int, int] | None
    ) -> None:
        self.cfg, self.req, self.g, self.cores = cfg, req, g, cores
        self.probes: list[float] = []
        self.fit: dict | None = None
        self.fit_error: str | None = None
        self.notes: dict[str, str] = {}
        self.samples: dict[str, list] = {}
        self.waves: list[tuple[list[WaveCall], list[float]]] = []  # calibration waves, measured
        self.gen = torch.Generator().manual_seed(cfg.seed + 31)
        infos = sorted(req.directory.values(), key=lambda i: (i.tokens, i.chunk_id))
        self.small, self.large = infos[0], infos[-1]
        self.holder = self.small.holders[0]
        self.by_holder: dict[int, list[ChunkInfo]] = defaultdict(list)
        for info in req.directory.values():
            self.by_holder[info.holders[0]].append(info)

    def run(self, missing: list[str], fab: dict, bar) -> dict[str, float]:
        got: dict[str, float] = {}

        def take(values: dict) -> None:
            new = {k: v for k, v in values.items() if k in missing and k not in got}
            got.update(new)
            bar.update(len(new))

        route_terms = {"t_probe_us", "bw_gbps", "turnaround_us"}
        compute_pairs: list[tuple[int, float]] = []
        alone: list[float] = []  # sends of single-token routes with nothing else in flight
        if route_terms & set(missing):
            fabric = self._fabric(compute_pairs, alone)
            if self.fit_error is not None:
                missing = [k for k in missing if k != "bw_gbps"]  # from the bulk pull, below
            take(fabric)
        if {"send_us", "send_alone_us", "compute_fixed_us", "compute_us_per_row_token"} & set(
            missing
        ):
            take(self._route_sides(compute_pairs, alone))
        if {"bulk_bw_gbps", "fetch_fixed_us", "splice_us_per_token", "scatter_us_per_token"} & set(
            missing
        ):
            take(self._fetch("bulk_bw_gbps" in missing or "fetch_fixed_us" in missing))
        if "merge_us" in missing:
            take(dict(merge_us=self._merge_us()))
        if "c_us" in missing:
            take(dict(c_us=self._prefill_c_us()))
        if "host_us" in missing:  # after the bulk rate: the rows' BW when the route fit failed
            known = {**fab, **got}
            known.setdefault("bw_gbps", known.get("bulk_bw_gbps"))
            take(dict(host_us=self._host_us(known)))
        if self.fit_error is not None and "bw_gbps" not in fab:
            # the route fit failed: the rows' bytes move at the bulk pull's rate
            got["bw_gbps"] = got.get("bulk_bw_gbps", fab.get("bulk_bw_gbps"))
            self.notes["bw_gbps"] = "calibrated (bulk rate: route fit failed)"
            bar.update(1)
        return got

    # -- the fabric: probes and an isolated route sweep ------------------------------------------
    def _q(self, tokens: int) -> torch.Tensor:
        g = self.g
        q = torch.randn(tokens, g.heads, g.d_qk, generator=self.gen).to(torch.bfloat16)
        return q.to(self.cfg.device)

    def _fabric(self, compute_pairs: list, alone: list) -> dict[str, float]:
        req, g, info = self.req, self.g, self.small
        for _ in range(10):  # warm the link up first (gloo's first transfers run slow)
            req.probe(self.holder)
        self.probes = [req.probe(self.holder) for _ in range(9)]
        offset = info.position + 1  # a new offset: the query is rotated, as the run's are
        req.route(info.chunk_id, self._q(1), 0, offset=offset)
        samples = []
        for tokens in (1, 4, 16):
            q, rts = self._q(tokens), []
            for _ in range(5):
                rec = req.route(info.chunk_id, q, 0, offset=offset).record
                rts.append(rec.total_us - rec.compute_us)
                compute_pairs.append((rec.m_q * info.tokens, rec.compute_us))
                if tokens == 1:
                    alone.append(rec.transfer_us)
            samples.append((tokens * g.heads, _median(rts)))
        probe = _median(self.probes)
        try:
            res = fit(samples, qp_row_bytes=g.qp_row_bytes, probe_us=self.probes)
            self.fit = res.to_dict()
            return dict(
                t_probe_us=probe, bw_gbps=res.bw_gbps, turnaround_us=max(res.turnaround_us, 0.0)
            )
        except ValueError as exc:
            # decode-sized rows on a fast local link are all fixed cost (the slope drowns in
            # noise): the fixed part is the smallest route less the probe, BW the bulk pull's
            self.fit_error = str(exc)
            fixed = min(t for _m, t in samples)
            return dict(t_probe_us=probe, turnaround_us=max(fixed - probe, 0.0))

    # -- the routed call's two sides: waves batched as the run batches ---------------------------
    def _wave(self, sparse: bool, holders: list[int]) -> list:
        """One wave shaped like the run's: single-token requests to ``holders``, up to
        ``LANES`` each over its chunks, grouped by holder (dense: at new offsets; selection:
        ``topk`` canonical entries spread over a holder's chunks). Returns ``(record, work)``
        per request."""
        cfg = self.cfg
        requests = []
        for h in holders:
            chunks = self.by_holder[h][:LANES]
            for info in chunks:
                r = dict(chunk_id=info.chunk_id, q=self._q(1), layer=0)
                if sparse:
                    k = min(info.tokens, max(1, cfg.topk // len(chunks)))
                    idx = torch.randperm(info.tokens, generator=self.gen)[:k].sort().values
                    ind = torch.full((1, cfg.topk), -1, dtype=torch.int32)
                    ind[0, :k] = idx.to(torch.int32)
                    r["indices"] = ind.to(cfg.device)
                else:
                    r["offset"] = info.position + 1
                requests.append(r)
        n = len(self.req.costs)
        self.req.route_many(requests, merge=False)
        work = []
        for r, rec in zip(requests, self.req.costs[n:], strict=True):
            ind = r.get("indices")
            info = self.req.directory[r["chunk_id"]]
            # a selection costs its index row's width, padding included (as in the run)
            work.append((rec, rec.m_q * (info.tokens if ind is None else ind.shape[-1])))
        calls = [
            WaveCall(rec.peer, rec.m_q, w, "indices" in r)
            for r, (rec, w) in zip(requests, work, strict=True)
        ]
        self.waves.append((calls, [rec.total_us for rec, _ in work]))
        return work

    def _route_sides(self, compute_pairs: list, alone: list) -> dict[str, float]:
        """The requester's send (alone: single routes; in a wave: the mean over waves to every
        holder, the run's shape) and the holder's kernel call (a robust affine fit over the
        calls of waves to one holder at a time: its core's own speed)."""
        kinds = [False, True] if self.cfg.selection_agents else [False]
        info = self.small
        while len(alone) < 8:  # single-token routes with nothing else in flight
            rec = self.req.route(info.chunk_id, self._q(1), 0, offset=info.position + 1).record
            alone.append(rec.transfer_us)
        compute_pairs.clear()  # the kernel calls of batches like the run's, not isolated ones
        sends: list[float] = []
        holders = sorted(self.by_holder)
        for _rep in range(3):
            for sparse in kinds:
                for h in holders:
                    recs = self._wave(sparse, [h])
                    # one kernel call answers every request of its group: they carry the same
                    # kernel time in their reply headers
                    calls: dict[float, int] = defaultdict(int)
                    for rec, w in recs:
                        calls[rec.compute_us] += w
                    compute_pairs += [(w, us) for us, w in calls.items()]
                sends += [rec.transfer_us for rec, _ in self._wave(sparse, holders)]
        self.samples["send_us"] = list(sends)
        self.samples["send_alone_us"] = list(alone)
        self.samples["compute_work_us"] = list(compute_pairs)
        fixed, per_work = _robust_affine(compute_pairs)
        return dict(
            # a wave's sends add up: their mean, not their median
            send_us=float(np.mean(sends)),
            send_alone_us=_median(alone),
            compute_fixed_us=fixed,
            compute_us_per_row_token=per_work,
        )

    def _host_us(self, known: dict[str, float]) -> float:
        """The holder's host work per kernel call on its core (:class:`RouteConstants`
        ``host_us``): the value for which the wave model (:func:`predict_wave`, with the
        constants measured so far and this run's CPU plan) gives the calibration's own waves
        (to one holder, and to every holder at once, as the run's) their measured summed time
        (bisection: the predicted sum rises with it). 0 when no wave was measured here (the
        routed call's sides came from a profile)."""
        if not self.waves:
            return 0.0
        fabric = FabricProfile(
            "calibration",
            t_probe_us=known["t_probe_us"],
            bw_gbps=known["bw_gbps"],
            turnaround_us=known["turnaround_us"],
        )
        base = RouteConstants(
            known["send_us"],
            known["send_alone_us"],
            known["compute_fixed_us"],
            known["compute_us_per_row_token"],
        )
        measured = sum(sum(totals) for _, totals in self.waves)

        def predicted(host: float) -> float:
            k = dataclasses.replace(base, host_us=host)
            return sum(
                t["total"]
                for calls, _ in self.waves
                for t in predict_wave(calls, self.g, fabric, k, self.cores)
            )

        if predicted(0.0) >= measured:
            return 0.0
        lo, hi = 0.0, max(known["t_probe_us"] + known["turnaround_us"], 1.0)
        while predicted(hi) < measured and hi < 1e6:
            hi *= 2
        for _ in range(30):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if predicted(mid) < measured else (lo, mid)
        self.samples["host_fit_us"] = [measured, predicted(hi)]
        return hi

    # -- fetch: the pull at two chunk sizes, the splice ------------------------------------------
    def _fetch(self, pull: bool) -> dict[str, float]:
        req = self.req
        points, splice = [], []
        for info in (self.small, self.large) if pull else (self.small,):
            for k in range(7):  # the first one warms the path up
                n = len(req.costs)
                req.fetch(info.chunk_id, offset=info.position + 1 + k)
                rec = req.costs[n]
                if k:
                    points.append((rec.bytes_recv, rec.total_us - rec.splice_us))
                    splice.append(rec.splice_us / info.tokens)
            req.clear_local()
        scatter = []
        for k in range(5):  # at the canonical position: the pool write alone
            n = len(req.costs)
            req.fetch(self.small.chunk_id)
            if k:
                scatter.append(req.costs[n].splice_us / self.small.tokens)
            req.clear_local()
        self.samples["fetch_bytes_us"] = points
        out = dict(splice_us_per_token=_median(splice), scatter_us_per_token=_median(scatter))
        if pull:
            out.update(_pull_fit(points))
        return out

    def _merge_us(self) -> float:
        """One merge of an agent's partials (its chunks and its suffix), median of 5."""
        g, cfg = self.g, self.cfg
        m = max(cfg.chunks_per_agent if cfg.whole_agents else 0, 1) + 1
        o = torch.randn(m, 1, g.heads, g.d_v, generator=self.gen).to(torch.bfloat16)
        lse = torch.randn(m, 1, g.heads, generator=self.gen)
        o, lse = o.to(cfg.device), lse.to(cfg.device)
        ops = kernel_ops(cfg.kernels)
        ops.merge_partials(o, lse)
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            ops.merge_partials(o, lse)
            times.append((time.perf_counter() - t0) * 1e6)
        return _median(times)

    def _prefill_c_us(self) -> float:
        """Re-prefill of a median-sized chunk per token-layer, the second of two calls."""
        infos = sorted(self.req.directory.values(), key=lambda i: i.tokens)
        info: ChunkInfo = infos[len(infos) // 2]
        for k in range(2):
            t0 = time.perf_counter()
            self.req.local(info.chunk_id, offset=info.position + 1 + k)
            us = (time.perf_counter() - t0) * 1e6
        self.req.clear_local()
        return us / (info.tokens * self.g.layers)


def _robust_affine(pairs: list[tuple[float, float]]) -> tuple[float, float]:
    """``(intercept, slope)`` of a least-squares line through ``(x, y)``, refitted once without
    the points more than 3 median absolute residuals off (a call the OS descheduled is not the
    kernel's cost); proportional through the origin when no rising line fits."""
    x = np.array([p[0] for p in pairs], dtype=np.float64)
    y = np.array([p[1] for p in pairs], dtype=np.float64)
    if np.unique(x).size > 1:
        slope, intercept = np.polyfit(x, y, 1)
        resid = np.abs(y - (intercept + slope * x))
        keep = resid <= 3 * np.median(resid) + 1e-9
        if np.unique(x[keep]).size > 1:
            slope, intercept = np.polyfit(x[keep], y[keep], 1)
        if slope > 0 and intercept >= 0:
            return float(intercept), float(slope)
    return 0.0, float(np.median(y / x))


def _pull_fit(points: list[tuple[int, float]]) -> dict[str, float]:
    """Fetch's pull, ``fixed + bytes / bulk rate``, from ``(bytes, us)`` at two sizes (medians
    per size); proportional through the origin when the two sizes do not say more."""
    by: dict[int, list[float]] = defaultdict(list)
    for b, us in points:
        by[b].append(us)
    xs = sorted(by)
    ys = [_median(by[b]) for b in xs]
    if len(xs) > 1 and ys[-1] > ys[0]:
        slope = (ys[-1] - ys[0]) / (xs[-1] - xs[0])
        fixed = ys[0] - slope * xs[0]
        if fixed >= 0:
            return dict(fetch_fixed_us=fixed, bulk_bw_gbps=1.0 / (slope * 1e3))
    rate = sum(xs) / sum(ys)  # bytes per us
    return dict(fetch_fixed_us=0.0, bulk_bw_gbps=rate / 1e3)
