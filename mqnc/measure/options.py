"""The command-line options every benchmark (``perf/bench_*.py``) takes, and the option types
the ``mqnc`` command shares with them (torch-free: ``mqnc --help`` reads them).

Every benchmark is built the same way::

    ap = bench_parser(__doc__, reps=20)          # --quick --reps --warmup --out/--record --check
    ap.add_argument("--c-t", type=int_list, ...)  # its own sweep axes: comma lists
    args = parse_bench_args(ap, argv)            # args.out: the file this run appends to
    ...                                          # record(..., path=args.out)
    return finish(args, TARGETS)                 # summary; with --check, 1 on a missed target

Where records go: ``--out FILE``; else ``--record``, the repository's tracked
``perf/results/results.jsonl`` (the file the README's and docs/results.md's tables and the
notebooks read: commit what you record there); else ``$MQNC_RESULTS``; else
``perf/results/local.jsonl`` beside it, which git ignores
(:func:`mqnc.measure.results_file.output_path`). A quick smoke run therefore never changes the
repository.

Lists are comma-separated everywhere (``--m-q 1,64,1024``); a value that is not valid is an
argparse error naming the flag (exit status 2).
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Sequence

from mqnc.base.env import results_file
from mqnc.measure.results_file import output_path, read_new
from mqnc.measure.targets import Target, check_targets
from mqnc.model.geometry import MLAGeometry, load_geometry
from mqnc.transport import names

__all__ = [
    "TRANSPORTS",
    "positive_int",
    "nonnegative_int",
    "positive_float",
    "nonnegative_float",
    "int_list",
    "nonnegative_int_list",
    "transport_list",
    "choice_list",
    "model_arg",
    "check_hf_model",
    "hf_model_arg",
    "resolve_hf_model",
    "hidden_alias",
    "bench_parser",
    "parse_bench_args",
    "finish",
]

TRANSPORTS = names()
"""Transport engines by name, from the registry (:mod:`mqnc.transport.registry`; the echo
fabric runs the host engines, loopback and gloo; nvshmem on a GPU)."""


# ---- option types: argparse prefixes each message with "argument --flag:" ------------------


def _number(text: str, kind: type, minimum: float, strict: bool):
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {kind.__name__}, got {text!r}") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    if value < minimum or (strict and value == minimum):
        raise argparse.ArgumentTypeError(
            f"expected a number {'>' if strict else '>='} {minimum:g}, got {text!r}"
        )
    return value


def positive_int(text: str) -> int:
    """An int >= 1."""
    return _number(text, int, 1, strict=False)


def nonnegative_int(text: str) -> int:
    """An int >= 0."""
    return _number(text, int, 0, strict=False)


def positive_float(text: str) -> float:
    """A finite float > 0."""
    return _number(text, float, 0.0, strict=True)


def nonnegative_float(text: str) -> float:
    """A finite float >= 0."""
    return _number(text, float, 0.0, strict=False)


def _int_list(text: str, minimum: int) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or min(values) < minimum:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated ints >= {minimum}, got {text!r}"
        )
    return values


def int_list(text: str) -> list[int]:
    """Comma-separated ints >= 1 (``1,4,16``)."""
    return _int_list(text, 1)


def nonnegative_int_list(text: str) -> list[int]:
    """Comma-separated ints >= 0 (``0,1,3``)."""
    return _int_list(text, 0)


def choice_list(choices: Sequence[str]):
    """An option type: comma-separated names out of ``choices`` (at least one; a name not
    among them is an error naming the choices, never an empty run)."""

    def parse(text: str) -> list[str]:
        names = [t.strip() for t in text.split(",") if t.strip()]
        if not names or any(t not in choices for t in names):
            raise argparse.ArgumentTypeError(
                f"expected comma-separated names out of {', '.join(choices)}, got {text!r}"
            )
        return names

    return parse


def transport_list(text: str) -> list[str]:
    """Comma-separated transport names out of :data:`TRANSPORTS`."""
    return choice_list(TRANSPORTS)(text)


def model_arg(text: str) -> MLAGeometry:
    """A model preset name or a path to a Hugging Face ``config.json`` (or its folder)."""
    try:
        return load_geometry(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("model: ")) from None


# A Hugging Face hub id: ``name`` or ``namespace/name`` (letters, digits, ``-``, ``_``, ``.``).
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")
_FOLDER_OR_ID = "a model folder holding config.json, or a Hugging Face hub id such as org/name"


def _path_like(text: str) -> bool:
    """``text`` names a file system path, never a hub id: it starts with ``.``, ``/`` or ``~``,
    or holds a path separator in a shape no hub id has (``namespace/name`` is a hub id)."""
    if text.startswith((".", "/", "~")) or "\\" in text or (os.sep != "/" and os.sep in text):
        return True
    return "/" in text and _HUB_ID.fullmatch(text) is None


def check_hf_model(model: str, flag: str = "--model") -> str:
    """A Hugging Face model for ``from_pretrained`` (``mqnc corpus`` / ``mqnc serve
    --model``): an existing folder holding ``config.json`` (returned, ``~`` expanded), or a hub
    id (returned as it is; :func:`resolve_hf_model` finds it). Checked without the network: a
    path-like value (:func:`_path_like`) that is no folder, a file, or a folder without
    ``config.json`` is a ``ValueError`` naming ``flag``, in one line."""
    path = os.path.expanduser(model)
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ValueError(
                f"{flag}: expected {_FOLDER_OR_ID}, got the folder {model!r}, which has no "
                f"config.json"
            )
        return path
    if os.path.exists(path):
        raise ValueError(f"{flag}: expected {_FOLDER_OR_ID}, got the file {model!r}")
    if _path_like(model) or not _HUB_ID.fullmatch(model):
        raise ValueError(
            f"{flag}: expected {_FOLDER_OR_ID}, got {model!r}: no such folder (not looked up "
            f"on the hub)"
        )
    return model


def hf_model_arg(text: str) -> str:
    """:func:`check_hf_model` as an argparse type (its error prefixed ``argument --model:``)."""
    try:
        return check_hf_model(text, flag="")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix(": ")) from None


def _offline() -> bool:
    """``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) set true, as huggingface_hub reads it."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.strip().upper() in ("1", "ON", "YES", "TRUE")


