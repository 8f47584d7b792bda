"""Holders as a service launched by torchrun: one machine plays two "nodes".

A random-weight DeepSeek-V2 model is saved with ``save_pretrained`` (what a user's model folder
is), ``mqnc corpus`` prefills the shared context once from that folder and writes the corpus file
(chunks on ranks 2 and 3, two replicas each), and two ``torchrun --nnodes 2`` invocations on
127.0.0.1 start the job: node 1 runs the holder ranks (2, 3: they load their chunks from the
file), node 0 the requester ranks (0, 1: each loads the model folder and generates from its
prompt with the context on the holders, at offset 77). Every requester's tokens must equal
transformers' own ``generate`` on ``context + prompt``. Bounded in time (generous timeouts),
no timing assertion.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")

from mqnc.cli import main as mqnc_main  # noqa: E402
from mqnc.integrations.hf import random_model  # noqa: E402

CONTEXT, PROMPT, STEPS = 256, 8, 16


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(node_rank: int, port: int, args: list[str], log) -> subprocess.Popen:
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    cmd = [
        torchrun,
        "--nnodes", "2", "--nproc-per-node", "2", "--node-rank", str(node_rank),
        "--rdzv-backend", "static", "--rdzv-endpoint", f"127.0.0.1:{port}",
        "-m", "mqnc", "serve", *args,
    ]  # fmt: skip
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)


def test_corpus_of_a_width_only_the_torch_kernels_run(tmp_path, capsys):
    """``mqnc corpus`` checks the model's widths against the kernels it will be served with:
    a 96-wide latent is refused for the Triton kernels (the default), naming the config field,
    and written for ``--kernels torch``."""
    model = random_model("deepseek_v2", seed=3, kv_lora_rank=96)
    model.save_pretrained(tmp_path / "model")
    (tmp_path / "context.json").write_text(json.dumps(list(range(40))))
    args = [
        "corpus", "--model", str(tmp_path / "model"), "--context", str(tmp_path / "context.json"),
        "--chunk-tokens", "16", "--holders", "1", "--out", str(tmp_path / "c.json"),
    ]  # fmt: skip
    assert mqnc_main(args) == 2
    assert "kv_lora_rank: the Triton kernels" in capsys.readouterr().err
    assert not (tmp_path / "c.json").exists()
    assert mqnc_main([*args, "--kernels", "torch"]) == 0
    assert (tmp_path / "c.json").exists()


def test_torchrun_two_nodes_holders_and_requesters(tmp_path):
    model = random_model("deepseek_v2", seed=3)
    model.save_pretrained(tmp_path / "model")
    g = torch.Generator().manual_seed(4)
    context = torch.randint(0, model.config.vocab_size, (CONTEXT,), generator=g)
    prompts = torch.randint(0, model.config.vocab_size, (2, PROMPT), generator=g)
    (tmp_path / "context.json").write_text(json.dumps(context.tolist()))
    (tmp_path / "prompts.json").write_text(json.dumps({"prompts": prompts.tolist()}))
    corpus = tmp_path / "corpus.json"
    rc = mqnc_main(
        [
            "corpus", "--model", str(tmp_path / "model"),
            "--context", str(tmp_path / "context.json"), "--chunk-tokens", "64",
            "--holders", "2,3", "--replicas", "2", "--dtype", "float32",
            "--out", str(corpus),
        ]
    )  # fmt: skip
    assert rc == 0 and corpus.exists() and corpus.with_suffix(".safetensors").exists()

    port = _free_port()
    args = [
        "--corpus", str(corpus), "--transport", "gloo", "--kernels", "torch",
        "--generate", "--model", str(tmp_path / "model"),
        "--prompts", str(tmp_path / "prompts.json"), "--max-new-tokens", str(STEPS),
        "--force", "route", "--offset", "77",
        "--out", str(tmp_path / "out"), "--timeout", "300",
    ]  # fmt: skip
    logs = [open(tmp_path / f"node{n}.log", "w") for n in (0, 1)]  # noqa: SIM115
    nodes = [_torchrun(1, port, args, logs[1]), _torchrun(0, port, args, logs[0])]
    try:
        rcs = [p.wait(timeout=600) for p in nodes]
    finally:
        for p in nodes:
            if p.poll() is None:
                p.kill()
                p.wait()
        for f in logs:
            f.close()
    # the whole logs: torchrun's own teardown can end a node's log with a long traceback (its
    # exit barrier on the static rendezvous store, already closed by the other node: rc still 0)
    full = "\n".join((tmp_path / f"node{n}.log").read_text() for n in (0, 1))
    out = "\n".join((tmp_path / f"node{n}.log").read_text()[-3000:] for n in (0, 1))
    assert rcs == [0, 0], out
    assert "holder 2 done" in full and "holder 3 done" in full, out
    # the trust note: once per job (rank 0, on node 0), not once per node or per rank
    assert full.count("authenticates nobody") == 1, out
    assert "authenticates nobody" in (tmp_path / "node0.log").read_text()

    for rank in (0, 1):
        got = json.loads((tmp_path / "out" / f"rank{rank}.json").read_text())
        assert got["rank"] == rank and got["requester_index"] == rank
        assert got["calls"]["route"] > 0 and not got["fallbacks"]
        full = torch.cat([context, prompts[rank]])[None]
        with torch.no_grad():
            expected = model.generate(full, max_new_tokens=STEPS, do_sample=False)
        assert got["tokens"] == expected[0, CONTEXT + PROMPT :].tolist(), (rank, got)


def test_corpus_file_round_trip_and_bad_manifests(tmp_path):
    """The corpus file: the manifest and the chunks come back as written (each holder reads its
    own chunks), and a manifest that is not one is a clear error naming what is wrong."""
    from mqnc.model import PRESETS, RopeSpec
    from mqnc.serving import ChunkSpec, Corpus

    g = PRESETS["deepseek-v2-lite"].replace(layers=2, heads=4)
    entries = torch.randn(g.layers, 200, g.d_qk, generator=torch.Generator().manual_seed(0))
    rope = RopeSpec.from_preset("deepseek-v2-lite", layout="half")
    corpus = Corpus.partition(
        entries, g, 0.1, chunk_tokens=64, holders=[2, 3], replicas=2, position=5, rope=rope
    )
    assert [c.tokens for c in corpus.chunks.values()] == [64, 64, 64, 8]
    assert [c.holders for c in corpus.chunks.values()] == [(2, 3), (3, 2), (2, 3), (3, 2)]
    path = corpus.save(tmp_path / "c.json")
    back = Corpus.load(path)
    assert back.entries is None and back.rope == rope and back.geometry == g
    assert back.chunks == corpus.chunks and back.position == 5 and back.holder_ranks == [2, 3]
    for cid, c in back.chunks.items():
        assert torch.equal(back.chunk_kv(cid), entries[:, c.start : c.start + c.tokens])
    info = back.directory()[3]
    assert (info.chunk_id, info.tokens, info.position, info.holders) == (3, 8, 197, (3, 2))

    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(ValueError, match="not an mqnc-corpus manifest"):
        Corpus.load(bad)
    manifest = json.loads(path.read_text())
    manifest["chunks"][0].pop("holders")
    bad.write_text(json.dumps(dict(manifest, tensors="bad.safetensors")))
    with pytest.raises(ValueError, match="malformed manifest"):
        Corpus.load(bad)
    # a field of the wrong kind is named, inside the same one-line error
    good = json.loads(path.read_text())
    for key, value, needle in (
        ("softmax_scale", None, "no 'softmax_scale'"),
        ("softmax_scale", "x", "softmax_scale: expected a number"),
        ("softmax_scale", -1.0, "softmax_scale: expected a finite number > 0"),
        ("softmax_scale", 1e38, r"softmax_scale: expected a finite number in \(0, "),
        ("block_size", "big", "block_size: expected an int"),
    ):
        m = dict(good)
        if value is None:
            m.pop(key)
        else:
            m[key] = value
        bad = tmp_path / "c.json"  # beside its tensors
        bad.write_text(json.dumps(m))
        with pytest.raises(ValueError, match=f"malformed manifest.*{needle}"):
            Corpus.load(bad)
    bad.write_text(json.dumps(dict(good, softmax_scale=float("nan"))))
    with pytest.raises(ValueError, match="JSON manifest.*non-finite number 'NaN'"):
        Corpus.load(bad)  # refused by the parser: JSON has no NaN
    with pytest.raises(ValueError, match="overlap"):
        Corpus(
            g,
            0.1,
            [ChunkSpec(0, 0, 10, 0, (1,)), ChunkSpec(1, 5, 10, 5, (1,))],
            dtype=torch.float32,
        )
    with pytest.raises(ValueError, match="replicas"):
        Corpus.partition(entries, g, 0.1, chunk_tokens=64, holders=[1], replicas=2)


def test_serve_command_surface():
    """``mqnc serve``'s transports are the service's: the registry's engines across processes
    and the ``auto`` policy; a requester job is --job or --generate."""
    from mqnc.cli import cmd_serve as cli_serve
    from mqnc.serving import service
    from mqnc.transport import names

    assert cli_serve.TRANSPORTS == service.TRANSPORTS == ("auto", *names(in_process=False))
    assert "loopback" not in service.TRANSPORTS  # every rank in one process: not a service
    assert mqnc_main(["serve", "--corpus", "x.json", "--job", "a:b", "--generate"]) == 2
    assert mqnc_main(["serve", "--corpus", "x.json", "--run", "a:b", "--job", "a:b"]) == 2


def test_trust_note_is_said_once_per_job_in_two_lines(tmp_path, monkeypatch, capsys):
    """``mqnc serve`` says where the store and gloo listen and where the trust model is written
    once per job (rank 0, requester or holder, not every rank or every node's first rank), in
    two short lines pointing to docs/serving.md's "Security and trust model". Each rank runs
    up to the fabric's build (stopped there: no peers in this test)."""
    from pathlib import Path

    from mqnc.model import PRESETS
    from mqnc.serving import Corpus, service

    g = PRESETS["deepseek-v2-lite"].replace(layers=1, heads=4)
    entries = torch.zeros(g.layers, 16, g.d_qk)
    path = Corpus.partition(entries, g, 0.1, chunk_tokens=8, holders=[2]).save(tmp_path / "c.json")

    class Built(Exception):
        """The fabric would be built here."""

    def stop(*args, **kwargs):
        raise Built

    monkeypatch.setattr(service, "rendezvous", lambda rank, world, **kw: (None, rank, world))
    monkeypatch.setattr(service, "publish_commitment", lambda store, rank: "secret")
    monkeypatch.setattr(service, "make_transport", stop)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # this process keeps its own
    monkeypatch.delenv("LOCAL_RANK", raising=False)  # every rank is its node's first
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)  # the note names 127.0.0.1
    said = {}
    for rank in range(3):
        argv = [
            "serve", "--corpus", str(path), "--transport", "gloo", "--job", "json:dumps",
            "--rank", str(rank), "--world", "3", "--master", "127.0.0.1:29500",
        ]  # fmt: skip
        with pytest.raises(Built):
            mqnc_main(argv)
        said[rank] = capsys.readouterr().err
    assert said[1] == said[2] == "", said  # a requester and a holder that are not rank 0
    note = said[0].rstrip("\n")
    assert note == service.trust_note(0, "gloo", master="127.0.0.1:29500", gloo_host="127.0.0.1")
    lines = note.splitlines()
    assert len(lines) == 2 and all(len(line) <= 160 for line in lines), lines
    assert "listen on 127.0.0.1 only" in lines[0] and "authenticates nobody" in lines[1]
    assert 'docs/serving.md, "Security and trust model"' in lines[1]
    serving = (Path(__file__).parents[1] / "docs" / "serving.md").read_text()
    assert "\n## Security and trust model\n" in serving  # the section it points to


