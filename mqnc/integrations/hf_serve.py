"""The requester job of ``mqnc serve --generate``: a Hugging Face DeepSeek model, loaded from a
folder by each requester rank, generates from its prompt with the shared context on the job's
holders (:func:`mqnc.serving.run_rank` calls it with a :class:`mqnc.serving.ServeContext`)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from mqnc.base.checks import check_int
from mqnc.integrations.hf_session import attach
from mqnc.serving import ServeContext

__all__ = ["serve_generate", "read_prompts"]


def read_prompts(path: str, vocab_size: int) -> list[list[int]]:
    """The prompts of the JSON file ``path`` (``{"prompts": [[ids], ...]}``): a non-empty list
    of non-empty lists of int token ids in ``[0, vocab_size)``, else a ``ValueError`` naming
    ``prompts``, what it expected and what it got."""
    want = f"a JSON file {{'prompts': [[ids], ...]}} of token ids in [0, {vocab_size})"
    try:
        table = json.loads(Path(path).read_text())["prompts"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"prompts: expected {want}, got {path!r} ({exc})") from None
    if not isinstance(table, list) or not table:
        raise ValueError(f"prompts: expected {want}, got {table!r} in {path!r}")
    for i, ids in enumerate(table):
        ok = isinstance(ids, list) and ids
        ok = ok and all(type(t) is int and 0 <= t < vocab_size for t in ids)
        if not ok:
            raise ValueError(f"prompts: expected {want}, got prompt {i} = {ids!r} in {path!r}")
    return table


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
    from transformers import AutoConfig, AutoModelForCausalLM

    max_new_tokens = check_int("max_new_tokens", max_new_tokens, minimum=1)
    # the prompts are checked against the model's vocabulary before the model is loaded
    table = read_prompts(prompts, AutoConfig.from_pretrained(model).vocab_size)
    lm = AutoModelForCausalLM.from_pretrained(model, dtype=ctx.corpus.dtype).eval().to(device)
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
