"""A DeepSeek-V3.2-style model (DSA: the indexer's top-k) decoding over holders: transformers'
own ``DeepseekV32ForCausalLM`` ``generate``, its attention served by sparse routes to the holders
that hold each query token's selection (:mod:`mqnc.integrations.hf_v32`), gives transformers'
tokens; with an FP8 cache on the holders, the tokens of the same model attending an FP8-rounded
cache.

Model: :func:`~mqnc.integrations.hf_v32.random_v32_model` in bf16 (2 layers, hidden 64, 2
heads, ``kv_lora_rank`` 128, RoPE 16, an indexer of 16 heads x 32 selecting 8 entries). Every run:
a 24-token context prefilled once by the model's own forward, cut into 3 chunks of 8 on 2
holders (loopback threads), a 4-token prompt, 6 greedy tokens, so each query token attends 8 of
its 28..34 visible tokens and a layer's selection leaves chunks out. The holders' and the
requester's arithmetic runs on the torch references (``kernels="torch"``) except in
``test_interpreted_kernels_fp8_route``, which runs the Triton kernels (interpreted here) for 2
tokens over FP8 holders: the holders' ``mla_sparse_partial`` reading FP8 entries and the
requester's ``merge_partials``.

Oracles: transformers' own ``generate`` on ``context + prompt`` (tokens equal, logits within
``rho * E`` of it, ``E`` its own distance from the float64 model:
:class:`~mqnc.integrations.hf_exactness.HFReference`; in bf16 ``E`` is large, 1.7 logits, as the
float64 model's indexer selects other entries, so the same model in fp32 checks the logits
tightly), its own indexer's selections (equal), and
for the FP8 cache the same model generating through
:func:`~mqnc.integrations.hf_v32.fp8_rounded_cache` (tokens equal); the agreement of the FP8 run
with the bf16 one is printed, not asserted (the FP8 rounding may change a token).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from mqnc.integrations.hf import attach  # noqa: E402
from mqnc.integrations.hf_exactness import HFReference  # noqa: E402
from mqnc.integrations.hf_v32 import (  # noqa: E402
    V32Context,
    attach_v32,
    chunk_selections,
    fp8_rounded_cache,
    prefill_v32_context,
    random_v32_model,
)
from mqnc.serving import LocalHolders  # noqa: E402
from mqnc.transport.wire import HEADER_BYTES, query_payload_bytes  # noqa: E402

CONTEXT, PROMPT, STEPS, CHUNK = 24, 4, 6, 8


class Tiny:
    """The bf16 model, its context and prompt, transformers' own run (with its indexer's
    selections) and the bf16 context on holders."""

    def __init__(self) -> None:
        self.model = random_v32_model(seed=0, dtype=torch.bfloat16)
        g = torch.Generator().manual_seed(1)
        self.ctx = torch.randint(0, self.model.config.vocab_size, (CONTEXT,), generator=g)
        self.prompt = torch.randint(0, self.model.config.vocab_size, (1, PROMPT), generator=g)
        with selections(self.model) as self.ref_selections:
            self.ref = HFReference(self.model, self.ctx, self.prompt, max_new_tokens=STEPS)
        self.context = prefill_v32_context(
            self.model, self.ctx, chunk_tokens=CHUNK, holders=[1, 2], kernels="torch"
        )


@pytest.fixture(scope="module")
def tiny() -> Tiny:
    return Tiny()


class selections:
    """Records every indexer call's selection ``[B, S, k]`` (layer order), as a context
    manager."""

    def __init__(self, model) -> None:
        self.layers = [layer.self_attn.indexer for layer in model.model.layers]
        self.got: list[torch.Tensor] = []
        self.hooks = []

    def __enter__(self) -> list:
        for m in self.layers:
            self.hooks.append(m.register_forward_hook(lambda m, a, out: self.got.append(out)))
        return self.got

    def __exit__(self, *exc) -> None:
        for h in self.hooks:
            h.remove()


def run(model, context, holders, **kw):
    """One greedy ``generate`` of ``STEPS`` tokens through a V3.2 session: (output, session)."""
    prompt = kw.pop("prompt")
    with torch.no_grad(), attach_v32(model, context, holders.requester(), **kw) as s:
        out = s.generate(
            prompt,
            max_new_tokens=kw.get("steps", STEPS),
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    return out, s


def test_bf16_route_is_transformers_generate(tiny):
    """bf16 cache on holders, every chunk routed with its share of the selection: the tokens
    of transformers' own generate, logits within rho * E, each layer's selection transformers'
    own indexer's, and the selection decides which holders are contacted."""
    with LocalHolders(tiny.context.corpus, kernels="torch") as hs, selections(tiny.model) as got:
        out, s = run(tiny.model, tiny.context, hs, prompt=tiny.prompt)
    ex = tiny.ref.check(out.sequences, out.logits)
    print(ex.line())
    assert ex.ok and ex.tokens_equal, ex.line()
    theirs_all = tiny.ref_selections[: STEPS * 2]  # generate's (then HFReference's fp64 copy)
    assert len(got) == STEPS * 2
    for ours, theirs in zip(got, theirs_all, strict=True):  # the prompt: its last rows
        assert torch.equal(ours.sort(-1).values, theirs[:, -ours.shape[1] :].sort(-1).values)
    assert {r.primitive for r in s.records()} == {"route"} and not s.fallbacks
    assert all(r.ok for r in s.records())
    contacted = [len(x["chunks"]) for x in s.selections]
    assert min(contacted) < len(tiny.context.corpus.chunks)  # a layer skipped a chunk
    assert len(s.records()) == sum(contacted)  # one route per selected chunk and layer
    g = tiny.context.corpus.geometry  # on the wire: the rows plus 4 B per selected entry
    sent = [
        HEADER_BYTES + query_payload_bytes(x["rows"], g.heads, g.d_qk, k, torch.bfloat16)
        for x in s.selections
        for k in x["chunks"].values()
    ]
    assert sum(r.bytes_sent for r in s.records()) == sum(sent)