def resolve_hf_model(model: str, flag: str = "--model") -> str:
    """``model`` as ``from_pretrained`` will load it, or a ``ValueError`` naming ``flag`` in one
    line, at once: what :func:`check_hf_model` refuses; an existing folder; a hub id found in the
    local Hugging Face cache as it is; with ``HF_HUB_OFFLINE`` set, any other id refused without
    asking the hub; else the hub is asked once (no retries): an id it does not know, or a hub
    that cannot be reached, is refused (``from_pretrained`` would retry for about half a minute,
    then raise a traceback)."""
    model = check_hf_model(model, flag)
    if os.path.isdir(model):
        return model
    import huggingface_hub  # here: registering the commands must not import it

    if isinstance(huggingface_hub.try_to_load_from_cache(model, "config.json"), str):
        return model
    where = f"{flag}: {model!r} is no folder and not in the Hugging Face cache"
    if _offline():
        raise ValueError(f"{where}, and HF_HUB_OFFLINE is set (the hub is not asked)")
    try:
        huggingface_hub.model_info(model, timeout=10)
    except Exception as exc:  # (the hub's, httpx's: a missing or private id, no network)
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(
            f"{where}, and the Hugging Face hub did not give it ({type(exc).__name__}: "
            f"{reason}); pass a model folder, or set HF_HUB_OFFLINE=1 not to ask the hub"
        ) from None
    return model


def hidden_alias(parser: argparse.ArgumentParser, alias: str, dest: str, **kwargs) -> None:
    """Accept ``alias`` as another spelling of the option stored in ``dest``, without listing
    it in ``--help`` (kept so that older command lines keep working)."""
    parser.add_argument(
        alias, dest=dest, default=argparse.SUPPRESS, help=argparse.SUPPRESS, **kwargs
    )


# ---- the benchmarks' flag set ------------------------------------------------------------------