def _readme_torchrun_commands() -> list[list[str]]:
    """Every ``torchrun`` command line of the "Holders as a service" section of
    docs/serving.md, as a shell would split it (continuation lines joined, ``$ARGS`` expanded, a
    trailing ``&`` dropped)."""
    import re
    import shlex
    from pathlib import Path

    readme = (Path(__file__).parents[1] / "docs" / "serving.md").read_text()
    section = readme.split("## Holders as a service", 1)[1].split("\n## ", 1)[0]
    text = section.replace("\\\n", " ")
    env = dict(re.findall(r'^(\w+)="([^"]*)"$', text, flags=re.M))
    commands = []
    for line in text.splitlines():
        if line.startswith("torchrun "):
            argv = shlex.split(re.sub(r"\$(\w+)", lambda m: env[m.group(1)], line))
            commands.append(argv[:-1] if argv[-1] == "&" else argv)
    return commands


def test_readme_torchrun_commands_parse_with_torchrun_then_mqnc():
    """The documented ``torchrun ... -m mqnc serve --run mod:fn`` was refused by torchrun
    ("ambiguous option: --run could match --run-path, --run_path"): each torchrun command line
    of docs/serving.md goes through torchrun's own parser to ``mqnc serve``'s arguments unchanged,
    and mqnc's parser reads them as the job they name."""
    from torch.distributed.run import get_args_parser

    from mqnc.cli import build_parser

    commands = _readme_torchrun_commands()
    assert len(commands) >= 3
    jobs = set()
    for argv in commands:
        run = get_args_parser().parse_args(argv[1:])
        assert run.module and run.training_script == "mqnc", argv
        assert run.training_script_args == argv[argv.index("mqnc") + 1 :], argv
        args = build_parser().parse_args(run.training_script_args)
        assert args.command == "serve" and args.corpus == "corpus.json", argv
        assert (args.job is not None) != args.generate and args.run is None, argv
        jobs.add(args.job or "--generate")
    assert jobs == {"--generate", "myjobs:main"}