def test_a_holder_killed_mid_way_its_replica_answers(tiny):
    """Every chunk on 2 holders (replicas); holder 1 killed before the third forward: its
    chunks' selections are routed to their replica on holder 2 (the transport knows holder 1
    dead, so no route waits for it), same tokens."""
    context = prefill_v32_context(
        tiny.model, tiny.ctx, chunk_tokens=CHUNK, holders=[1, 2], replicas=2, kernels="torch"
    )
    with LocalHolders(context.corpus, kernels="torch") as hs:
        kill = lambda step: hs.kill(1) if step == 2 else None  # noqa: E731
        out, s = run(tiny.model, context, hs, prompt=tiny.prompt, on_step=kill)
    assert torch.equal(out.sequences[:, PROMPT:], tiny.ref.tokens)
    assert s.fallbacks and {(f["decided"], f["used"], f["peer"]) for f in s.fallbacks} == {
        ("route", "route", 2)
    }
    assert {f["step"] for f in s.fallbacks} == set(range(2, STEPS))


def test_fp32_logits_within_transformers_own_error(tiny):
    """The same model in fp32 (where transformers' own distance from the float64 model is
    ~1e-6, not bf16's selection flips), a batch of 2 prompts: equal tokens and logits within
    rho * E."""
    model = random_v32_model(seed=0, dtype=torch.float32)
    prompts = torch.cat([tiny.prompt, tiny.prompt.flip(1)])  # a batch of 2
    ref = HFReference(model, tiny.ctx, prompts, max_new_tokens=STEPS)
    context = prefill_v32_context(model, tiny.ctx, chunk_tokens=CHUNK, holders=[1, 2])
    with LocalHolders(context.corpus, kernels="torch") as hs:
        out, _ = run(model, context, hs, prompt=prompts)
    ex = ref.check(out.sequences, out.logits)
    print(ex.line())
    assert ex.ok and ex.tokens_equal and ex.hf_error_max < 1e-4, ex.line()


