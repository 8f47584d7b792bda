"""``mqnc demo --hf``: the README's Hugging Face example run as the demo runs, with its table.

A transformers DeepSeek causal LM (:func:`mqnc.integrations.hf.random_model`: DeepSeek-V2-Lite
attention dims, random weights; ``--hf deepseek_v3`` for the V3 class with query LoRA) prefills
a shared context once with its own forward; the latent cache is cut into chunks on holder
processes (gloo; ``--transport loopback``: threads) and the model then generates from a prompt
that follows the context placed at a **new offset** (:attr:`HFDemoConfig.offset`), so that route
must rotate the query and fetch must splice. The predicate picks route, fetch or local per chunk
with this machine's constants (calibrated against the holders, or ``--profile``); ``--force``
overrides.

At the end: the same table as ``mqnc demo`` (per primitive: calls, wire bytes, measured beside
predicted time per cost term, MAPE, the largest error of its partials against fp64,
:mod:`mqnc.demo.report`), and the exactness line: the tokens and logits against transformers'
own ``generate`` on the whole prompt, within the bound of :mod:`mqnc.integrations.hf_exactness`.
Beyond it, :func:`run` raises ``AssertionError`` (the CLI exits 1).
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import torch

from mqnc.base.runtime import device_name, kernel_mode
from mqnc.demo.config import HFDemoConfig
from mqnc.demo.preflight import make_out
from mqnc.demo.profile_file import load_profile
from mqnc.demo.report import plot, predict_call, primitive_rows, print_table
from mqnc.integrations.hf import HFSession, attach, prefill_context, random_model
from mqnc.integrations.hf_exactness import HFReference
from mqnc.serving import CostRecord, LocalHolders

__all__ = ["run"]


def _predict(session: HFSession, rec: CostRecord) -> dict[str, float]:
    """The cost model's terms for one recorded call with the session's constants (§4): a route
    priced with its holder batch, a fetch's splice only at a new offset, a local re-prefill of
    the context up to the chunk's end (a causal prefix)."""
    cal = session.cal
    c = session.corpus.chunks[rec.chunk_id]
    moved = session.chunk_offset(rec.chunk_id) != c.position
    return predict_call(
        rec,
        session.geometry,
        session.fabric,
        tokens=c.tokens,
        compute_us_per_row_token=cal["compute_us_per_row_token"],
        c_us=cal["c_us"],
        batch_work=session.batch_work.get(id(rec)),
        splice_us=cal["splice_us_per_token"] * c.tokens if moved else 0.0,
        prefill_tokens=c.start + c.tokens,
    )


def run(cfg: HFDemoConfig) -> dict:
    """:func:`mqnc.demo.run_hf_demo` once the kernel mode is chosen; returns the JSON-able
    result (also written to ``cfg.out/hf_demo.json``)."""
    t_start = time.perf_counter()
    # what can fail without the model is checked first, as `mqnc demo` does (checks.prepare)
    fabric = None if cfg.profile is None else load_profile(cfg.profile).fabric
    make_out(cfg.out)
    model, context, prompt = _workload(cfg)
    print(f"transformers' own generate on the whole prompt ({cfg.kind}, {cfg.dtype}) ...")
    ref = HFReference(model, context, prompt, max_new_tokens=cfg.new_tokens)
    corpus = prefill_context(
        model,
        context,
        chunk_tokens=cfg.chunk_tokens,
        holders=range(1, cfg.holders + 1),
        replicas=cfg.replicas,
    )
    print(
        f"context: {cfg.context_tokens} tokens prefilled once by the model's forward "
        f"({corpus.meta['prefill_us'] / 1e3:.0f} ms), {len(corpus.chunks)} chunks on "
        f"{cfg.holders} holders ({cfg.transport}), x{cfg.replicas}; used at offset "
        f"{cfg.offset if cfg.offset is not None else corpus.position}"
    )
    session, cal, out = _generate(cfg, model, corpus, prompt, fabric)
    ex = ref.check(out.sequences, out.logits, offset=cfg.offset)
    rows = primitive_rows(session.records(), lambda r: _predict(session, r), session.errors)
    decisions = {d["chunk"]: d for r in session.requests for d in r.decisions.values()}
    result = dict(
        config=dataclasses.asdict(cfg),
        device=device_name(),
        kernels=kernel_mode() if cfg.kernels == "triton" else "torch references",
        calibration=dict(cal, profile=cfg.profile),  # (the report: the fabric's source)
        decisions=list(decisions.values()),
        fallbacks=session.fallbacks,
        primitives=rows,
        max_abs_error={k: max(v) for k, v in session.errors.items()},
        checked={k: len(v) for k, v in session.errors.items()},
        tokens=out.sequences[0, cfg.prompt_tokens :].tolist(),
        reference_tokens=ref.tokens[0].tolist(),
        exactness=dataclasses.asdict(ex) | dict(ok=ex.ok),
        wall_s=time.perf_counter() - t_start,
    )
    _write(cfg, result, session, decisions, ex)
    if not ex.ok:
        raise AssertionError(ex.line())
    return result


