"""Every command and snippet of ``README.md`` and ``docs/*.md`` runs as written, on the CPU.

One test per fenced block (its id is ``page:line``); the rules are written down in
docs/testing.md ("Every command and snippet of the documentation runs"):

- ``python`` blocks run as written, as ``python -c`` runs them (each in a new process, forked
  from one interpreter that has imported torch: ``correctness/preloaded.py``), the repository as
  working directory;
- shell blocks (``bash`` / ``sh`` / ``shell``, or an unlabelled fence whose first command is a
  known command): every ``pip install`` is checked against ``pyproject.toml``'s extras and not
  run; every ``mqnc`` and ``torchrun ... -m mqnc`` command is parsed by the real parsers; then
  the block runs with ``bash -e`` unless a ``<!-- run-by: FILE::TEST, ... -->`` comment above it
  names the tests that already run it (each must exist) or ``<!-- gpu-only -->`` marks it
  (skipped, and the skip says where);
- ``text`` and other languages, and unlabelled listings, are not code.

A block may use files an earlier block of its page wrote (the recipes do): selecting one block
with ``-k`` runs the earlier runnable blocks of its page first.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from preloaded import Preloaded

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BIN = Path(sys.executable).parent
TIMEOUT_S = 300  # a bound on one block, never a speed check
SHELLS = {"bash", "sh", "shell", "console", "zsh"}
COMMANDS = {
    "mqnc", "python", "python3", "make", "torchrun", "pip", "pip3", "bash", "sh", "git", "cd",
    "export", "jupyter-execute", "jupyter", "pytest", "ruff", "uv", "conda",
}  # fmt: skip
_FENCE = re.compile(r"^( *)```([\w+-]*)[ \t]*$")
_MARK = re.compile(r"^\s*<!--\s*(.*?)\s*-->\s*$")
_ASSIGN = re.compile(r"^[A-Za-z_]\w*=")


@dataclasses.dataclass(frozen=True)
class Block:
    """One fenced block: its page, first line (1-based, the fence), language, text and the
    HTML comments directly above it."""

    page: Path
    line: int
    lang: str
    text: str
    marks: tuple[str, ...]

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    @property
    def kind(self) -> str:
        """``python``, ``shell`` or ``text``."""
        if self.lang in ("python", "py"):
            return "python"
        if self.lang in SHELLS:
            return "shell"
        if self.lang:
            return "text"
        try:
            argv = next(iter(commands(self)), [])
        except ValueError:  # not shell syntax (an unbalanced quote in a listing)
            return "text"
        return "shell" if argv and _command_word(argv[0]) in COMMANDS else "text"

    def mark(self, name: str) -> str | None:
        """The text after ``name:`` of a comment above (``""`` for a bare ``name``), or None."""
        for m in self.marks:
            if m == name:
                return ""
            if m.startswith(name + ":"):
                return m[len(name) + 1 :].strip()
        return None


def _command_word(word: str) -> str:
    """``.venv/bin/python`` -> ``python``."""
    return word.rsplit("/", 1)[-1]


def parse_blocks(page: Path) -> list[Block]:
    """Every fenced block of ``page`` with the comments on the lines directly above it."""
    lines = page.read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, lang = m.group(1), m.group(2).lower()
        end = next((j for j in range(i + 1, len(lines)) if lines[j].rstrip() == indent + "```"),
                   None)  # fmt: skip
        assert end is not None, f"{page.relative_to(ROOT)}:{i + 1}: a fence that never closes"
        marks, k = [], i - 1
        while k >= 0 and _MARK.match(lines[k]):
            marks.insert(0, _MARK.match(lines[k]).group(1))
            k -= 1
        body = "\n".join(line[len(indent) :] for line in lines[i + 1 : end])
        out.append(Block(page, i + 1, lang, body + "\n", tuple(marks)))
        i = end + 1
    return out


def logical_lines(text: str) -> list[str]:
    """A shell block's command lines as a shell reads them: a newline inside quotes or after a
    backslash continues the command; blank and comment lines dropped."""
    out, cur, quote, i = [], [], None, 0
    while i < len(text):
        c = text[i]
        if c == "\\" and quote != "'" and i + 1 < len(text):
            if text[i + 1] == "\n":
                cur.append(" ")
            else:
                cur.append(text[i : i + 2])
            i += 2
            continue
        if quote:
            quote = None if c == quote else quote
        elif c in "'\"":
            quote = c
        elif c == "#" and (not cur or cur[-1][-1:].isspace()):
            while i < len(text) and text[i] != "\n":
                i += 1
            continue
        if c == "\n" and not quote:
            out.append("".join(cur).strip())
            cur = []
        else:
            cur.append(c)
        i += 1
    out.append("".join(cur).strip())
    return [line for line in out if line]


# ---- checks that need no run -------------------------------------------------------------------


def _extras() -> set[str]:
    """The extras ``pyproject.toml`` defines (its ``[project.optional-dependencies]`` keys; read
    without tomllib, which Python 3.10 lacks)."""
    text = (ROOT / "pyproject.toml").read_text()
    section = text.split("\n[project.optional-dependencies]\n", 1)[1].split("\n[", 1)[0]
    return set(re.findall(r"^([A-Za-z][\w-]*)\s*=", section, re.M))


def check_pip_install(argv: list[str]) -> None:
    """``pip install [-e] .[a,b]``: this checkout, and extras ``pyproject.toml`` defines."""
    targets = [a for a in argv[argv.index("install") + 1 :] if not a.startswith("-")]
    ours = [t for t in targets if re.match(r"^\.(\[[\w,\s-]*\])?$", t)]
    assert ours, f"pip install of something other than this checkout: {argv}"
    for t in ours:
        named = set(filter(None, (x.strip() for x in t[2:-1].split(",")))) if "[" in t else set()
        unknown = named - _extras()
        assert not unknown, (
            f"extras {sorted(unknown)} are not in pyproject.toml ({sorted(_extras())})"
        )


def check_mqnc_args(args: list[str], where: str) -> None:
    """The ``mqnc`` command knows the subcommand and every ``--flag`` of ``args`` (names only:
    a value may be a file an earlier command writes)."""
    from mqnc.cli import build_parser

    parser = build_parser()
    subs = next(a for a in parser._actions if a.choices and "predict" in a.choices).choices
    top = {o for a in parser._actions for o in a.option_strings}
    command = next((a for a in args if not a.startswith("-")), None)
    if command is None:
        bad = [a for a in args if a.split("=")[0] not in top]
        assert not bad, f"{where}: mqnc {' '.join(args)}: unknown {bad}"
        return
    assert command in subs, f"{where}: mqnc {command}: no such subcommand ({sorted(subs)})"
    known = top | {o for a in subs[command]._actions for o in a.option_strings}
    bad = [a for a in args if a.startswith("-") and a.split("=")[0] not in known]
    assert not bad, f"{where}: mqnc {' '.join(args)}: flags {bad} are not mqnc {command}'s"


def check_torchrun(argv: list[str], where: str) -> None:
    """torchrun's parser, then mqnc's for what it hands ``-m mqnc``."""
    from torch.distributed.run import get_args_parser

    run = get_args_parser().parse_args(argv[1:])
    if run.module and run.training_script == "mqnc":
        check_mqnc_args(run.training_script_args, where)


def commands(block: Block) -> list[list[str]]:
    """Each simple command of a shell block as argv, ``$VAR`` of the block's own assignments
    expanded, a trailing ``&`` dropped; split at ``&&``, ``||``, ``;`` and ``|``."""
    env: dict[str, str] = {}
    out = []
    for line in logical_lines(block.text):
        line = re.sub(r"\$(\w+)", lambda m: env.get(m.group(1), m.group(0)), line)
        argv: list[str] = []
        lex = shlex.shlex(line, posix=True, punctuation_chars=";&|")
        lex.whitespace_split = True
        for tok in [*lex, ";"]:
            if tok not in ("&&", "||", ";", "|", "&"):
                argv.append(tok)
                continue
            words = argv[1:] if argv[:1] == ["export"] else argv
            while words and _ASSIGN.match(words[0]):
                name, value = words[0].split("=", 1)
                env[name] = value
                words = words[1:]
            if words:
                out.append(words)
            argv = []
    return out


def static_checks(block: Block) -> list[list[str]]:
    """Parse every command of a shell block; returns the pip install commands (not run)."""
    pip = []
    for argv in commands(block):
        word = _command_word(argv[0])
        module = argv[2] if word.startswith("python") and argv[1:2] == ["-m"] else None
        if (word in ("pip", "pip3") or module == "pip") and "install" in argv:
            check_pip_install(argv)
            pip.append(argv)
        elif word == "mqnc":
            check_mqnc_args(argv[1:], block.id)
        elif module == "mqnc":
            check_mqnc_args(argv[3:], block.id)
        elif word == "torchrun":
            check_torchrun(argv, block.id)
    return pip


def check_run_by(block: Block) -> None:
    """Every ``FILE::TEST`` of a run-by comment exists; a python block's tests read its page."""
    names = [n.strip() for n in block.mark("run-by").split(",") if n.strip()]
    assert names, f"{block.id}: run-by names no test"
    for name in names:
        path, _, func = name.partition("::")
        source = ROOT / path
        assert source.is_file(), f"{block.id}: run-by {name}: no file {path}"
        text = source.read_text()
        assert re.search(rf"^def {re.escape(func)}\(", text, re.M), f"{block.id}: no test {name}"
        if block.kind == "python":
            assert block.page.name in text, f"{block.id}: {name} does not read {block.page.name}"


