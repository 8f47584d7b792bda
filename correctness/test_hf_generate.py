"""A real model, run by code nobody here wrote: transformers' DeepSeek-V2 / V3 ``generate`` with
its shared context on holders produces the tokens of its own ``generate`` on the whole prompt
(§2.1, §3.3).

Models: small random-weight ``DeepseekV2ForCausalLM`` / ``DeepseekV3ForCausalLM``
(:func:`mqnc.integrations.hf.random_model`): DeepSeek-V2-Lite's attention dims (16 heads,
``kv_lora_rank`` 512, ``qk_rope_head_dim`` 64, ``qk_nope_head_dim`` 128, ``v_head_dim`` 128, YaRN
factor 40), DeepSeek-V3's ``q_lora_rank`` 1536 where there is a query LoRA, 2 layers (one dense
MLP, one MoE), hidden 512, vocabulary 512. Both pair layouts: V2 caches ``k_pe`` in interleaved
pairs, V3 in halves (``rope_interleave`` True: permuted; False: ``rotate_half`` as is).

Every run: a context of 300 tokens prefilled once by the model's own forward and cut into chunks
on 1..4 holders, an 8-token prompt, 16 greedy tokens. The oracle is transformers' own
``generate`` on ``context + prompt`` (same weights, one instance): tokens equal, logits within
``rho * (E + S)`` where ``E`` is transformers' own distance from the float64 model and ``S`` its
own shift noise (:mod:`mqnc.integrations.hf_exactness`, ``mqnc.testing.TOLERANCES["hf_logits"]``).
bf16 runs are also forced onto transformers' tokens so that all 16 steps are compared even past
a bf16 tie.

Where the kernels run: every run uses the torch references (:mod:`mqnc.serving.compute`, ``kernels=
"torch"``) for the holders' partial attention, the merge, the query rotation and the splice,
except ``test_kernels_*``, which run the Triton kernels (interpreted on a CPU): the holders'
``mla_decode_partial``, the requester's ``rope_rotate`` (route at an offset) or ``rope_splice``
and ``mla_decode_partial`` in its pool (fetch at an offset), and ``merge_partials``.
"""

from __future__ import annotations

import os
import pathlib
import re

import pytest
import torch

pytest.importorskip("transformers")

from mqnc.integrations.hf import attach, prefill_context, random_model  # noqa: E402
from mqnc.integrations.hf_exactness import HFReference  # noqa: E402
from mqnc.serving import LocalHolders  # noqa: E402