def test_serve_options_pass_through_torchrun():
    """Every option ``mqnc serve`` documents reaches it through torchrun's parser unchanged
    (none is an ambiguous abbreviation of a torchrun option); ``--run``, the deprecated name of
    ``--job``, is the one torchrun refuses, and outside torchrun it still works with a
    warning."""
    import argparse

    from torch.distributed.run import get_args_parser

    from mqnc.cli import build_parser
    from mqnc.cli import cmd_serve as cli_serve

    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    head = ["--nproc-per-node", "2", "-m", "mqnc", "serve", "--corpus", "c.json"]
    outside = {"--run", "--rank", "--world", "--master"}  # the job without torchrun's rendezvous
    documented = [
        o
        for a in serve._actions
        if a.help != argparse.SUPPRESS
        for o in a.option_strings
        if o.startswith("--")
    ]
    assert "--job" in documented and not outside & set(documented)
    for option in documented:
        got = get_args_parser().parse_args([*head, option, "x"]).training_script_args
        assert got == [*head[4:], option, "x"], option
    with pytest.raises(SystemExit):
        get_args_parser().parse_args([*head, "--run", "x:y"])  # why --job replaced it
    args = serve.parse_args(["--corpus", "c.json", "--run", "json:dumps"])
    with pytest.warns(FutureWarning, match="--run is deprecated.*--job"):
        assert cli_serve._job(args) is json.dumps
    with pytest.raises(ValueError, match="--job: expected 'module:function', got 'nofunction'"):
        cli_serve._job(serve.parse_args(["--corpus", "c.json", "--job", "nofunction"]))