def test_fp8_cache_is_the_fp8_rounded_model(tiny):
    """FP8 entries on holders (656-byte format, here 164 B: 128 latent + 1 scale + 16 RoPE):
    the tokens of the same model generating through an FP8-rounded cache, by route (the
    holders attend their FP8 entries) and by fetch (the requester's FP8 pool); the FP8 bytes
    the holders keep dequantize to the very cache the model attended."""
    model = tiny.model
    fp8 = prefill_v32_context(
        model, tiny.ctx, chunk_tokens=CHUNK, holders=[1, 2], kernels="torch", fp8=True
    )
    corpus = fp8.corpus
    assert corpus.geometry.cache_dtype == "fp8_e4m3" and corpus.entries.dtype == torch.uint8
    assert corpus.entries.shape == (2, CONTEXT, 128 + 4 + 2 * 16)
    assert torch.equal(fp8.index_keys[0], tiny.context.index_keys[0])  # before any attention
    cache = fp8_rounded_cache(model)
    full = torch.cat([tiny.ctx[None], tiny.prompt], dim=1)
    with torch.no_grad():
        rounded = model.generate(
            full, max_new_tokens=STEPS, do_sample=False, cache=cache, return_dict_in_generate=True
        )
    from mqnc.triton_kernels.ops import backend_ops

    back = backend_ops("torch").fp8_dequantize(corpus.entries, 128, 16, torch.bfloat16)
    for layer in range(2):
        kept = torch.cat([cache.layers[layer].keys, cache.layers[layer].values], -1)[0, 0]
        assert torch.equal(back[layer], kept[:CONTEXT])
    want = rounded.sequences[:, CONTEXT + PROMPT :]
    with LocalHolders(corpus, kernels="torch") as hs:
        for force in ("route", "fetch"):
            out, s = run(model, fp8, hs, prompt=tiny.prompt, force=force)
            got = out.sequences[:, PROMPT:]
            assert torch.equal(got, want), (force, got, want)
            assert {r.primitive for r in s.records()} == {force} and not s.fallbacks
            assert all(r.ok for r in s.records())
    same = int((want == tiny.ref.tokens).sum())
    print(f"FP8 cache: {STEPS}/{STEPS} tokens equal to the FP8-rounded model's; {same}/{STEPS} "
          "equal to transformers' bf16 generate")  # fmt: skip


def test_interpreted_kernels_fp8_route(tiny):
    """The Triton kernels (interpreted) over FP8 holders: the holders' mla_sparse_partial reading
    each chunk's selected FP8 entries in place, and the requester's merge, 2 tokens: the first
    2 tokens of the model generating through an FP8-rounded cache."""
    model = tiny.model
    fp8 = prefill_v32_context(model, tiny.ctx, chunk_tokens=CHUNK, holders=[1, 2], fp8=True)
    full = torch.cat([tiny.ctx[None], tiny.prompt], dim=1)
    with torch.no_grad():
        want = model.generate(
            full, max_new_tokens=2, do_sample=False, cache=fp8_rounded_cache(model)
        )
    with LocalHolders(fp8.corpus, kernels="triton") as hs:
        out, s = run(model, fp8, hs, prompt=tiny.prompt, steps=2)
    assert torch.equal(out.sequences[:, PROMPT:], want[:, CONTEXT + PROMPT :])
    assert s.kernels == "triton" and {r.primitive for r in s.records()} == {"route"}
    assert not s.fallbacks


def test_chunk_selections_split_a_selection_by_chunk(tiny):
    """Indices over the sequence (context first) become each chunk's chunk-local indices,
    valid ones first, -1 after; the requester's own tokens and unselected chunks drop out."""
    sel = torch.tensor([[0, 9, 30, 17, 8], [23, 25, 1, 2, 3]])
    got = chunk_selections(sel, tiny.context.corpus)
    assert sorted(got) == [0, 1, 2]
    assert got[0].tolist() == [[0, -1, -1], [1, 2, 3]]
    assert got[1].tolist() == [[1, 0], [-1, -1]]
    assert got[2].tolist() == [[1], [7]]
    assert chunk_selections(torch.tensor([[24, 26]]), tiny.context.corpus) == {}


def test_refusals(tiny):
    """A V3.2 model through the dense session, the local primitive, indexer keys of the wrong
    shape, another context type: each a clear error naming it."""
    ctx = tiny.context
    with LocalHolders(ctx.corpus, kernels="torch") as hs:
        req = hs.requester()
        with pytest.raises(TypeError, match="attach it with mqnc.integrations.hf_v32.attach_v32"):
            attach(tiny.model, ctx.corpus, req)
        with pytest.raises(ValueError, match="force: expected 'route' or 'fetch'"):
            attach_v32(tiny.model, ctx, req, force="local")
        with pytest.raises(ValueError, match=r"context.index_keys: expected shape \(2, 24, 32\)"):
            attach_v32(tiny.model, V32Context(ctx.corpus, ctx.index_keys[:, :5]), req)
        with pytest.raises(TypeError, match="context: expected a V32Context"):
            attach_v32(tiny.model, ctx.corpus, req)
