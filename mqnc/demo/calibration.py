"""This machine's constants for the demo's predicate (§4.3): the transport (probe + route sweep,
affine fit) and one timed call of each primitive's own work (holder compute, merge, splice,
re-prefill), measured through the demo's own requester against its holders."""

from __future__ import annotations

import dataclasses
import time

import torch

from mqnc.cost import FabricProfile, FitResult, SpliceProfile, bytes_to_us, fit, load_fabric
from mqnc.demo.config import DemoConfig
from mqnc.model import MLAGeometry
from mqnc.serving import ChunkInfo, Requester
from mqnc.triton_kernels.merge import merge_partials

__all__ = ["Calibration", "calibrate"]


@dataclasses.dataclass
class Calibration:
    """The constants of one run (times in us)."""

    fabric: FabricProfile
    fit: FitResult | None
    fit_error: str | None
    probe_samples_us: list[float]
    compute_us_per_row_token: float
    merge_us: float
    splice_us_per_token: float
    c_us: float

    def to_dict(self) -> dict:
        """The JSON form (``demo.json``'s ``calibration``)."""
        out = dataclasses.asdict(self)
        out["fit"] = None if self.fit is None else self.fit.to_dict()
        return out

    def splice_profile(self, cfg: DemoConfig) -> SpliceProfile:
        """The measured splice, linear in ``c_t`` over the corpus' chunk sizes."""
        per_tok = self.splice_us_per_token
        lo, hi = cfg.min_tokens, max(cfg.max_tokens, cfg.min_tokens + 1)
        return SpliceProfile((lo, hi), (per_tok * lo, per_tok * hi), "measured (demo calibration)")


def calibrate(cfg: DemoConfig, req: Requester, geometry: MLAGeometry, device: str) -> Calibration:
    """Measure with chunk 0 of ``req``'s directory; leaves ``req`` without cost records and
    with an empty pool (the calibration's calls are not the workload)."""
    info = req.directory[0]
    probes, samples, computes = _route_samples(req, info, geometry, device)
    fabric, result, fit_error = None, None, None
    if cfg.profile:
        fabric = load_fabric(cfg.profile)
    else:
        try:
            result = fit(samples, qp_row_bytes=geometry.qp_row_bytes, probe_us=probes)
            fabric = result.to_fabric("this-machine (demo calibration)")
        except ValueError as exc:
            # Decode-sized rows (M_q <= 256) on a fast local link are all fixed cost: the
            # slope drowns in noise. Then BW comes from the bulk fetch below and the fixed
            # cost from the smallest route (less the probe).
            fit_error = str(exc)
    c_us = _prefill_us(req, info) / (info.tokens * geometry.layers)
    pull = _best_pull(req, info)
    bulk_bw = pull.bytes_recv / (pull.return_us * 1e3)
    if fabric is None:
        fabric = _fabric_from_bulk(probes, samples, bulk_bw, geometry)
    if not cfg.profile:
        # fetch's pull is one bulk transfer (§2.2): price it with the measured pull
        fabric = dataclasses.replace(fabric, bulk_bw_gbps=bulk_bw)
    merge_us = _merge_us(geometry, device)
    req.costs.clear()
    req.clear_local()
    return Calibration(
        fabric=fabric,
        fit=result,
        fit_error=fit_error,
        probe_samples_us=probes,
        # holder compute per routed row and attended token (the interpreter on a CPU is far
        # from the paper's 15-37 us, which is the point of measuring it here)
        compute_us_per_row_token=sum(c / n for n, c in computes) / len(computes),
        merge_us=merge_us,
        splice_us_per_token=pull.splice_us / info.tokens,
        c_us=c_us,
    )


def _route_samples(req: Requester, info: ChunkInfo, g: MLAGeometry, device: str):
    """Probes (us), ``(M_q, round trip less compute)`` samples and ``(rows x tokens,
    compute_us)`` pairs of a short route sweep at 1, 4 and 16 query tokens."""
    holder = info.holders[0]
    for _ in range(20):  # warm the link up first (gloo's first transfers run slow)
        req.probe(holder)
    probes = [req.probe(holder) for _ in range(9)]
    samples, computes = [], []
    c0 = info.chunk_id
    req.route(c0, torch.randn(1, g.heads, g.d_qk, dtype=torch.bfloat16, device=device), 0)
    for rows in (1, 4, 16):
        q = torch.randn(rows, g.heads, g.d_qk, dtype=torch.bfloat16, device=device)
        for _ in range(2):
            rec = req.route(c0, q, 0).record
            computes.append((rows * g.heads * info.tokens, rec.compute_us))
            samples.append((rows * g.heads, rec.total_us - rec.compute_us))
    return probes, samples, computes


def _prefill_us(req: Requester, info: ChunkInfo) -> float:
    """One re-prefill of the chunk, timed after a warm-up call (first calls pay set-up)."""
    for k in range(2):
        t0 = time.perf_counter()
        req.local(info.chunk_id, offset=info.position + 1 + k)
        prefill_us = (time.perf_counter() - t0) * 1e6
    return prefill_us


def _best_pull(req: Requester, info: ChunkInfo):
    """The cost record of the best of three timed fetches (after a warm-up): a busy machine
    only ever slows a transfer down."""
    for k in range(4):
        req.fetch(info.chunk_id, offset=info.position + 3 + k)
    return min(req.costs[-3:], key=lambda r: r.return_us)


def _fabric_from_bulk(probes, samples, bulk_bw: float, g: MLAGeometry) -> FabricProfile:
    """A profile when the route fit failed: BW from the bulk pull, the turnaround from the
    smallest route less the probe."""
    probe = sorted(probes)[len(probes) // 2]
    fixed = min(t for m, t in samples if m == samples[0][0])
    turnaround = fixed - probe - bytes_to_us(samples[0][0] * g.qp_row_bytes, bulk_bw)
    return FabricProfile(
        "this-machine (demo calibration, route BW from the bulk fetch)",
        t_probe_us=probe,
        bw_gbps=bulk_bw,
        turnaround_us=max(turnaround, 0.0),
        source="mqnc demo calibration",
    )


def _merge_us(g: MLAGeometry, device: str) -> float:
    """One 4-way merge of a decode token's partials, timed after a warm-up call."""
    o = torch.randn(4, 1, g.heads, g.d_v, dtype=torch.bfloat16, device=device)
    lse = torch.randn(4, 1, g.heads, device=device)
    merge_partials(o, lse)
    t0 = time.perf_counter()
    merge_partials(o, lse)
    return (time.perf_counter() - t0) * 1e6
