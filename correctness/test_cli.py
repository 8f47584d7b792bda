"""The ``mqnc`` command's surface (what a new user meets first): ``--version``, a description and
plain help for every subcommand, one spelling per option (old spellings accepted, not listed),
``--model`` as a preset or a Hugging Face ``config.json``, errors that name the flag, and ``-v`` for
the traceback and the log."""

from __future__ import annotations

import argparse
import json
import re

import pytest

from mqnc import __version__
from mqnc.cli import build_parser, main
from mqnc.model import MLAGeometry, get_preset


def run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def _subparsers():
    parser = build_parser()
    (sub,) = [a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction"]
    return sub.choices


def test_version(capsys):
    rc, out, _ = run(capsys, "--version")
    assert rc == 0 and out.strip() == f"mqnc {__version__}"


@pytest.mark.parametrize("name", sorted(_subparsers()))
def test_every_subcommand_has_a_description_and_plain_help(name):
    """A description, no Sphinx markup, each default stated once, -v everywhere."""
    p = _subparsers()[name]
    assert p.description and len(p.description) > 40, name
    text = p.format_help()
    for markup in ("``", ":mod:", ":func:", ":class:", ":meth:"):
        assert markup not in text, f"{name}: {markup} in --help"
    # defaults are written into the help by hand, so argparse must not append them again
    assert not issubclass(p.formatter_class, argparse.ArgumentDefaultsHelpFormatter)
    for action in p._actions:
        assert (action.help or "").count("default") <= 1, (name, action.option_strings)
    assert "--verbose" in text


def test_one_spelling_per_option_old_ones_hidden(capsys):
    subs = _subparsers()
    for name in ("predict", "crossover", "calibrate"):
        text = subs[name].format_help()
        assert "--m-q" in text and not re.search(r"--mq\b", text), name
    for name in ("predict", "crossover"):
        text = subs[name].format_help()
        assert "--c-t" in text and not re.search(r"--ct\b", text), name
    rc_new, new, _ = run(capsys, "predict", "--json", "--m-q", "64", "--c-t", "128")
    rc_old, old, _ = run(capsys, "predict", "--json", "--mq", "64", "--ct", "128")
    assert rc_new == rc_old == 0 and json.loads(new) == json.loads(old)


def test_model_takes_a_hugging_face_config(tmp_path, capsys):
    """``--model`` reads a config.json (a real transformers config, written as HF saves it)
    and prices exactly as the geometry built from that config."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.DeepseekV3Config(num_hidden_layers=7, num_attention_heads=32)
    cfg.save_pretrained(tmp_path)
    want = MLAGeometry.from_hf_config(cfg.to_dict())
    for spec in (str(tmp_path / "config.json"), str(tmp_path)):
        rc, out, err = run(capsys, "predict", "--json", "--model", spec, "--m-q", "32")
        assert rc == 0, err
        got = json.loads(out)
        assert got["wire"]["route_bytes_per_layer"] == 32 * want.qp_row_bytes
        assert got["wire"]["chunk_bytes_per_layer"] == 2048 * want.kv_bytes_per_token_layer
    rc, out, _ = run(capsys, "fit", "--help")  # fit, calibrate and the benchmarks take it too
    assert "config.json" in out
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    rc, _, err = run(capsys, "predict", "--model", str(tmp_path / "other"))
    assert rc == 2 and "argument --model:" in err and "not an MLA config" in err
    rc, _, err = run(capsys, "predict", "--model", str(tmp_path / "missing.json"))
    assert rc == 2 and "argument --model:" in err and "deepseek-v2-lite" in err


def test_verbose_shows_the_traceback_and_the_log(capsys):
    argv = ("predict", "--splice-ms", "1", "--no-splice")  # fails inside the command
    rc, _, err = run(capsys, *argv)
    assert rc == 2 and "Traceback" not in err
    assert err.strip().splitlines() == [
        "mqnc predict: error: splice: expected at most one of --splice-ms, --splice-from, "
        "--no-splice (-v shows the traceback)"
    ]
    for verbose in (["-v", *argv], [*argv, "-v"], ["--verbose", *argv]):
        rc, _, err = run(capsys, *verbose)
        assert rc == 2 and "Traceback (most recent call last)" in err
        assert "ValueError: splice: expected at most one of" in err
    rc, _, err = run(capsys, "predict", "--m-q", "8")
    assert rc == 0 and err == ""
    rc, _, err = run(capsys, "-v", "predict", "--m-q", "8")
    assert rc == 0 and "mqnc: info: model deepseek-v2-lite (q+p 2184 B per row)" in err


def test_presets_lists_what_model_accepts(capsys):
    rc, out, _ = run(capsys, "presets", "--json")
    assert rc == 0
    assert json.loads(out)["models"]["deepseek-v2-lite"]["qp_row_bytes"] == (
        get_preset("deepseek-v2-lite").qp_row_bytes
    )


def test_selfcheck_runs_every_check_its_help_lists(capsys, monkeypatch):
    """``mqnc selfcheck --help`` lists the checks from the table the command runs: each listed
    check has a function and runs (in the order listed, in float32 and bfloat16), no check runs
    unlisted; the real run verifies the query rotation too."""
    from mqnc.cli import cmd_selfcheck, kernel_checks

    assert list(cmd_selfcheck.CHECKS) == list(kernel_checks.CHECKS)
    rc, help_text, _ = run(capsys, "selfcheck", "--help")
    listed = re.search(r"Run every kernel \(([^)]*)\)", " ".join(help_text.split()))
    assert rc == 0 and listed, help_text
    assert listed.group(1).split(", ") == list(cmd_selfcheck.CHECKS)
    real = dict(kernel_checks.CHECKS)
    ran = []
    for name in real:
        monkeypatch.setitem(kernel_checks.CHECKS, name, lambda dtype, n=name: ran.append(n) or n)
    rc, out, _ = run(capsys, "selfcheck")
    assert rc == 0 and ran == [n for n in cmd_selfcheck.CHECKS for _ in range(2)], (ran, out)
    with pytest.raises(KeyError, match="names: no such check"):
        kernel_checks.run_checks(["query rotations"])
    monkeypatch.setitem(kernel_checks.CHECKS, "query rotation", real["query rotation"])
    (f32, bf16) = kernel_checks.run_checks(["query rotation"])
    assert f32.startswith("rope_rotate ") and "float32: latent bit-exact" in f32, f32
    assert bf16.startswith("rope_rotate ") and "bfloat16" in bf16, bf16


@pytest.mark.parametrize("name", sorted(_subparsers()))
def test_an_unknown_flag_is_the_subcommands_usage_error(name, capsys):
    """``mqnc <command> --bogus``: that command's usage and its error, exit status 2, never the
    top-level usage (argparse hands a subparser's leftovers up to the main parser); a flag
    before the command is the top-level parser's."""
    rc, _, err = run(capsys, name, "--bogus")
    assert rc == 2
    assert f"usage: mqnc {name} " in err and "usage: mqnc [-h]" not in err, err
    assert re.search(rf"^mqnc {name}: error: ", err, re.M), err


def test_predict_names_the_unknown_flag(capsys):
    """The reported case: the subcommand's usage and the flag it does not know; one given
    before the subcommand is the top-level parser's."""
    rc, out, err = run(capsys, "predict", "--bogus", "--m-q", "8")
    assert rc == 2 and out == ""
    assert err.splitlines()[0].startswith("usage: mqnc predict [-h]")
    assert err.splitlines()[-1] == "mqnc predict: error: unrecognized arguments: --bogus"
    rc, _, err = run(capsys, "--bogus", "predict")
    assert rc == 2 and err.startswith("usage: mqnc [-h]")
    assert err.splitlines()[-1] == "mqnc: error: unrecognized arguments: --bogus"


def _model_commands() -> list[str]:
    """The subcommands that take ``--model`` and check it as they parse it (``serve`` checks
    its model in the requester's job: test_serve_checks_its_model_on_the_requester_only)."""
    return sorted(
        name
        for name, p in _subparsers().items()
        if any("--model" in a.option_strings for a in p._actions) and name != "serve"
    )


@pytest.fixture
def hub_calls(monkeypatch):
    """Every question to the Hugging Face hub, recorded (``model_info``: the one the commands
    ask; it raises as an unreachable hub does)."""
    huggingface_hub = pytest.importorskip("huggingface_hub")
    calls = []

    def model_info(repo_id, **kwargs):
        calls.append(repo_id)
        raise ConnectionError("[Errno -2] Name or service not known")

    monkeypatch.setattr(huggingface_hub, "model_info", model_info)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    return calls


def _error_line(err: str) -> str:
    """The one error line of a failed command (after argparse's usage, if any)."""
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if ": error: " in line]
    assert len(lines) == 1, err
    return lines[0]


def test_every_model_option_refuses_a_missing_path_at_once(tmp_path, capsys, hub_calls):
    """Each command's ``--model`` (a preset or config.json for the cost commands, a Hugging Face
    model folder or hub id for ``corpus`` / ``serve``) refuses a path that does not exist in
    one line naming the flag, exit status 2, without asking the hub."""
    assert {"corpus", "predict", "calibrate", "fit"} <= set(_model_commands())
    ctx = tmp_path / "ctx.json"
    ctx.write_text("[1, 2, 3]")
    for name in _model_commands():
        for missing in ("./missing_dir", str(tmp_path / "missing"), "models/v2/lite"):
            rc, _, err = run(capsys, name, "--model", missing)
            line = _error_line(err)
            assert rc == 2 and "--model" in line and repr(missing) in line, (name, err)
    # corpus (and serve's requesters): a file, or a folder without config.json, the same
    for bad, why in ((ctx, "got the file"), (tmp_path, "which has no config.json")):
        rc, _, err = run(capsys, "corpus", "--model", str(bad))
        line = _error_line(err)
        assert rc == 2 and "argument --model:" in line and why in line, err
    assert hub_calls == []


def test_corpus_asks_the_hub_once_for_a_hub_id_and_honours_offline(
    tmp_path, capsys, hub_calls, monkeypatch
):
    """A bare hub id (``missing_dir``) is neither a path nor in the cache: asked of the hub once
    (an unreachable hub: one line naming --model, not half a minute of retries and a
    traceback); with ``HF_HUB_OFFLINE=1`` refused without asking."""
    ctx = tmp_path / "ctx.json"
    ctx.write_text("[1, 2, 3]")
    argv = ("corpus", "--model", "missing_dir", "--context", str(ctx), "--holders", "1")
    argv += ("--out", str(tmp_path / "c.json"))
    rc, _, err = run(capsys, *argv)
    line = _error_line(err)
    assert rc == 2 and hub_calls == ["missing_dir"]
    assert line.startswith("mqnc corpus: error: --model: 'missing_dir' is no folder and not")
    assert "Name or service not known" in line and "HF_HUB_OFFLINE=1" in line
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    rc, _, err = run(capsys, *argv)
    line = _error_line(err)
    assert rc == 2 and hub_calls == ["missing_dir"]  # (not asked again)
    assert "--model: 'missing_dir'" in line and "HF_HUB_OFFLINE is set" in line


def test_serve_checks_its_model_on_the_requester_only(tmp_path, monkeypatch, hub_calls):
    """``mqnc serve --generate --model``: a holder's machine needs no model, so the check runs
    in the requester's job, through the same helper as ``mqnc corpus``: a missing path is a
    ``ValueError`` naming --model before anything is loaded."""
    import mqnc.integrations.hf as hf
    from mqnc.cli.cmd_serve import _job

    monkeypatch.setattr(hf, "serve_generate", lambda ctx, **kw: pytest.fail("loaded"))
    argv = ["serve", "--corpus", "c.json", "--generate", "--prompts", "p.json"]
    args = build_parser().parse_args([*argv, "--model", str(tmp_path / "nope")])
    with pytest.raises(ValueError, match=r"^--model: expected a model folder .*no such folder"):
        _job(args)(None)
    assert hub_calls == []