BLOCKS = [b for page in PAGES for b in parse_blocks(page)]
CODE = [b for b in BLOCKS if b.kind != "text"]


# ---- running -----------------------------------------------------------------------------------


def _env() -> dict[str, str]:
    return dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
                MPLBACKEND="Agg", PYTHONUNBUFFERED="1")  # fmt: skip


def runs(block: Block) -> bool:
    """Whether the test executes the block (not marked, and code)."""
    return block.kind != "text" and block.mark("run-by") is None and block.mark("gpu-only") is None


# python blocks: each run as ``python -c`` runs it, in a new process forked from one interpreter
# that has imported torch (correctness/preloaded.py: ~1.7 s of a CPU a block less), nothing else
_PYTHON: list = []


@pytest.fixture(scope="module", autouse=True)
def _close_the_preloaded_interpreter():
    yield
    while _PYTHON:
        _PYTHON.pop().close()


def execute(block: Block) -> str:
    """Run one block as written (python: as ``python -c`` runs it, forked from an interpreter
    that has imported torch; shell: ``bash -e``, pip install lines left out), in the
    repository; its stdout."""
    if block.kind == "python":
        if not _PYTHON:
            _PYTHON.append(Preloaded("import torch", _env()))
        r = _PYTHON[0].run(block.text, timeout=TIMEOUT_S, cwd=ROOT)
    else:
        pip = {shlex.join(a) for a in static_checks(block)}
        keep = [s for s in logical_lines(block.text)
                if shlex.join(shlex.split(s, comments=True)) not in pip]  # fmt: skip
        r = subprocess.run(["bash", "-e", "-c", "\n".join(keep)], cwd=ROOT, env=_env(),
                           capture_output=True, text=True, timeout=TIMEOUT_S)  # fmt: skip
    assert r.returncode == 0, (
        f"{block.id} exited {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    )
    return r.stdout


_DONE: set[str] = set()


def run_with_page_prerequisites(block: Block) -> None:
    """Run the earlier runnable blocks of the block's page first (unless done), then it."""
    for earlier in CODE:
        if earlier.page == block.page and earlier.line < block.line and runs(earlier):
            if earlier.id not in _DONE:
                execute(earlier)
                _DONE.add(earlier.id)
    out = execute(block)
    _DONE.add(block.id)
    shown = _output_shown_after(block)
    if shown is not None:
        assert out.strip() == shown.strip(), f"{block.id} prints\n{out}\nnot what its page shows"


def _output_shown_after(block: Block) -> str | None:
    """The text of the block right after ``block`` on its page when an ``<!-- output -->``
    comment marks it as what ``block`` prints (compared verbatim), else None."""
    later = [b for b in BLOCKS if b.page == block.page and b.line > block.line]
    if later and later[0].mark("output") is not None:
        return later[0].text
    return None


@pytest.mark.parametrize("block", CODE, ids=[b.id for b in CODE])
def test_block_runs_as_written(block):
    if block.mark("gpu-only") is not None:
        if block.kind == "shell":
            static_checks(block)
        pytest.skip(f"{block.id}: marked gpu-only")
    if block.kind == "shell":
        static_checks(block)
    if block.mark("run-by") is not None:
        check_run_by(block)
        return
    run_with_page_prerequisites(block)


# ---- the parser itself, and what the blocks assume -----------------------------------------


def test_the_pages_have_code_and_every_fence_is_read():
    """The README and the docs hold runnable blocks; a page's fences pair up (a fence left open
    would swallow the rest of the page and hide its blocks)."""
    ids = {b.id.split(":")[0] for b in CODE}
    assert "README.md" in ids and any(i.startswith("docs/") for i in ids)
    for page in PAGES:
        opened = sum(1 for line in page.read_text().splitlines() if line.strip().startswith("```"))
        assert opened % 2 == 0, f"{page.relative_to(ROOT)}: an odd number of fences"


def test_block_kinds_and_shell_commands_are_read_as_a_shell_would():
    page = ROOT / "x.md"
    text = "\n".join([
        "<!-- run-by: a.py::t -->", "```", 'A="--x 1"', "mqnc predict $A \\", "  --m-q 2 &",
        "make test && echo ok  # done", "```", "```", "--quick   a flag", "```",
        "<!-- gpu-only -->", "```bash", "pip install -e '.[test,hf]'", "```",
    ])  # fmt: skip
    page_blocks = _parse_text(page, text)
    assert [b.kind for b in page_blocks] == ["shell", "text", "shell"]
    first, _, last = page_blocks
    assert first.mark("run-by") == "a.py::t" and first.mark("gpu-only") is None
    assert last.mark("gpu-only") == "" and first.line == 2
    assert commands(first) == [["mqnc", "predict", "--x", "1", "--m-q", "2"], ["make", "test"],
                               ["echo", "ok"]]  # fmt: skip
    assert static_checks(last) == [["pip", "install", "-e", ".[test,hf]"]]
    assert {"test", "hf", "notebooks", "gpu", "fast"} <= _extras()
    with pytest.raises(AssertionError, match="not in pyproject"):
        check_pip_install(["pip", "install", "-e", ".[test,gpus]"])
    with pytest.raises(AssertionError, match="are not mqnc predict's"):
        check_mqnc_args(["predict", "--mq-q", "1"], "x")
    with pytest.raises(AssertionError, match="no such subcommand"):
        check_mqnc_args(["predcit"], "x")
    check_mqnc_args(["-v", "predict", "--fabric", "out/not-yet.json"], "x")
    quoted = _parse_text(page, "```bash\npython -c \"\nprint('a # b')\n\"  # c\nls\n```\n")[0]
    assert commands(quoted) == [["python", "-c", "\nprint('a # b')\n"], ["ls"]]


def _parse_text(page: Path, text: str) -> list[Block]:
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / page.name
        path.write_text(text)
        return [dataclasses.replace(b, page=page) for b in parse_blocks(path)]


def test_make_test_runs_the_suite():
    """What the pages' ``make test`` blocks stand for (the suite cannot run itself): the target
    runs ``pytest correctness`` in the venv it bootstraps (``make test-long``: its long tier),
    CI runs it, and the long Hypothesis profile the pages name is registered."""
    make = (ROOT / "Makefile").read_text()
    recipe = re.search(r"^test: .*\n\t(.*)$", make, re.M)
    assert recipe and "-m pytest correctness" in recipe.group(1), recipe
    long = re.search(r"^test-long: .*\n\t(.*)$", make, re.M)  # the long tier, where there is one
    assert long is None or "-m pytest correctness" in long.group(1) and "-m long" in long.group(1)
    assert "make test" in (ROOT / ".ci" / "run").read_text()
    assert 'register_profile(\n    "thorough"' in (ROOT / "correctness" / "conftest.py").read_text()


def test_every_relative_link_resolves():
    """A page moved or renamed leaves no dead link behind (links and images, README and docs)."""
    dead = []
    for page in PAGES:
        for m in re.finditer(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            target = m.group(1)
            if "://" not in target and not (page.parent / target).exists():
                dead.append(f"{page.relative_to(ROOT)}: {target}")
    assert not dead, "links to nothing:\n" + "\n".join(dead)


# What README's "Results" quotes from perf/results/results.jsonl: (bench, variant, x, commit,
# the number as printed). The first record of that bench, variant, x and commit is the one quoted.
README_QUOTES = (
    ("mla_decode", "H=16,B=1", 2048, "bb7e891", "12.5"),
    ("mla_decode", "H=128,B=1", 2048, "bb7e891", "22.6"),
    ("mla_sparse", "H=128,B=1@64x32w8s2-pipe", 2048, "933b242", "22.1"),
    ("mla_sparse", "H=128,B=8@64x32w8s2-pipe", 2048, "933b242", "47.6"),
    ("merge", "M=8", 256, "bb7e891", "3.3"),
    ("splice", "one-launch", 2048, "bb7e891", "42.5"),
    ("splice", "per-layer", 2048, "bb7e891", "139"),
    ("mla_decode", "H=16,B=128", 65536, "bb7e891", "3603"),
    ("mla_decode_gluon", "H=128,B=64@seesaw", 8192, "933b242", "256"),
    ("mla_decode", "H=128,B=64@64x64w8s2-tma", 8192, "933b242", "498"),
    ("mla_decode", "H=16,B=16", 32768, "bb7e891", "240.8"),
    ("mla_decode", "H=16,B=16", 32768, "933b242", "240.2"),
    ("mla_decode", "H=16,B=16,fp8", 32768, "933b242", "502.1"),
    ("mla_sparse", "H=128,B=8", 2048, "933b242", "55.8"),
    ("mla_sparse", "H=128,B=8", 2048, "bb7e891", "103.5"),
    ("mla_sparse", "H=128,B=8,fp8", 2048, "933b242", "79.6"),
    ("probe", "gloo", 1, "e1a0e40", "882"),
    ("host_ratio", "gloo: route M_q 1 (stub) / probe", 1, "b151e19", "1.32"),
)


def test_readme_results_quote_their_records(capsys):
    """Each number README's "Results" quotes from a record is that record's p50 as printed, and
    the command it names for the wire break-even prints both break-evens."""
    import json

    from mqnc.cli import main as mqnc_main

    readme = (ROOT / "README.md").read_text()
    results = readme.split("\n## Results\n", 1)[1].split("\n## ", 1)[0]
    lines = (ROOT / "perf" / "results" / "results.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines if line.strip()]
    for bench, variant, x, commit, printed in README_QUOTES:
        found = [
            r for r in records
            if (r["bench"], r["variant"], r["x"]) == (bench, variant, x)
            and r["commit"].startswith(commit)
        ]  # fmt: skip
        assert found, f"no record {bench} {variant!r} x={x} at {commit}"
        decimals = len(printed.partition(".")[2])
        assert f"{found[0]['p50']:.{decimals}f}" == printed, (bench, variant, found[0]["p50"])
        assert re.search(rf"(?<![\d.]){re.escape(printed)}(?![\d])", results), printed
    assert "`mqnc predict` / `mqnc predict --kv-dtype fp8`" in results
    for argv, rows in ((["predict"], "1080.3"), (["predict", "--kv-dtype", "fp8"], "615.2")):
        assert mqnc_main(argv) == 0
        assert f"break-even M_q = {rows}" in capsys.readouterr().out, argv
        assert f"{rows} rows" in results
