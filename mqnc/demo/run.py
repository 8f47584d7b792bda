"""The demo end to end: stand the instances up, calibrate, decode, verify, report, write
``demo.json`` and the PNG (see :mod:`mqnc.demo` for what it does and why)."""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

from tqdm import tqdm

from mqnc.base.runtime import device_name, kernel_mode
from mqnc.demo.calibration import calibrate
from mqnc.demo.cluster import Cluster, device_of
from mqnc.demo.config import DemoConfig
from mqnc.demo.report import Report, plot, print_table
from mqnc.demo.step import Decisions, Decoder
from mqnc.demo.verify import Verifier
from mqnc.demo.workload import Corpus, build_model, make_agents
from mqnc.model import MLAModel
from mqnc.serving import ChunkInfo, Requester

__all__ = ["run"]


def run(cfg: DemoConfig) -> dict:
    """:func:`mqnc.demo.run_demo` once the kernel mode is chosen."""
    device = device_of(cfg)
    if cfg.transport == "nvshmem" and device != "cuda":
        raise ValueError(
            "transport: 'nvshmem' needs a CUDA device (and nvshmem4py: pip install 'mqnc[gpu]'); "
            f"this machine has device {device!r}: use 'gloo' or 'loopback'"
        )
    t_start = time.perf_counter()
    model = build_model(cfg)
    corpus = Corpus(cfg, model)
    cluster = Cluster(cfg, model, corpus)
    req = None
    try:
        req = _requester(cfg, cluster, model, corpus, device)
        cal = calibrate(cfg, req, model.geometry, device)
        verifier = Verifier(model, corpus)
        decisions = Decisions(cfg, model, corpus, cal)
        kill = cluster.kill if cfg.kill_holder is not None else None
        agents = make_agents(cfg, corpus)
        decoder = Decoder(cfg, model, corpus, req, agents, decisions, verifier, device, kill)
        _decode(cfg, decoder, model)
        report = Report(cfg, model.geometry, corpus, cal, decoder.batch_work, decoder.deltas)
        rows = report.rows(req.costs, verifier.errors)
    finally:
        cluster.close(req)
    result = dict(
        config=dataclasses.asdict(cfg),
        device=device_name(),
        kernels=kernel_mode(),
        calibration=cal.to_dict(),
        decisions=list(decisions.table.values()),
        fallbacks=decoder.fallbacks,
        primitives=rows,
        max_abs_error={k: max(v) for k, v in verifier.errors.items()},
        checked={k: len(v) for k, v in verifier.errors.items()},
        # each agent's last hidden state: the --force runs of one config must agree on it
        final_hidden={a.name: a.hidden.flatten().tolist() for a in agents},
        wall_s=time.perf_counter() - t_start,
    )
    _write(cfg, result, verifier.errors, decisions.table, decoder.fallbacks)
    return result


def _requester(cfg: DemoConfig, cluster: Cluster, model: MLAModel, corpus: Corpus, device):
    """Rank 0's requester, every chunk of the corpus in its directory."""
    per_chunk_blocks = -(-cfg.max_tokens // cfg.block_size)
    req = Requester(
        cluster.transport,
        model.geometry,
        softmax_scale=model.softmax_scale,
        rope=model.rope,
        timeout_s=cfg.timeout_s,
        # every agent's chunks, every chunk once more, and the calibration's 6 copies
        pool_blocks=per_chunk_blocks * (cfg.agents * cfg.chunks_per_agent + cfg.chunks + 6),
        block_size=cfg.block_size,
        device=device,
        model=corpus.prefill_at,
    )
    for c, hs in corpus.placement().items():
        req.register(ChunkInfo(c, corpus.lengths[c], corpus.positions[c], hs))
    return req


def _decode(cfg: DemoConfig, decoder: Decoder, model: MLAModel) -> None:
    total = cfg.steps * model.geometry.layers * len(decoder.agents)
    desc = "decode (agent x layer x step)"
    with tqdm(total=total, desc=desc, file=sys.stderr, disable=not cfg.progress) as progress:
        decoder.run(progress if cfg.progress else None)


def _write(cfg: DemoConfig, result: dict, errors, decisions, fallbacks) -> None:
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "demo.json", "w") as f:
        json.dump(result, f, indent=2, default=float)
    rows = result["primitives"]
    plot(rows, out / "measured_vs_predicted.png")
    print_table(rows, errors, decisions, fallbacks, result["calibration"])
    print(
        f"\nwrote {out / 'demo.json'} and {out / 'measured_vs_predicted.png'} "
        f"({result['wall_s']:.0f} s, {result['device']}, kernels {result['kernels']})"
    )
