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
