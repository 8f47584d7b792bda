"""``mqnc demo``: an agentic fan-in over a partitioned canonical corpus, decided, executed and
verified end to end (§1, §5, §6.3 of the paper).

One immutable document (a "codebase" of ``chunks`` canonical chunks) is prefilled once into MLA
cache, each chunk on its own at its canonical position (position-independent caching, §1,
§2.2), and partitioned over ``holders`` holder instances (processes over torch.distributed gloo
by default, threads over the in-process loopback with ``--transport loopback``). ``agents``
sub-agents then decode ``steps`` tokens each (one by default), through all ``L`` layers of a
small real MLA model (:class:`mqnc.model.MLAModel`, DeepSeek-V2-Lite attention geometry, YaRN
RoPE):

- **whole-chunk agents** (contiguous reuse, §2.2) read a few chunks placed at *new* offsets,
  followed by their own suffix; they come in teams (agents forked from one context, reading the
  same chunks at the same offsets: one fetch or re-prefill serves the team, each agent pays its
  own route calls), and the teams and their chunks are planned from this machine's constants
  (:mod:`~mqnc.demo.teams`) so that the chunks read are those nearest the predicate's
  crossover (straddling it where the corpus' lengths reach it): a chunk long enough, read by few
  enough agents, routes; a shorter or shared one is fetched or re-prefilled; a path that wins
  nowhere is named with the numbers that rule it out;
- **selection agents** (§5.4) fork the whole corpus as their prefix at its canonical positions
  and attend, per layer and step, a DSA-style top-k selection scattered across the holders
  (the indexer here is exact top-k of a small random projection of the scores; see
  :class:`~mqnc.demo.workload.Indexer`), plus their suffix.

For every (chunk, agent) the closed-form predicate (:func:`mqnc.cost.decide`) picks route,
fetch or local with this machine's constants (calibrated at start-up by a short probe / route
sweep and one timed call of each primitive, or loaded with ``--profile``; the request:
:func:`mqnc.demo.teams.read_request`), the report prints each decision's predicted cost of every
path beside its pick (``demo.json`` keeps every term), and the demo executes that choice for
real: route sends the absorbed query rows (rotated by the opposite delta, §3.2)
to the holder, which batches all waiting rows into one kernel call (§6.3); fetch pulls all
layers and splices them into the requester's pool (§2.2); local re-prefills the chunk through
the model. ``--force`` runs every (chunk, agent) through one primitive. Then (unless
``--no-compare``, ``--force`` or the fault drill) the same decode runs once more from an empty
pool with every (chunk, agent) through the other of route and fetch, so that the model is
measured on both primitives whatever the predicate picked, and the predicate's picks are timed
against the alternative. Each decode runs ``--repeats`` times (5; 1 in the fault drill), each
from an empty pool, the two interleaved; every call is scored by its median over the repeats
(:func:`mqnc.demo.report.median_calls`) and each single decode's MAPE is printed beside it.
With repeats, the constants are measured three times (before the decodes, after the middle
repeat, after the last) and each primitive is predicted with its median round
(:func:`mqnc.demo.calibration.median_rounds`); the predicate decides with the first.

Every partial and every merged answer is compared with a single-instance fp64 reference over
the same keys (the canonical cache, re-homed to the agent's offsets by an exact fp64
rotation); the demo fails (exit 1) beyond the bounds of :data:`mqnc.testing.TOLERANCES`
(``demo_partial`` / ``demo_merged``). At the end it prints a table per primitive (count, wire
bytes, measured time per cost term beside the model's prediction, MAPE, max error) and, per
path, the predicate's decisions and how their partials compared with fp64, writes
everything as JSON under ``--out`` and draws measured against predicted time as a PNG.

The pieces, one module each: :mod:`~mqnc.demo.config` (what a run depends on),
:mod:`~mqnc.demo.workload` (model, corpus, agents, indexer), :mod:`~mqnc.demo.teams` (the
whole-chunk agents' teams and chunks from the constants, the decisions as printed),
:mod:`~mqnc.demo.cluster` (the
holders and the requester's transport), :mod:`~mqnc.demo.calibration` (this machine's
constants), :mod:`~mqnc.demo.step` (decide and execute one decode step),
:mod:`~mqnc.demo.verify` (the fp64 checks), :mod:`~mqnc.demo.report` (table, JSON, PNG) and
:mod:`~mqnc.demo.run` (all of it in order). The command is registered by :mod:`mqnc.cli.cmd_demo`.

``mqnc demo --hf`` (:mod:`mqnc.demo.hf_demo`, :func:`run_hf_demo`) runs a Hugging Face DeepSeek
model generating over holders (:mod:`mqnc.integrations.hf`) the same way, with the same table.
"""

from __future__ import annotations

import time

from mqnc.base.runtime import use_interpreter_without_cuda
from mqnc.demo.config import DemoConfig, HFDemoConfig, HolderStartupError

__all__ = ["DemoConfig", "HFDemoConfig", "HolderStartupError", "run_demo", "run_hf_demo"]


def run_demo(cfg: DemoConfig) -> dict:
    """Run the demo; returns the JSON-able result (also written under ``cfg.out``).

    Every argument is checked first (:func:`mqnc.demo.preflight.prepare`: ``ValueError`` /
    ``FileNotFoundError`` naming it, before any work). Raises
    :class:`~mqnc.demo.cluster.HolderStartupError` when a holder fails or dies before it
    serves, and ``AssertionError`` when an answer is beyond its bound (the CLI exits 1).
    """
    from mqnc.demo.preflight import prepare
    from mqnc.demo.progress import Progress

    t0 = time.perf_counter()
    progress = Progress(isinstance(cfg, DemoConfig) and cfg.progress, t0)
    # said at once: the checks load torch, which takes a second or two
    progress.phase("mqnc demo: checking the arguments and this machine (CUDA, profile, --out)")
    prep = prepare(cfg)
    use_interpreter_without_cuda()
    # imported here, after the kernel mode is chosen (the kernels are compiled or interpreted
    # as they are imported), and so that ``mqnc --help`` (which reads DemoConfig) loads no torch
    from mqnc.demo.run import run

    return run(prep, progress)


def run_hf_demo(cfg: HFDemoConfig) -> dict:
    """Run ``mqnc demo --hf`` (:mod:`mqnc.demo.hf_demo`); returns the JSON-able result (also written
    under ``cfg.out``). Raises ``AssertionError`` when the run is beyond its exactness bound."""
    use_interpreter_without_cuda()
    from mqnc.demo.hf_demo import run

    return run(cfg)
