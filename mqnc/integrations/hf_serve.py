"""The requester job of ``mqnc serve --generate``: a Hugging Face DeepSeek model, loaded from a
folder by each requester rank, generates from its prompt with the shared context on the job's
holders (:func:`mqnc.serving.run_rank` calls it with a :class:`mqnc.serving.ServeContext`)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from mqnc.integrations.hf_session import attach
from mqnc.serving import ServeContext

__all__ = ["serve_generate"]


def serve_generate(
    ctx: ServeContext,
    *,
    model: str,
    prompts: str,
    max_new_tokens: int = 16,
    force: str | None = None,
    offset: int | None = None,
    out: str | None = None,
    device: torch.device | str = "cpu",
) -> dict:
    """Generate greedily from prompt ``requester_index % len(prompts)`` of the JSON file
    ``prompts`` (``{"prompts": [[ids], ...]}``) with the model in folder ``model``
    (``from_pretrained``, in the corpus' dtype) attached to the corpus through this rank's
    requester; returns (and, with ``out``, writes to ``out/rank<r>.json``) the tokens, the
    decisions, the fallbacks and the successful calls per primitive."""
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(model, dtype=ctx.corpus.dtype).eval().to(device)
    try:
        table = json.loads(Path(prompts).read_text())["prompts"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(
            f"prompts: expected a JSON file {{'prompts': [[ids], ...]}}, got {prompts!r} ({exc})"
        ) from None
    prompt = torch.tensor([table[ctx.requester_index % len(table)]], device=lm.device)
    with torch.no_grad(), attach(lm, ctx.corpus, ctx.requester, force=force, offset=offset) as s:
        ids = s.generate(prompt, max_new_tokens=max_new_tokens, do_sample=False)
    result = dict(
        rank=ctx.rank,
        requester_index=ctx.requester_index,
        prompt=prompt[0].tolist(),
        tokens=ids[0, prompt.shape[1] :].tolist(),
        decisions=[d for r in s.requests for d in r.decisions.values()],
        fallbacks=s.fallbacks,
        calls={
            p: sum(1 for r in s.records() if r.primitive == p and r.ok)
            for p in ("route", "fetch", "local")
        },
    )
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / f"rank{ctx.rank}.json").write_text(json.dumps(result))
    return result
