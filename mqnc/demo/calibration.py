"""This machine's constants for the demo's predicate (§4.3) and its predictions, each either
loaded from ``--profile`` or measured at start-up through the demo's own requester against its
holders, and each labelled with where it came from. With repeated decodes the measurement runs
in three rounds (before, between and after the repeats) and :func:`median_rounds` combines them.

What is measured (only what the profile lacks). Each measurement discards warm-ups, takes the
median of its repetitions and interleaves what it compares (a slow spell of the machine then
touches every size or shape alike, not one end of a line); lines are Theil-Sen fits
(:func:`mqnc.cost.theil_sen`: medians of pairwise slopes), which one descheduled call does not
move. The probes, the route sweep, the fetches and the merge are timed as the Hugging Face session's
are (:mod:`mqnc.serving.calibration_samples`, with this module's counts); the waves and the
re-prefill are the demo's own. The counts are the module's constants (:data:`PROBES` ...); the
Triton kernels under the interpreter repeat the rotating and splicing measurements fewer times
(:data:`INTERPRETED_COUNTS`: the same terms, sizes and shapes); the raw samples and the counts
used go to ``demo.json`` (``calibration.samples``).

- the fabric: ``T_probe`` (median of :data:`PROBES` probes after 10 warm-ups), ``BW`` and the
  turnaround (an affine fit, :func:`mqnc.cost.fit`, of isolated routes of 1, 4 and 16 query
  tokens: medians of :data:`ROUTE_REPS` rounds, the sizes interleaved, after one warm-up each);
- the routed call's two sides (:class:`~mqnc.demo.waves.RouteConstants`): the requester's send
  alone (median of :data:`ALONE` single-token routes, rotation included) and in a wave (the
  mean send of each wave to every holder, the median over the waves), and the holder's kernel
  call, ``fixed + per row-token x work`` (Theil-Sen) over the calls of waves to one holder at a
  time, batched the way the run batches them (several chunks per holder call, dense and
  selection): :data:`WAVE_REPS` rounds of every shape after a warm-up wave of each kind,
  each wave after the holders idled :data:`WAVE_GAP_S` (as the run's waves come);
- the holder's host work per request on its core (``host_us``: taking a request in, packing
  and putting its reply, which the kernel time the holder reports leaves out): the one value for
  which the wave model (:func:`mqnc.demo.waves.predict_wave`, with the constants above and the
  run's CPU plan) gives the calibration's own waves (to one holder at a time, and to every
  holder at once as the run's waves go out; of each shape, the round of median summed time)
  their measured summed time. These are the calibration's requests, sent before the run:
  nothing is taken from the run it predicts;
- fetch: a Theil-Sen line of the pull (the call less its splice) over :data:`FETCH_SIZES`
  chunk sizes spread over the corpus' range (:data:`FETCH_REPS` interleaved rounds after a
  warm-up round; its fixed part: the request's round trip; its slope: the bulk rate), the
  splice per token (median, at a new offset) and the pool write alone per token (median, at
  the canonical position);
- the merge of an agent's partials (median of 5) and the re-prefill cost per token-layer.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections import defaultdict

import numpy as np
import torch

from mqnc.cost import (
    MEASURED_TERMS,
    FabricProfile,
    MachineProfile,
    SpliceProfile,
    fit_pull,
    fit_route,
    robust_affine,
)
from mqnc.demo.config import LANES, DemoConfig
from mqnc.demo.profile_file import COMPUTE_TERMS, DEMO_TERMS, LoadedProfile
from mqnc.demo.waves import RouteConstants, WaveCall, predict_wave
from mqnc.model import MLAGeometry
from mqnc.serving import ChunkInfo, Requester
from mqnc.serving.calibration_samples import fetch_samples, merge_times, probe_times, route_sweep

__all__ = [
    "Calibration",
    "calibrate",
    "lacking",
    "median_rounds",
    "FABRIC_TERMS",
    "OWN_TERMS",
    "Counts",
    "COUNTS",
    "INTERPRETED_COUNTS",
    "counts_for",
]

FABRIC_TERMS = ("t_probe_us", "bw_gbps", "turnaround_us", "bulk_bw_gbps")
"""The fabric's terms the demo uses (a profile's, or measured)."""

OWN_TERMS = {
    "fetch": ("bulk_bw_gbps", "fetch_fixed_us", "splice_us_per_token", "scatter_us_per_token"),
    "local": ("c_us",),
}
"""The terms only one primitive's prediction reads (a route's reads the rest): measured in
rounds, each primitive takes its own terms whole from one round (:func:`median_rounds`)."""

PROBES = 21
"""Probes timed for ``T_probe`` (their median), after :data:`PROBE_WARMUP` warm-up probes."""
PROBE_WARMUP = 10
"""Untimed probes first (gloo's first transfers run slow)."""
ROUTE_SIZES = (1, 4, 16)
"""Query tokens of the isolated route sweep."""
ROUTE_REPS = 7
"""Rounds of the isolated route sweep (1, 4, 16 query tokens interleaved in each; medians)."""
ALONE = 16
"""Single-token routes with nothing else in flight timed for ``send_alone_us`` (median)."""
WAVE_REPS = 5
"""Rounds of the calibration's waves (each shape once per round, interleaved; medians)."""
WAVE_GAP_S = 0.05
"""Idle time before each calibration wave (s): the run's holders wait ~70 ms between its waves
(2 cores: a layer-step's ~115 ms, less its ~45 ms wave), which slows the next wave's calls."""
FETCH_SIZES = 4
"""Chunk sizes the pull is timed at (spread over the corpus' range; Theil-Sen line)."""
FETCH_REPS = 8
"""Rounds of fetches (every size once per round, interleaved) after a warm-up round."""
MERGE_REPS = 5
"""Merges timed (their median), after a warm-up merge."""


@dataclasses.dataclass(frozen=True)
class Counts:
    """How many times each measurement repeats (a run's counts: :data:`COUNTS`, or
    :data:`INTERPRETED_COUNTS` when its kernels run in Triton's interpreter)."""

    route_reps: int = ROUTE_REPS
    alone: int = ALONE
    wave_reps: int = WAVE_REPS
    fetch_reps: int = FETCH_REPS


COUNTS = Counts()
"""The counts above: a compiled run's (GPU) and a torch run's."""
INTERPRETED_COUNTS = Counts(route_reps=3, alone=5, wave_reps=3, fetch_reps=3)
"""A run with ``kernels="triton"`` under Triton's CPU interpreter (``TRITON_INTERPRET=1``):
every rotation and splice there is a Python call per operation per program (~0.3-1 s a call),
so the default counts made the calibration most of a small run. The same measurements of the
same terms, sizes and shapes (still medians, the sizes and shapes interleaved, after the same
warm-ups), three rounds each instead of 5-8: what an interpreted run measures is the
interpreter, whose spread is not what the counts were sized for."""


def counts_for(cfg: DemoConfig) -> Counts:
    """The counts of ``cfg``'s run: :data:`INTERPRETED_COUNTS` for the Triton kernels under the
    interpreter, else :data:`COUNTS`."""
    from mqnc.base.runtime import kernel_device
    from mqnc.triton_kernels._core.execution import interpreted

    device = cfg.device or kernel_device()
    return INTERPRETED_COUNTS if cfg.kernels == "triton" and interpreted(device) else COUNTS


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
        return RouteConstants.from_terms(self.terms)

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

    def machine_profile(self, cfg: DemoConfig, device_name: str = "") -> MachineProfile:
        """The constants as the predicate reads them: the fabric, every demo term, and the
        splice and pool write as lines over the corpus' chunk sizes
        (:meth:`splice_profile`)."""
        measured_with = dict(device=cfg.device, kernels=cfg.kernels, transport=cfg.transport)
        if device_name:
            measured_with["device_name"] = device_name
        sources, read = dict(self.sources), read_ceiling(device_name)
        if read is not None:
            sources["read_tbps"] = read[1]
        fp8 = cfg.kv_dtype == "fp8"  # (the splice measured is the cache format's own)
        return MachineProfile(
            self.fabric,
            splice=self.splice_profile(cfg, True),
            splice_fp8=self.splice_profile(cfg, True) if fp8 else None,
            splice_fp8_us_per_token=self.terms.get("splice_us_per_token") if fp8 else None,
            scatter=self.splice_profile(cfg, False),
            measured_with=measured_with,
            sources=sources,
            read_tbps=None if read is None else read[0],
            **{k: float(v) for k, v in self.terms.items() if k in MEASURED_TERMS},
        )

    def save_profile(self, path, cfg: DemoConfig, device_name: str) -> None:
        """Write everything as a profile (:class:`mqnc.cost.MachineProfile`'s schema;
        ``--profile`` loads it, nothing recalibrated). The splice and pool write are stored
        per token (the lines over this corpus' chunk sizes are not)."""
        profile = self.machine_profile(cfg, device_name)
        profile.replace(splice=None, splice_fp8=None, scatter=None).save(path)


def read_ceiling(device_name: str, records: list[dict] | None = None):
    """``(TB/s, source)``: the kernel-measured memory read ceiling of ``device_name`` in
    ``records`` (default: the results file, :func:`mqnc.measure.results_file.read_results`),
    which a profile's holder term is priced at; None when none was measured there (the profile
    then falls back to the device's HBM spec, :meth:`MachineProfile.holder_read_tbps`)."""
    from mqnc.cost.ceilings import memory_ceiling

    if not device_name:
        return None
    if records is None:
        from mqnc.measure.results_file import read_results

        try:
            records = read_results()
        except ValueError:  # a results file that is not records: no measured ceiling
            return None
    ceiling = memory_ceiling(records, device_name)
    if ceiling.read_tbps is None:
        return None
    return ceiling.read_tbps, ceiling.source


def _loaded(cfg: DemoConfig, profile: LoadedProfile | None):
    """``(fabric terms, demo terms, sources)`` a profile gives for this run: a demo profile's
    compute terms only when measured with the same kernels on the same device."""
    if profile is None:
        return {}, {}, {}
    name = "profile"
    fabric = {k: getattr(profile.fabric, k) for k in FABRIC_TERMS}
    if profile.fabric.link_peak_gbps is not None:  # the profile's bulk rate (FabricProfile.bulk_bw)
        fabric["bulk_bw_gbps"] = profile.fabric.bulk_bw
    fabric = {k: v for k, v in fabric.items() if v is not None}
    sources = dict.fromkeys(fabric, name)
    terms = dict(profile.terms)
    w = profile.measured_with
    if terms and (w.get("kernels"), w.get("device")) != (cfg.kernels, cfg.device):
        why = f"calibrated (profile: {w.get('kernels')} on {w.get('device')})"
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
    missing = _missing(fab, terms)
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
        link_peak_gbps=base.link_peak_gbps if base else None,
        **_host_fields(base),
        source=base.source if base else "mqnc demo calibration",
    )
    path = None if profile is None else profile.path
    return Calibration(fabric, terms, sources, m.probes, m.fit, m.fit_error, m.samples, path)