@pytest.mark.parametrize(
    "content, got",
    [
        ("[1, true, 3]", "element True"),
        ("[1, -2]", "element -2"),
        ("[1, 2.0]", "element 2.0"),
        ('{"token_ids": []}', "list []"),
        ('{"ids": [1]}', "NoneType None"),
    ],
)
def test_corpus_context_token_ids_are_checked(tmp_path, content, got):
    """`mqnc corpus --context`: token ids are ints >= 0; a bool, negative or float id (or no
    list) is an error naming the flag, the file and what was found."""
    from mqnc.cli.cmd_corpus import read_token_ids

    path = tmp_path / "context.json"
    path.write_text(content)
    with pytest.raises(ValueError, match="--context: expected a JSON list of token ids") as exc:
        read_token_ids(str(path))
    assert str(path) in str(exc.value) and f"got {got}" in str(exc.value)


@pytest.mark.parametrize(
    "content, got",
    [
        ("[" * 100_000 + "]" * 100_000, "nested deeper than 16"),
        ("[1, 2", "is not JSON"),
        ("[1, NaN]", "non-finite number 'NaN'"),
    ],
)
def test_corpus_context_that_is_not_shallow_json_is_named(tmp_path, content, got):
    """`mqnc corpus --context`: a file nested 100k deep raised an uncaught RecursionError (and a
    broken one a bare JSONDecodeError); it is parsed as the corpus manifest is, and the error
    names the flag and the file."""
    from mqnc.cli.cmd_corpus import read_token_ids

    path = tmp_path / "context.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=f"--context: cannot read .* as JSON token ids.*{got}"):
        read_token_ids(str(path))