CONTEXT, PROMPT, STEPS = 300, 8, 16
MODELS = {
    "v2": dict(kind="deepseek_v2"),
    "v2-lora": dict(kind="deepseek_v2", q_lora_rank=1536),
    "v3": dict(kind="deepseek_v3", q_lora_rank=1536),
    "v3-rotate-half": dict(kind="deepseek_v3", rope_interleave=False),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
_CACHE: dict = {}


def setup(name: str, dtype: str = "fp32"):
    """(model, context ids, prompt ids, HFReference), built once per (model, dtype)."""
    key = (name, dtype)
    if key not in _CACHE:
        spec = dict(MODELS[name])
        model = random_model(spec.pop("kind"), seed=0, dtype=DTYPES[dtype], **spec)
        g = torch.Generator().manual_seed(1)
        ctx = torch.randint(0, model.config.vocab_size, (CONTEXT,), generator=g)
        prompt = torch.randint(0, model.config.vocab_size, (1, PROMPT), generator=g)
        ref = HFReference(model, ctx, prompt, max_new_tokens=STEPS)
        _CACHE[key] = (model, ctx, prompt, ref)
    return _CACHE[key]


def generate(model, corpus, holders, *, forced_by=None, fallbacks=False, **session):
    """One ``generate`` through a session on ``holders``: (output, session); no primitive may
    have failed over unless ``fallbacks``."""
    kw = {} if forced_by is None else dict(logits_processor=forced_by.forcing())
    prompt = session.pop("prompt")
    with torch.no_grad(), attach(model, corpus, holders.requester(), **session) as s:
        out = s.generate(
            prompt,
            max_new_tokens=STEPS,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            **kw,
        )
    assert fallbacks or not s.fallbacks, s.fallbacks
    return out, s


def killer(holders, *, rank: int, step: int):
    """``on_step``: kill holder ``rank`` before forward pass ``step``."""

    def on_step(s: int) -> None:
        if s == step:
            holders.kill(rank)

    return on_step


def check(ref, out, *, offset=None, forced=False, fp32_exact=True):
    ex = ref.check(out.sequences, out.logits, offset=offset, forced=forced)
    print(ex.line())
    assert ex.ok, ex.line()
    if fp32_exact and ref.model.dtype == torch.float32:
        assert ex.tokens_equal, ex.line()  # no tie is anywhere near fp32's bound
    return ex


def corpus_of(name, dtype="fp32", *, holders, replicas=1, chunk_tokens=64):
    model, ctx, _, _ = setup(name, dtype)
    return prefill_context(
        model, ctx, chunk_tokens=chunk_tokens, holders=range(1, holders + 1), replicas=replicas
    )


@pytest.mark.parametrize(
    "name, holders, force",
    [
        ("v2", 1, "route"),
        ("v2-lora", 2, "route"),
        ("v3", 3, "route"),
        ("v3-rotate-half", 4, "route"),
        ("v2", 3, "fetch"),
        ("v3", 2, "local"),
        ("v3-rotate-half", 2, None),  # the predicate decides (h100-ibgda constants)
    ],
)
def test_generate_matches_hf(name, holders, force):
    model, _, prompt, ref = setup(name)
    corpus = corpus_of(name, holders=holders)
    with LocalHolders(corpus, kernels="torch") as hs:
        out, s = generate(model, corpus, hs, prompt=prompt, force=force, fabric="h100-ibgda")
    check(ref, out)
    used = {r.primitive for r in s.records() if r.ok}
    decided = {d["primitive"] for d in s.requests[0].decisions.values()}
    assert used == decided and (force is None or decided == {force})
    assert not s.fallbacks


@pytest.mark.parametrize(
    "name, force, offset",
    [("v3", "route", 77), ("v2", "fetch", 77), ("v3-rotate-half", "local", 1000)],
)
def test_context_at_another_offset(name, force, offset):
    """The context prefilled at positions 0.. is used at ``offset``.. (route rotates the query
    by -offset, fetch splices by +offset, local re-prefills there); RoPE is relative, so the
    tokens are those of transformers' generate with the context at 0."""
    model, _, prompt, ref = setup(name)
    corpus = corpus_of(name, holders=2)
    with LocalHolders(corpus, kernels="torch") as hs:
        out, s = generate(model, corpus, hs, prompt=prompt, force=force, offset=offset)
    assert s.context_end == offset + CONTEXT
    ex = check(ref, out, offset=offset)
    assert ex.shift_max > 0  # the bound carries transformers' own shift noise


@pytest.mark.parametrize("name, holders, force", [("v2", 2, "route"), ("v3", 3, "fetch")])
def test_bf16(name, holders, force):
    """bf16 weights, cache, wire and holders: the free run's tokens agree up to the first bf16
    tie, and a run forced onto transformers' tokens agrees at all 16 steps."""
    model, _, prompt, ref = setup(name, "bf16")
    corpus = corpus_of(name, "bf16", holders=holders)
    assert corpus.dtype == torch.bfloat16
    with LocalHolders(corpus, kernels="torch") as hs:
        free, _ = generate(model, corpus, hs, prompt=prompt, force=force)
        forced, _ = generate(model, corpus, hs, prompt=prompt, force=force, forced_by=ref)
    check(ref, free)
    ex = check(ref, forced, forced=True)
    assert ex.compared_steps == STEPS


def reference_at(name: str, dtype: str, position: int):
    """transformers' own greedy generate of :func:`setup`'s context and prompt with the context
    at ``position`` (built once per key)."""
    key = (name, dtype, position)
    if key not in _CACHE:
        model, ctx, prompt, _ = setup(name, dtype)
        _CACHE[key] = HFReference(model, ctx, prompt, max_new_tokens=STEPS, position=position)
    return _CACHE[key]


@pytest.mark.parametrize(
    "name, force, offset, kernels",
    [
        ("v3", "route", 333, "torch"),
        ("v3", "route", 1000, "torch"),
        ("v2", "fetch", 1000, "torch"),
        ("v2", "fetch", 1000, "triton"),
    ],
)
def test_bf16_context_far_from_where_it_was_prefilled(name, force, offset, kernels):
    """A model cast to bf16 encodes positions with its bf16-rounded rotary buffer ``inv_freq``;
    the context prefilled at 0 and used at ``offset`` (route rotates the query by -offset,
    fetch splices by +offset) must be rotated with those same frequencies, so that the run is
    transformers' own generate with the context at ``offset``: equal tokens at all 16 steps
    and logits within transformers' own error ``rho * E`` (no shift-noise allowance: both runs
    place every token at the same position). Rotating with the config's fp32 frequencies
    instead drifts with ``offset * (rounded - exact)`` past that bound.

    One free run: its tokens must be transformers' at every step, so its logits are compared at
    all 16 (a run forced onto those tokens would be the same computation on the same inputs,
    the same logits: it would only differ where the free run already fails)."""
    model, _, prompt, _ = setup(name, "bf16")
    ref = reference_at(name, "bf16", offset)
    corpus = corpus_of(name, "bf16", holders=2)
    assert corpus.rope.inv_freq == tuple(model.model.rotary_emb.inv_freq.double().tolist())
    with LocalHolders(corpus, kernels=kernels) as hs:
        free, _ = generate(model, corpus, hs, prompt=prompt, force=force, offset=offset)
    ex = check(ref, free, offset=offset)
    assert ex.tokens_equal and ex.shift_max == 0, ex.line()
    assert ex.compared_steps == STEPS and not ex.mismatches, ex.line()


def test_kernels_route_at_offset_fp32():
    """The Triton kernels (interpreted on a CPU): holder mla_decode_partial, requester
    rope_rotate, merge_partials; V3 halves layout, query LoRA, the context as one chunk."""
    model, _, prompt, ref = setup("v3")
    corpus = corpus_of("v3", holders=1, chunk_tokens=CONTEXT)
    with LocalHolders(corpus, kernels="triton") as hs:
        out, s = generate(model, corpus, hs, prompt=prompt, force="route", offset=77)
    assert s.kernels == "triton"
    check(ref, out, offset=77)


def test_kernels_fetch_at_offset_bf16():
    """The Triton kernels in bf16: rope_splice of the fetched chunks, mla_decode_partial over
    the requester's pool, merge_partials; V2 interleaved layout."""
    model, _, prompt, ref = setup("v2", "bf16")
    corpus = corpus_of("v2", "bf16", holders=1, chunk_tokens=CONTEXT)
    with LocalHolders(corpus, kernels="triton") as hs:
        out, _ = generate(model, corpus, hs, prompt=prompt, force="fetch", offset=77)
    check(ref, out, offset=77)


@pytest.mark.parametrize("replicas, fallback", [(2, "route"), (1, "local")])
def test_holder_killed_midway(replicas, fallback):
    """Holder 1 dies before step 6: its chunks are routed to their replica (replicas=2) or,
    with no replica, re-prefilled locally (fetch from a dead holder fails too). Same tokens."""
    model, _, prompt, ref = setup("v2")
    corpus = corpus_of("v2", holders=2, replicas=replicas)
    with LocalHolders(corpus, kernels="torch") as hs:
        kill = killer(hs, rank=1, step=6)
        out, s = generate(
            model, corpus, hs, prompt=prompt, force="route", on_step=kill, fallbacks=True
        )
    check(ref, out)
    assert s.fallbacks and {f["used"] for f in s.fallbacks} == {fallback}
    assert all(f["holder"] == 1 and f["step"] >= 6 for f in s.fallbacks)
    if replicas == 2:
        assert {f["peer"] for f in s.fallbacks} == {2}


def test_gloo_holder_processes_route_kill_and_fetch():
    """Holders as processes over torch.distributed gloo (``python -m
    mqnc.serving.holder_process`` with the corpus file): route at an offset, route with a holder
    process killed mid-way (its chunks go to their replica), then fetch from the survivor. The
    caller's environment is left as it was (the holders' loopback interface is theirs)."""
    model, _, prompt, ref = setup("v3")
    corpus = corpus_of("v3", holders=2, replicas=2)
    before = dict(os.environ)
    with LocalHolders(corpus, transport="gloo", kernels="torch") as hs:
        assert dict(os.environ) == before
        out, s = generate(model, corpus, hs, prompt=prompt, force="route", offset=77)
        check(ref, out, offset=77)
        assert {r.peer for r in s.records() if r.primitive == "route"} == {1, 2}
        kill = killer(hs, rank=2, step=4)
        out, s = generate(
            model, corpus, hs, prompt=prompt, force="route", on_step=kill, fallbacks=True
        )
        check(ref, out)
        assert s.fallbacks and {(f["holder"], f["peer"]) for f in s.fallbacks} == {(2, 1)}
        out, s = generate(model, corpus, hs, prompt=prompt, force="fetch", fallbacks=True)
        check(ref, out)
        assert {r.peer for r in s.records() if r.primitive == "fetch" and r.ok} == {1}


def test_sampling_with_a_seed():
    """``do_sample=True`` with a seed: the same random draws over the same distributions."""
    model, ctx, prompt, _ = setup("v2")
    corpus = corpus_of("v2", holders=2)
    kw = dict(max_new_tokens=STEPS, do_sample=True, top_k=50, temperature=0.8)
    torch.manual_seed(1234)
    with torch.no_grad():
        expected = model.generate(torch.cat([ctx[None], prompt], 1), **kw)[0, CONTEXT + PROMPT :]
    with LocalHolders(corpus, kernels="torch") as hs, torch.no_grad():
        with attach(model, corpus, hs.requester(), force="route") as s:
            torch.manual_seed(1234)
            got = s.generate(prompt, **kw)[0, PROMPT:]
    assert torch.equal(got, expected), (got.tolist(), expected.tolist())
    greedy = _CACHE[("v2", "fp32")][3].tokens[0]
    assert not torch.equal(got, greedy)  # it did sample


def test_bad_use_is_a_clear_error():
    model, _, prompt, _ = setup("v2")
    corpus = corpus_of("v2", holders=1)
    with LocalHolders(corpus, kernels="torch") as hs:
        req = hs.requester()
        with pytest.raises(ValueError, match="force"):
            attach(model, corpus, req, force="teleport")
        with pytest.raises(TypeError, match="dtype"):
            attach(model, corpus_of("v2", "bf16", holders=1), req)
        with torch.no_grad(), attach(model, corpus, req, force="route") as s:
            with pytest.raises(ValueError, match="position_ids"):
                model.generate(prompt, max_new_tokens=2)  # positions 0..: inside the context
            with pytest.raises(ValueError, match="padded"):
                s.generate(prompt, attention_mask=torch.tensor([[0] + [1] * (PROMPT - 1)]))
        assert model.config._attn_implementation != "mqnc"  # detached on exit
    with pytest.raises(ValueError, match="attached"):
        with attach(model, corpus, req):
            prefill_context(model, [1, 2, 3], chunk_tokens=2, holders=[1])


def test_readme_example_runs_as_written():
    """The README's 15-line example, executed verbatim."""
    readme = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
    m = re.search(r"<!-- hf-example -->\s*```python\n(.*?)```", readme, re.S)
    assert m, "README: the hf example block (marked <!-- hf-example -->) is missing"
    code = m.group(1)
    assert len(code.strip().splitlines()) <= 15
    scope: dict = {}
    exec(compile(code, "README.md (hf example)", "exec"), scope)  # noqa: S102
    assert scope["out"].shape == (1, PROMPT + STEPS)


def test_hf_demo_prints_the_table_and_the_exactness_line(tmp_path, capsys):
    """``mqnc demo --hf`` end to end (small: loopback holders, torch references): decisions by
    the predicate on calibrated constants, the demo's table, the exactness line, JSON + PNG."""
    from mqnc.demo import HFDemoConfig, run_hf_demo

    cfg = HFDemoConfig(
        context_tokens=256,
        chunk_tokens=64,
        transport="loopback",
        kernels="torch",
        out=str(tmp_path),
    )
    result = run_hf_demo(cfg)
    printed = capsys.readouterr().out
    assert "decisions per (chunk, agent)" in printed and "MAPE" in printed
    assert "16/16 equal to transformers' generate" in printed and "-- OK" in printed
    assert result["exactness"]["ok"] and result["tokens"] == result["reference_tokens"]
    assert len(result["decisions"]) == 4 and result["primitives"]
    assert result["checked"]["merged"] == 2 * STEPS  # both layers of all 16 forward passes
    assert (tmp_path / "hf_demo.json").exists() and (
        tmp_path / "hf_measured_vs_predicted.png"
    ).exists()


def test_demo_hf_command_line(capsys):
    """``mqnc demo --hf``: the MLA demo's own options are an error naming them, and so is a
    transport the HF demo cannot run (before any work starts)."""
    from mqnc.cli import main

    assert main(["demo", "--hf", "--layers", "3", "--topk", "8"]) == 2
    assert "--layers, --topk apply to the MLA demo only" in capsys.readouterr().err
    assert main(["demo", "--hf", "deepseek_v3", "--transport", "nvshmem"]) == 2
    assert "transport: expected one of ('gloo', 'loopback')" in capsys.readouterr().err


@pytest.mark.parametrize(
    "kw, match",
    [
        (
            dict(kill_holder=1, kill_after_step=STEPS),
            rf"kill_after_step: expected an int in \[0, {STEPS}\)",
        ),
        (dict(kill_after_step=-5), r"kill_after_step: expected an int in \[0, 16\), got -5"),
        (dict(timeout_s=-1.0), "timeout_s: expected a finite number > 0, got -1.0"),
        (dict(timeout_s=0), "timeout_s: expected a finite number > 0"),
        (dict(profile=""), "profile: expected a file path or a preset name, got ''"),
        (dict(out=""), "out: expected a folder path, got ''"),
        (dict(offset=-7), "offset: expected an int >= 0, got -7"),
        (dict(offset=6.5), "offset: expected an int >= 0, got 6.5"),
        (dict(seed=-1), "seed: expected an int >= 0, got -1"),
    ],
)
def test_hf_demo_config_checks_what_the_mla_demo_checks(kw, match):
    """HFDemoConfig rejects what DemoConfig rejects (a kill step outside the decode, a timeout
    that is no time, an empty path) and a negative offset or seed, naming the argument."""
    from mqnc.demo import HFDemoConfig

    with pytest.raises(ValueError, match=match):
        HFDemoConfig(**kw)


def test_demo_hf_checks_before_any_work(capsys, tmp_path, monkeypatch):
    """``mqnc demo --hf``: --kill-after-step without --kill-holder, and a bad --profile or
    --out, are one-line errors (exit status 2) before the model, transformers' reference
    generate or the prefill runs."""
    import mqnc.demo.hf_demo
    from mqnc.cli import main

    monkeypatch.setattr(mqnc.demo.hf_demo, "random_model", lambda *a, **k: pytest.fail("work ran"))
    readme = pathlib.Path(__file__).resolve().parents[1] / "README.md"
    (tmp_path / "file").write_text("")
    cases = [
        (["--kill-after-step", "3"], "--kill-after-step: applies to the fault drill only"),
        (["--profile", str(readme)], f"'{readme}' is not a profile"),
        (["--profile", str(tmp_path / "none.json")], "profile: no such file"),
        (["--out", str(tmp_path / "file")], "exists and is not a folder"),
    ]
    for argv, needle in cases:
        assert main(["demo", "--hf", "--transport", "loopback", *argv]) == 2, argv
        out, err = capsys.readouterr()
        assert needle in err and len(err.strip().splitlines()) == 1, err
        assert "generate" not in out, out


@pytest.mark.parametrize("bad", [64.9, -100, True])
def test_offset_and_position_are_checked_not_truncated(bad):
    """A context offset or prefill position must be an int >= 0: a float is not truncated, a
    bool or a negative position not taken (prefill_context, attach, HFReference)."""
    model, ctx, prompt, _ = setup("v2")
    with pytest.raises(ValueError, match=rf"position: expected an int >= 0, got {bad!r}"):
        prefill_context(model, ctx, chunk_tokens=64, holders=[1], position=bad)
    with pytest.raises(ValueError, match=rf"position: expected an int >= 0, got {bad!r}"):
        HFReference(model, ctx, prompt, max_new_tokens=1, position=bad)
    corpus = corpus_of("v2", holders=1)
    with LocalHolders(corpus, transport="loopback", kernels="torch") as hs:
        with pytest.raises(ValueError, match=rf"offset: expected an int >= 0, got {bad!r}"):
            attach(model, corpus, hs.requester(), offset=bad, force="route")


# ---- bad input and state the review found (small: a 40-token context, 3 new tokens) -----------


def tiny():
    """(model, context [40], a generator for prompts): the v2 model of :func:`setup` with a short
    context, for checks that need no 300-token run."""
    if "tiny" not in _CACHE:
        model = random_model("deepseek_v2", seed=0)
        g = torch.Generator().manual_seed(1)
        _CACHE["tiny"] = (model, torch.randint(0, model.config.vocab_size, (40,), generator=g))
    return _CACHE["tiny"]


def test_padded_prompts_are_refused_not_misread():
    """A mask that hides prompt tokens (left padding through ``model.generate``, or the mask
    transformers builds from ``pad_token_id`` when the prompt holds that token) is a ValueError
    naming attention_mask: the session cannot pad the shared context, and would otherwise return
    logits of a different sequence. Unpadded batches of equal-length prompts stay exact."""
    model, ctx = tiny()
    g = torch.Generator().manual_seed(2)
    prompts = torch.randint(8, model.config.vocab_size, (2, 4), generator=g)
    ref = HFReference(model, ctx, prompts, max_new_tokens=3)
    corpus = prefill_context(model, ctx, chunk_tokens=16, holders=[1, 2])
    with LocalHolders(corpus, transport="loopback", kernels="torch") as hs, torch.no_grad():
        with attach(model, corpus, hs.requester(), force="route") as s:
            left_padded = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
            with pytest.raises(ValueError, match="attention_mask: padded prompts"):
                model.generate(
                    prompts,
                    attention_mask=left_padded,
                    position_ids=s.positions(prompts),
                    max_new_tokens=3,
                    do_sample=False,
                )
            with_pad = prompts.clone()
            with_pad[0, 0] = 7
            with pytest.raises(ValueError, match="attention_mask: padded prompts.*pad_token_id"):
                s.generate(with_pad, pad_token_id=7, max_new_tokens=3, do_sample=False)
            out = s.generate(
                prompts,
                attention_mask=torch.ones_like(prompts),
                max_new_tokens=3,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
            )
    check(ref, out)


def test_calibration_leaves_the_pool_as_it_found_it():
    """calibrate() pulls and splices a chunk at a new offset to time it, then evicts it: with
    the context at exactly that offset and force='route', every chunk is still routed (a kept
    copy would be attended in place, bypassing force and the cost records)."""
    model, ctx = tiny()
    prompt = torch.randint(0, model.config.vocab_size, (1, 2), generator=torch.Generator())
    corpus = prefill_context(model, ctx, chunk_tokens=16, holders=[1, 2])
    with LocalHolders(corpus, transport="loopback", kernels="torch") as hs, torch.no_grad():
        req = hs.requester()
        free = req.kept.pool.free_blocks
        s = attach(model, corpus, req, force="route", offset=corpus.position + 1)
        s.calibrate(probes=1, reps=1)
        assert not req.local_chunks and req.kept.pool.free_blocks == free
        with s:
            s.generate(prompt, max_new_tokens=2, do_sample=False)
        used = {(r.chunk_id, r.primitive) for r in s.records()}
        assert used == {(c, "route") for c in corpus.chunks}, used
        req.fetch(1, offset=5)  # Requester.evict_local: one copy out, its blocks freed
        req.fetch(1)
        assert req.kept.pool.free_blocks == free - 2
        assert req.evict_local(1, 5) and not req.evict_local(1, 5)
        assert set(req.local_chunks) == {(1, corpus.chunks[1].position)}
        assert req.evict_local(1) and req.kept.pool.free_blocks == free
        with pytest.raises(ValueError, match="offset: expected an int >= 0, got -1"):
            req.evict_local(1, -1)


def test_force_is_the_path_taken_even_over_a_held_copy():
    """A requester keeps the chunks it fetched; a later session forcing ``route`` still routes
    every chunk (the copy would answer exactly, but not by the path a timing asked for), a
    forced ``fetch`` fetches again, and a per-chunk ``force`` mapping sends each chunk its own
    way; the request's decision records the path that answered each chunk (``taken``). The
    predicate's own decisions use what the pool holds (``held-*``). Tokens agree throughout."""
    model, ctx = tiny()
    prompt = torch.randint(0, model.config.vocab_size, (1, 2), generator=torch.Generator())
    corpus = prefill_context(model, ctx, chunk_tokens=16, holders=[1, 2])
    chunks = sorted(corpus.chunks)

    def run(req, **kw):
        with attach(model, corpus, req, **kw) as s:
            out = s.generate(prompt, max_new_tokens=2, do_sample=False)
        taken = {c: d["taken"] for c, d in s.requests[-1].decisions.items()}
        assert not s.fallbacks, s.fallbacks
        return out, {(r.chunk_id, r.primitive) for r in s.records()}, taken

    with LocalHolders(corpus, transport="loopback", kernels="torch") as hs, torch.no_grad():
        req = hs.requester()
        first, calls, taken = run(req, force="fetch")
        assert calls == {(c, "fetch") for c in chunks}
        assert all(set(t) == {"fetch"} for t in taken.values()), taken
        out, calls, taken = run(req, force="route")  # every chunk held: routed all the same
        assert calls == {(c, "route") for c in chunks}, calls
        assert all(set(t) == {"route"} for t in taken.values()), taken
        assert torch.equal(out, first)
        out, calls, taken = run(req, force="fetch")  # fetched again, not the held copy
        assert calls == {(c, "fetch") for c in chunks}, calls
        assert torch.equal(out, first)
        force = {chunks[0]: "route", chunks[1]: "fetch", chunks[2]: "local"}
        out, calls, taken = run(req, force=force)
        assert calls == {(c, p) for c, p in force.items()}, calls
        assert {c: set(t) for c, t in taken.items()} == {c: {p} for c, p in force.items()}
        assert torch.equal(out, first)
        out, _, taken = run(req, fabric="h100-ibgda")  # the predicate: the held copies answer
        assert all(set(t) <= {"held-fetch", "held-local"} for t in taken.values()), taken
        assert torch.equal(out, first)
        for bad, match in (
            ({99: "route"}, r"force: expected chunk ids of the corpus \(\[0, 1, 2\]\), got 99"),
            ({True: "route"}, r"force: expected chunk ids \(ints\) as keys, got True"),
            ({"0": "route"}, r"force: expected chunk ids \(ints\) as keys, got '0'"),
            ({0: "teleport"}, r"force\[0\]: expected 'route', 'fetch' or 'local', got 'teleport'"),
            (["route"], r"force: expected None, 'route', 'fetch', 'local' or a mapping"),
        ):
            with pytest.raises(ValueError, match=match):
                attach(model, corpus, req, force=bad)


def test_token_ids_are_checked():
    """Context and prompt token ids must be integer ids in the vocabulary: a negative or
    too-large id (an IndexError deep in the embedding), a bool (silently 1/0) or a float id, an
    empty prompt or a 1-D one are errors naming ``token_ids`` / ``input_ids``."""
    model, ctx = tiny()
    for bad, err, match in [
        ([-1, 5, 6], ValueError, r"token_ids: expected token ids in \[0, 512\).*from -1 to 6"),
        ([600, 5], ValueError, r"token_ids: expected token ids in \[0, 512\).*from 5 to 600"),
        (torch.tensor([True, False]), TypeError, "token_ids: expected integer token ids, got"),
        ([1.0, 2.0], TypeError, "token_ids: expected integer token ids, got dtype torch.float32"),
    ]:
        with pytest.raises(err, match=match):
            prefill_context(model, bad, chunk_tokens=8, holders=[1])
    corpus = prefill_context(model, ctx, chunk_tokens=16, holders=[1])
    with LocalHolders(corpus, transport="loopback", kernels="torch") as hs, torch.no_grad():
        with attach(model, corpus, hs.requester(), force="route") as s:
            for bad, err, match in [
                (torch.tensor([[600, 2]]), ValueError, r"input_ids: expected token ids in \["),
                (torch.tensor([[1.0, 2.0]]), TypeError, "input_ids: expected integer token ids"),
                (torch.zeros(1, 0, dtype=torch.long), ValueError, r"S >= 1, got Tensor of sh"),
                (torch.tensor([1, 2]), ValueError, r"input_ids: expected a \[B, S\] tensor"),
            ]:
                with pytest.raises(err, match=match):
                    s.generate(bad, max_new_tokens=1)
            with pytest.raises(ValueError, match=r"input_ids: expected a \[B, S\] tensor.*\(2,\)"):
                s.positions(torch.tensor([1, 2]))
        assert not s.records()  # refused before any call


def test_a_requester_of_another_corpus_is_refused(tmp_path):
    """A corpus attached through a requester whose holders serve another corpus of the same
    shape (same chunk ids, lengths, positions, holders; other tokens) is a ValueError naming
    corpus: route would read the other corpus' cache while local re-prefilled this one's. The
    chunks' fingerprints (their token ids, Corpus.directory) tell them apart; a corpus saved
    and loaded again (manifest only) still matches."""
    model, ctx_a = tiny()
    ctx_b = ctx_a.flip(0)
    a = prefill_context(model, ctx_a, chunk_tokens=16, holders=[1, 2])
    b = prefill_context(model, ctx_b, chunk_tokens=16, holders=[1, 2])
    assert [(i.tokens, i.position, i.holders) for i in a.directory()] == [
        (i.tokens, i.position, i.holders) for i in b.directory()
    ]
    with LocalHolders(a, transport="loopback", kernels="torch") as hs:
        with pytest.raises(ValueError, match="corpus: chunk 0 is ChunkInfo.*another corpus"):
            attach(model, b, hs.requester(), force="route")
        attach(model, a, hs.requester(), force="route")  # its own corpus: accepted
    from mqnc.serving import Corpus

    loaded = Corpus.load(a.save(tmp_path / "a.json"))
    assert loaded.directory() == a.directory() and a.directory()[0].fingerprint


def test_arguments_are_checked_and_steps_resolved_as_transformers_does():
    """prefill_context checks holders and the model dtype before its forward; HFReference its
    prompt; attach its verify and on_step; re-entering a session says so; the predicate prices
    the tokens transformers will generate (a passed generation_config's max_new_tokens, or
    max_length minus the prompt), not the session's default."""
    from transformers import GenerationConfig

    model, ctx = tiny()
    for holders, err, match in [
        ([-1], ValueError, r"holders: expected ranks \(ints >= 0\), got \[-1\]"),
        (3, TypeError, "holders: expected a sequence of holder ranks, got 3"),
    ]:
        with pytest.raises(err, match=match):
            prefill_context(model, ctx, chunk_tokens=16, holders=holders)
    with pytest.raises(TypeError, match="model: expected bfloat16, float16 or float32"):
        prefill_context(random_model(dtype=torch.float64), ctx, chunk_tokens=16, holders=[1])
    for bad in ([[1, 2]], torch.tensor([1, 2])):
        with pytest.raises(ValueError, match=r"prompt_ids: expected a \[B, S\] tensor"):
            HFReference(model, ctx, bad, max_new_tokens=1)
    corpus = prefill_context(model, ctx, chunk_tokens=16, holders=[1])
    prompt = torch.randint(0, model.config.vocab_size, (1, 2), generator=torch.Generator())
    with LocalHolders(corpus, transport="loopback", kernels="torch") as hs, torch.no_grad():
        req = hs.requester()
        with pytest.raises(TypeError, match="verify: expected True or False, got 'no'"):
            attach(model, corpus, req, verify="no")
        with pytest.raises(TypeError, match="on_step: expected None or a callable"):
            attach(model, corpus, req, on_step=5)
        with attach(model, corpus, req, fabric="h100-ibgda", steps=16) as s:
            with pytest.raises(RuntimeError, match="model: already attached to this session"):
                s.__enter__()
            with pytest.raises(RuntimeError, match="already attached to another mqnc session"):
                attach(model, corpus, req).__enter__()
            out = s.generate(prompt, generation_config=GenerationConfig(max_new_tokens=3))
            assert out.shape[1] - 2 == s.requests[-1].steps == 3
            out = s.generate(prompt, max_length=6, do_sample=False)
            assert out.shape[1] - 2 == s.requests[-1].steps == 4
