"""``mqnc corpus``: prefill a shared context once with a Hugging Face DeepSeek model and write the
corpus file that ``mqnc serve``'s holders load (:func:`mqnc.integrations.hf.prefill_context`,
:meth:`mqnc.serving.Corpus.save`).

The machine that runs it needs the model; the holders never do. The output is a JSON manifest
and a ``.safetensors`` file beside it: copy both to every holder machine (or put them on a shared
file system) and start ``mqnc serve --corpus corpus.json`` under torchrun.
"""

from __future__ import annotations

from pathlib import Path

from mqnc.base.checks import is_int
from mqnc.measure.options import (
    hf_model_arg,
    nonnegative_int,
    nonnegative_int_list,
    positive_int,
    resolve_hf_model,
)

__all__ = ["register", "read_token_ids"]

DTYPES = ("float32", "bfloat16", "float16")
DESCRIPTION = (
    "Prefill a shared context once with a Hugging Face DeepSeek model (its own forward) and "
    "write the corpus mqnc serve's holders load: a JSON manifest (chunks, holder ranks, "
    "replicas, geometry, RoPE) and a .safetensors file beside it. Only this machine needs the "
    "model."
)


def read_token_ids(path: str) -> list[int]:
    """Token ids from a JSON file: a list of ints, or ``{"token_ids": [...]}`` (parsed as the
    corpus manifest is: shallow, finite numbers only; any error names the flag and the file)."""
    from mqnc.serving.corpus import parse_json  # here: registering must not load torch

    try:
        data = parse_json(Path(path).read_text(), "the text")
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ValueError(f"--context: cannot read {path} as JSON token ids ({exc})") from None
    ids = data.get("token_ids") if isinstance(data, dict) else data
    bad = [i for i in ids if not (is_int(i) and i >= 0)] if isinstance(ids, list) else []
    if not isinstance(ids, list) or not ids or bad:
        got = f"element {bad[0]!r}" if bad else f"{type(ids).__name__} {str(ids)[:40]}"
        raise ValueError(
            f"--context: expected a JSON list of token ids (ints >= 0) or "
            f"{{'token_ids': [...]}} in {path}, got {got}"
        )
    return ids


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _run(args) -> int:
    # imported here: registering this command must not load torch (``mqnc --help``)
    from mqnc.base.runtime import use_interpreter_without_cuda

    use_interpreter_without_cuda()
    ids = read_token_ids(args.context)
    source = resolve_hf_model(args.model)  # (at once, in one line: before torch is imported)
    import torch
    from transformers import AutoModelForCausalLM

    from mqnc.integrations.hf import prefill_context

    try:
        model = AutoModelForCausalLM.from_pretrained(source, dtype=getattr(torch, args.dtype))
    except OSError as exc:  # (transformers' own: weights missing, a download broken off)
        raise ValueError(f"--model: cannot load {args.model!r}: {_first_line(exc)}") from None
    corpus = prefill_context(
        model.eval(),
        ids,
        chunk_tokens=args.chunk_tokens,
        holders=args.holders,
        replicas=args.replicas,
        position=args.position,
        kernels=args.kernels,
    )
    path = corpus.save(args.out)
    print(
        f"wrote {path} (a SHA-256 per chunk, checked when a holder loads it) and "
        f"{path.with_suffix('.safetensors').name}: {corpus.tokens} tokens in "
        f"{len(corpus.chunks)} chunks on ranks {corpus.holder_ranks} (x{args.replicas}), "
        f"{corpus.dtype}, prefill {corpus.meta['prefill_us'] / 1e3:.0f} ms"
    )
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "corpus",
        help="prefill a shared context once with a Hugging Face DeepSeek model; write the "
        "corpus file mqnc serve's holders load",
        description=DESCRIPTION,
    )
    p.add_argument(
        "--model",
        type=hf_model_arg,
        required=True,
        metavar="DIR|HUB_ID",
        help="Hugging Face model folder (from_pretrained), or a hub id (org/name): a path "
        "that does not exist is refused without asking the hub; HF_HUB_OFFLINE is honoured",
    )
    p.add_argument("--context", required=True, help="JSON token ids of the shared context")
    p.add_argument("--chunk-tokens", type=positive_int, default=256, help="default 256")
    p.add_argument(
        "--holders", type=nonnegative_int_list, required=True, help="holder ranks, e.g. 2,3"
    )
    p.add_argument("--replicas", type=positive_int, default=1, help="copies per chunk (default 1)")
    p.add_argument(
        "--position", type=nonnegative_int, default=0, help="canonical position of token 0"
    )
    p.add_argument("--dtype", choices=DTYPES, default="bfloat16", help="default bfloat16")
    p.add_argument(
        "--kernels",
        choices=("triton", "torch"),
        default="triton",
        help="the kernels the holders will serve it with (default triton: the model's widths "
        "are checked against what the Triton kernels run; torch runs any width)",
    )
    p.add_argument("--out", required=True, help="manifest path (.json)")
    p.set_defaults(func=_run)