@pytest.mark.parametrize(
    "body, got",
    [
        ({"prompts": []}, "got []"),
        ({"prompts": [[]]}, "got prompt 0 = []"),
        ({"prompts": [[1, 2], [1.5, 2.5]]}, "got prompt 1 = [1.5, 2.5]"),
        ({"prompts": [[1, True]]}, "got prompt 0 = [1, True]"),
        ({"prompts": [[1, 512]]}, "got prompt 0 = [1, 512]"),
        ({"prompts": [[-1]]}, "got prompt 0 = [-1]"),
        ({"prompts": [1, 2]}, "got prompt 0 = 1"),
    ],
)
def test_generate_prompts_are_checked_before_the_model_loads(tmp_path, monkeypatch, body, got):
    """``mqnc serve --generate``: the prompts file must be a non-empty list of non-empty lists of
    token ids in the model's vocabulary; anything else is a ValueError naming ``prompts`` and
    what it found, raised before the model's weights are loaded."""
    import transformers

    from mqnc.integrations.hf import serve_generate

    random_model("deepseek_v2").config.save_pretrained(tmp_path)  # vocabulary 512
    monkeypatch.setattr(
        transformers.AutoModelForCausalLM,
        "from_pretrained",
        lambda *a, **k: pytest.fail("the model was loaded"),
    )
    path = tmp_path / "prompts.json"
    path.write_text(json.dumps(body))
    want = r"prompts: expected a JSON file \{'prompts': \[\[ids\], \.\.\.\]\} of token ids in "
    with pytest.raises(ValueError, match=want + r"\[0, 512\)") as exc:
        serve_generate(None, model=str(tmp_path), prompts=str(path))  # no context is needed
    assert got in str(exc.value)
    with pytest.raises(ValueError, match="max_new_tokens: expected an int >= 1, got 0"):
        serve_generate(None, model=str(tmp_path), prompts=str(path), max_new_tokens=0)


def test_torchrun_tensor_parallel_instances(tmp_path):
    """``mqnc serve --tp 2`` under one torchrun of 4 ranks: instance 0 (ranks 0, 1) requests,
    instance 1 (ranks 2, 3) holds both chunks, each rank its columns. Every requester rank's
    o slice and the row's lse (dense and top-k routes over each chunk,
    ``tp_service.exactness_job``) equal the fp64 reference within the bf16 attention bound,
    with half the query bytes per rank."""
    from mqnc.model import PRESETS
    from mqnc.serving import Corpus
    from mqnc.testing import TOLERANCES
    from mqnc.transport import wire

    geometry = PRESETS["deepseek-v2-lite"].replace(layers=2, heads=4)
    g = torch.Generator().manual_seed(5)
    entries = (0.5 * torch.randn(2, 80, geometry.d_qk, generator=g)).bfloat16()
    corpus = Corpus.partition(
        entries, geometry, 0.12, chunk_tokens=48, holders=[1], block_size=16
    ).save(tmp_path / "corpus.json")
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    cmd = [
        torchrun, "--nnodes", "1", "--nproc-per-node", "4", "--rdzv-backend", "static",
        "--rdzv-endpoint", f"127.0.0.1:{_free_port()}", "-m", "mqnc", "serve", "--tp", "2",
        "--corpus", str(corpus), "--kernels", "torch", "--transport", "gloo",
        "--job", "mqnc.serving.tp_service:exactness_job", "--out", str(tmp_path / "out"),
        "--timeout", "120",
    ]  # fmt: skip
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    for rank in (0, 1):
        got = json.loads((tmp_path / "out" / f"rank{rank}.json").read_text())
        assert got["routes"] == 4, got
        assert got["o"] <= TOLERANCES[("mla", "bfloat16")].atol, got
        assert got["lse"] <= TOLERANCES[("mla_lse", "float32")].atol, got
        topk = 2 * 16 * 4  # the last route: the second chunk's 32 tokens, every other one
        assert got["sent_bytes"] == wire.HEADER_BYTES + 2 * 4 * geometry.q_row_bytes // 2 + topk