def bench_parser(
    doc: str | None,
    *,
    reps: int | str,
    warmup: int | str = 3,
    transports: bool = False,
    tiny: bool = False,
) -> argparse.ArgumentParser:
    """The parser every benchmark starts from.

    Flags: ``--quick`` (a small sweep), ``--reps N`` and ``--warmup N`` (per timed point; the
    defaults are the benchmark's, given as ``reps`` / ``warmup``: a number, or words such as
    ``"50 on a GPU, 5 on a CPU"`` for a default the benchmark picks itself, when the parsed
    value is None), ``--out FILE`` or ``--record`` (where records go, see the module
    docstring), ``--check`` (exit status 1 when a record misses its target). With
    ``transports``: ``--transport a,b`` and ``--model``. With ``tiny`` (the kernel benchmarks
    that ``perf/gpu_check.sh --dry-run`` runs): ``--tiny``, the dry run's sizes, run by the
    Triton kernels themselves (interpreted without a GPU); each benchmark's docstring says
    what it cuts. The description is the first paragraph of ``doc`` (the benchmark's
    docstring) without its reST markup.
    """
    ap = argparse.ArgumentParser(
        description=_plain((doc or "").strip().split("\n\n")[0]),
        epilog="Records go to --out FILE, else with --record to the repository's "
        "perf/results/results.jsonl, else to $MQNC_RESULTS, else to perf/results/local.jsonl "
        "(git-ignored).",
    )
    ap.add_argument("--quick", action="store_true", help="a small sweep (a CPU smoke run)")
    ap.add_argument(
        "--reps",
        type=positive_int,
        default=reps if isinstance(reps, int) else None,
        help=f"timed repetitions per point (default {reps})",
    )
    ap.add_argument(
        "--warmup",
        type=nonnegative_int,
        default=warmup if isinstance(warmup, int) else None,
        help=f"untimed repetitions before them (default {warmup})",
    )
    where = ap.add_mutually_exclusive_group()
    where.add_argument("--out", metavar="FILE", default=None, help="append records to FILE")
    where.add_argument(
        "--record",
        action="store_true",
        help="append to the repository's tracked perf/results/results.jsonl",
    )
    ap.add_argument(
        "--check", action="store_true", help="exit with status 1 when a target is missed"
    )
    if transports:
        ap.add_argument(
            "--transport",
            type=transport_list,
            default=["loopback"],
            metavar="NAMES",
            help=f"comma-separated engines out of {', '.join(TRANSPORTS)} (loopback)",
        )
        ap.add_argument(
            "--model",
            type=model_arg,
            default="deepseek-v2-lite",
            metavar="NAME|CONFIG",
            help="model preset or Hugging Face config.json giving the row sizes (deepseek-v2-lite)",
        )
    if tiny:
        ap.add_argument(
            "--tiny",
            action="store_true",
            help="the dry run's sizes (perf/gpu_check.sh --dry-run), run by the Triton kernels "
            "(interpreted without a GPU)",
        )
    return ap


def _plain(text: str) -> str:
    """reST to plain text for ``--help``: roles (:mod:`a.b`, :func:`~a.b`) become their target's
    name, literals lose their backquotes, lines are joined."""
    text = re.sub(r":[a-z]+:`~?([^`]+)`", lambda m: m.group(1), text)
    return " ".join(text.replace("``", "").split())


def parse_bench_args(
    parser: argparse.ArgumentParser, argv: Sequence[str] | None = None
) -> argparse.Namespace:
    """Parse ``argv``; ``args.out`` becomes the results file this run appends to (a str),
    ``args.results_lines`` the number of lines it held before (so that :func:`finish` reads
    back exactly this run's records) and ``args.results_note`` what :func:`finish` says of it."""
    args = parser.parse_args(argv)
    try:
        out = output_path(args.out, record=args.record)
    except ValueError as exc:
        parser.error(str(exc))
    if args.record:
        args.results_note = " (the repository's tracked results: commit them with the change)"
    elif args.out is None and results_file() is None:
        args.results_note = " (git-ignored; --record appends to perf/results/results.jsonl)"
    else:
        args.results_note = ""
    args.out = os.fspath(out)
    args.results_lines = _lines(out)
    return args


def _lines(path) -> int:
    try:
        with open(path, "rb") as f:
            return sum(1 for _ in f)
    except FileNotFoundError:
        return 0


def finish(args: argparse.Namespace, targets: Sequence[Target] = ()) -> int:
    """Say where this run's records went and how they compare with ``targets``; the exit
    status: 1 when ``--check`` was given and a record missed its target, else 0."""
    recs = read_new(args.out, args.results_lines)
    print(f"{len(recs)} records appended to {args.out}{args.results_note}")
    verdicts = check_targets(recs, targets)
    for line in verdicts.lines:
        print(line)
    if verdicts.checked and not verdicts.missed:
        print("targets met")
    if verdicts.missed:
        print("TARGETS MISSED" + ("" if args.check else " (exit status 0: --check makes it 1)"))
    return 1 if (args.check and verdicts.missed) else 0