def _workload(cfg: HFDemoConfig):
    """The random model, the shared context ``[context_tokens]`` and the prompt
    ``[1, prompt_tokens]`` (token ids drawn from ``cfg.seed + 1``)."""
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[cfg.dtype]
    lora = dict(q_lora_rank=1536) if cfg.kind == "deepseek_v3" else {}
    model = random_model(cfg.kind, seed=cfg.seed, dtype=dtype, **lora)
    g = torch.Generator().manual_seed(cfg.seed + 1)
    context = torch.randint(0, model.config.vocab_size, (cfg.context_tokens,), generator=g)
    prompt = torch.randint(0, model.config.vocab_size, (1, cfg.prompt_tokens), generator=g)
    return model, context, prompt


def _generate(cfg: HFDemoConfig, model, corpus, prompt, fabric):
    """Start the holders, attach the model, measure the session's constants
    (:meth:`HFSession.calibrate`; a given ``fabric`` is kept) and generate greedily:
    ``(session, calibration, generate's output)``. The fault drill kills ``cfg.kill_holder``
    at step ``cfg.kill_after_step``."""
    with LocalHolders(
        corpus, transport=cfg.transport, kernels=cfg.kernels, timeout_s=cfg.timeout_s
    ) as hs:

        def on_step(step: int) -> None:
            if cfg.kill_holder is not None and step == cfg.kill_after_step:
                hs.kill(cfg.kill_holder)

        session = attach(
            model,
            corpus,
            hs.requester(),
            offset=cfg.offset,
            force=cfg.force,
            fabric=fabric,
            steps=cfg.new_tokens,
            verify=True,
            on_step=on_step,
        )
        cal = session.calibrate()
        with torch.no_grad(), session:
            out = session.generate(
                prompt,
                max_new_tokens=cfg.new_tokens,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
            )
    return session, cal, out


def _write(cfg: HFDemoConfig, result: dict, session: HFSession, decisions: dict, ex) -> None:
    """``hf_demo.json``, the PNG (when a primitive ran), the table and the exactness line."""
    rows = result["primitives"]
    path = Path(cfg.out)
    path.mkdir(parents=True, exist_ok=True)
    (path / "hf_demo.json").write_text(json.dumps(result, indent=2, default=float))
    if rows:
        subtitle = f"{result['device']}\n{cfg.transport}, kernels {result['kernels']}"
        plot(rows, path / "hf_measured_vs_predicted.png", subtitle=subtitle)
    print_table(rows, session.errors, decisions, session.fallbacks, result["calibration"])
    print(ex.line())
    print(
        f"\nwrote {path / 'hf_demo.json'} ({result['wall_s']:.0f} s, {result['device']}, "
        f"kernels {result['kernels']})"
    )