def _missing(fab: dict, terms: dict) -> list[str]:
    return [k for k in (*FABRIC_TERMS, *DEMO_TERMS) if k not in fab and k not in terms]


def lacking(cfg: DemoConfig, profile: LoadedProfile | None) -> list[str]:
    """The terms a run measures: every one ``profile`` (None: no profile) does not give it."""
    return _missing(*_loaded(cfg, profile)[:2])


def median_rounds(rounds: list[Calibration], predicted: list[dict[str, float]]):
    """The constants to predict with from calibration ``rounds`` (one round taken in a slow
    spell of the machine priced a whole run 30-50% off, while the decodes around it were
    not slow), and per primitive the round it takes.

    ``predicted[i][primitive]``: what round ``i`` predicts for the run's calls of that primitive
    (us, summed). Each primitive takes the round whose prediction is the median (the lower
    middle of an even count); the route's round gives everything but the other primitives' own
    terms (:data:`OWN_TERMS`), which come whole from theirs. Terms fitted together stay
    together: a term-by-term median would mix rounds.

    Returns
    -------
    (Calibration, dict of str to int)
    """
    prims = {p for pr in predicted for p in pr}
    choice = {
        p: sorted(range(len(rounds)), key=lambda i: predicted[i].get(p, 0.0))[
            (len(rounds) - 1) // 2
        ]
        for p in sorted(prims)
    }
    base = rounds[choice.get("route", 0)]
    fab, terms, sources = dataclasses.asdict(base.fabric), dict(base.terms), dict(base.sources)
    for prim, i in choice.items():
        if rounds[i] is base:
            continue
        for k in OWN_TERMS.get(prim, ()):
            if k in FABRIC_TERMS:
                fab[k] = getattr(rounds[i].fabric, k)
            elif k in rounds[i].terms:
                terms[k] = rounds[i].terms[k]
            sources[k] = rounds[i].sources.get(k, "calibrated")
    cal = dataclasses.replace(base, fabric=FabricProfile(**fab), terms=terms, sources=sources)
    return cal, choice


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
        self.counts = counts_for(cfg)
        infos = sorted(req.directory.values(), key=lambda i: (i.tokens, i.chunk_id))
        self.small = infos[0]
        # one chunk per size, spread over the corpus' range (both ends included)
        picks = np.linspace(0, len(infos) - 1, FETCH_SIZES).round().astype(int)
        by_size = {infos[i].tokens: infos[i] for i in picks}
        self.sizes = [by_size[t] for t in sorted(by_size)]
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

        if missing:
            self.samples["counts"] = dataclasses.asdict(self.counts)
        route_terms = {"t_probe_us", "bw_gbps", "turnaround_us"}
        alone: list[float] = []  # sends of single-token routes with nothing else in flight
        if route_terms & set(missing):
            fabric = self._fabric(alone)
            if self.fit_error is not None:
                missing = [k for k in missing if k != "bw_gbps"]  # from the bulk pull, below
            take(fabric)
        if {"send_us", "send_alone_us", "compute_fixed_us", "compute_us_per_row_token"} & set(
            missing
        ):
            take(self._route_sides(alone))
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
            self.notes["bw_gbps"] = "bulk rate (route fit failed)"
            bar.update(1)
        return got

    # -- the fabric: probes and an isolated route sweep ------------------------------------------
    def _q(self, tokens: int) -> torch.Tensor:
        g = self.g
        q = torch.randn(tokens, g.heads, g.d_qk, generator=self.gen).to(torch.bfloat16)
        return q.to(self.cfg.device)

    def _fabric(self, alone: list) -> dict[str, float]:
        """Probes and the isolated route sweep (:mod:`mqnc.serving.calibration_samples`), fitted by
        :func:`mqnc.cost.fit_route`; the single-token routes' sends go to ``alone``."""
        req, g, info = self.req, self.g, self.small
        self.probes = probe_times(req, self.holder, reps=PROBES, warmup=PROBE_WARMUP)
        # at a new offset (the query is rotated, as the run's are), the sizes interleaved (a
        # slow spell touches each) after one warm-up each (each size's first call runs slow)
        sweep = route_sweep(
            req,
            info.chunk_id,
            ROUTE_SIZES,
            reps=self.counts.route_reps,
            warmup=1,
            generator=self.gen,
            offset=info.position + 1,
        )
        alone += [s.send_us for s in sweep[1]]
        rts = {tokens: [s.round_trip_us for s in got] for tokens, got in sweep.items()}
        samples = [(tokens * g.heads, _median(rts[tokens])) for tokens in ROUTE_SIZES]
        self.samples["route_rows_us"] = {tokens * g.heads: rts[tokens] for tokens in ROUTE_SIZES}
        # the fit every calibration shares; when it fails (decode-sized rows on a fast local
        # link are all fixed cost) the fixed part is the smallest route less the probe, and BW
        # the bulk pull's (measured below)
        rf = fit_route(samples, self.probes, qp_row_bytes=g.qp_row_bytes)
        self.fit = None if rf.fit is None else rf.fit.to_dict()
        self.fit_error = rf.error
        return rf.terms()

    # -- the routed call's two sides: waves batched as the run batches ---------------------------
    def _wave(self, sparse: bool, holders: list[int]) -> list:
        """One wave shaped like the run's: single-token requests to ``holders``, up to
        ``LANES`` each over its chunks, grouped by holder (dense: at new offsets; selection:
        ``topk`` canonical entries spread over a holder's chunks). Returns ``(record, work)``
        per request."""
        cfg = self.cfg
        # the run's waves come after the requester's own work (merging, verifying): holders
        # idle for tens of ms, their threads asleep; the calibration's waves likewise
        time.sleep(WAVE_GAP_S)
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

    def _route_sides(self, alone: list) -> dict[str, float]:
        """The requester's send (alone: single routes, median; in a wave: each wave to every
        holder, the run's shape, gives its mean send, and the median over those waves is
        taken) and the holder's kernel call (a Theil-Sen line over the calls of waves to one
        holder at a time: its core's own speed)."""
        kinds = [False, True] if self.cfg.selection_agents else [False]
        info = self.small
        while len(alone) < self.counts.alone:  # single-token routes with nothing else in flight
            rec = self.req.route(info.chunk_id, self._q(1), 0, offset=info.position + 1).record
            alone.append(rec.transfer_us)
        # the kernel calls of batches like the run's, not isolated ones
        compute_pairs: list[tuple[int, float]] = []
        sends: list[list[float]] = []  # per wave to every holder: its requests' sends
        holders = sorted(self.by_holder)
        for sparse in kinds:  # a warm-up wave of each kind, not kept
            self._wave(sparse, holders)
        self.waves.clear()
        for _rep in range(self.counts.wave_reps):
            for sparse in kinds:
                for h in holders:
                    recs = self._wave(sparse, [h])
                    # one kernel call answers every request of its group: they carry the same
                    # kernel time in their reply headers
                    calls: dict[float, int] = defaultdict(int)
                    for rec, w in recs:
                        calls[rec.compute_us] += w
                    compute_pairs += [(w, us) for us, w in calls.items()]
                sends.append([rec.transfer_us for rec, _ in self._wave(sparse, holders)])
        self.samples["send_us"] = sends
        self.samples["send_alone_us"] = list(alone)
        self.samples["compute_work_us"] = list(compute_pairs)
        fixed, per_work = robust_affine(compute_pairs)
        return dict(
            # a wave's sends add up: their mean per wave; the median over the waves
            send_us=_median([float(np.mean(w)) for w in sends]),
            send_alone_us=_median(alone),
            compute_fixed_us=fixed,
            compute_us_per_row_token=per_work,
        )

    def _host_us(self, known: dict[str, float]) -> float:
        """The holder's host work per request on its core (:class:`RouteConstants`
        ``host_us``): the value for which the wave model (:func:`predict_wave`, with the
        constants measured so far and this run's CPU plan) gives the calibration's own waves
        (to one holder, and to every holder at once, as the run's; of each shape, its round of
        median summed time: :func:`_median_waves`) their measured summed time
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
        waves = _median_waves(self.waves)
        measured = sum(sum(totals) for _, totals in waves)

        def predicted(host: float) -> float:
            k = dataclasses.replace(base, host_us=host)
            return sum(
                t["total"]
                for calls, _ in waves
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

    # -- fetch: the pull over the corpus' chunk sizes, the splice -------------------------------
    def _fetch(self, pull: bool) -> dict[str, float]:
        """The pull (the call less its splice) over up to ``FETCH_SIZES`` chunk sizes spread
        over the corpus' range, the sizes interleaved in each of ``FETCH_REPS`` rounds after a
        warm-up round (a slow spell of the machine then touches every size, not one end of the
        line); the splice per token at a new offset each time; the pool write alone per token
        (at the canonical position, median). From an empty pool, each round's copies evicted
        after it (:func:`mqnc.serving.calibration_samples.fetch_samples`)."""
        self.req.clear_local()  # the decodes' copies: the calibration's calls are not the run's
        infos = self.sizes if pull else [self.small]
        reps = self.counts.fetch_reps
        moved = fetch_samples(self.req, [i.chunk_id for i in infos], rounds=reps, warmup=1)
        at_home = fetch_samples(self.req, [self.small.chunk_id], rounds=reps, warmup=1, moved=False)
        points = [(s.bytes, s.pull_us) for s in moved]
        self.samples["fetch_bytes_us"] = points
        out = dict(
            splice_us_per_token=_median([s.splice_us_per_token for s in moved]),
            scatter_us_per_token=_median([s.splice_us_per_token for s in at_home]),
        )
        if pull:
            out.update(fit_pull(points))
        return out

    def _merge_us(self) -> float:
        """One merge of an agent's partials (its chunks and its suffix), median of
        :data:`MERGE_REPS` after a warm-up."""
        cfg = self.cfg
        m = max(cfg.chunks_per_agent if cfg.whole_agents else 0, 1) + 1
        times = merge_times(
            cfg.kernels,
            m,
            self.g,
            generator=self.gen,
            dtype=torch.bfloat16,
            device=cfg.device,
            reps=MERGE_REPS,
        )
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


def _median_waves(waves: list[tuple[list, list[float]]]) -> list[tuple[list, list[float]]]:
    """Of the repetitions of each wave shape (the same calls in the same order), the one whose
    summed measured time is the median (the lower of the two middle ones for an even count): a
    round the OS slowed down does not move ``host_us``, and every shape still counts once, with
    its own weight (its summed time), in the order the shapes were first sent."""
    by_shape: dict[tuple, list] = defaultdict(list)
    for calls, totals in waves:
        by_shape[tuple(calls)].append((calls, totals))
    out = []
    for reps in by_shape.values():
        reps = sorted(reps, key=lambda w: sum(w[1]))
        out.append(reps[(len(reps) - 1) // 2])
    return out
