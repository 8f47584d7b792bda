"""The transport engines by name: what each is, where it runs, and how to build one.

Torch-free (``mqnc --help`` reads it): an entry names its engine's module and callable as a
string, and :meth:`Engine.open_fabric` / :meth:`Engine.connect` import it on first use. Every
command-line ``--transport``, option parser, demo configuration and the service reads the names
from here (:func:`names`), so that a new engine is three edits: its module, its entry in
:data:`ENGINES` and its harness in ``correctness/test_transport_conformance.py``.

Two kinds of engine:

- **in-process** (``in_process=True``, loopback): every rank is a thread of this process;
  ``open_fabric(name, world, slot_bytes=...)`` returns the fabric, which gives each rank's
  endpoint (``fabric.endpoints``, ``fabric.endpoint(rank)``) and can mark a rank dead
  (``fabric.kill(rank)``, the fault drills);
- **across processes** (gloo, NVSHMEM): one rank per process, meeting on a
  ``torch.distributed`` store; ``connect(name, rank, world, store, slot_bytes=...)`` returns
  this rank's endpoint.

``"auto"`` (:data:`AUTO`) is not an engine: it is the service's selection policy
(:func:`select`), the GPU engine across processes when it runs here, else the CPU one.
"""

from __future__ import annotations

import dataclasses
import importlib
import types
from collections.abc import Mapping

__all__ = [
    "AUTO",
    "ENGINES",
    "Engine",
    "connect",
    "describe",
    "engine",
    "names",
    "open_fabric",
    "select",
    "unavailable",
]

AUTO = "auto"
"""The service's selection policy (:func:`select`), not an engine."""
AUTO_SUMMARY = "the GPU engine across processes when it runs here, else the CPU one"


def _load(target: str):
    """The object ``"package.module:attribute"`` names (the module imported now)."""
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


@dataclasses.dataclass(frozen=True)
class Engine:
    """One engine's registry entry.

    Attributes
    ----------
    name : str
        What every ``--transport`` flag, option and configuration calls it.
    summary : str
        One line for ``--help``.
    factory : str
        ``"module:callable"`` building it, imported on first use: an in-process engine's
        callable is ``(world, slot_bytes, lanes=...) -> fabric``, a cross-process engine's
        ``(rank, world, store, *, slot_bytes, lanes, **options) -> Transport``.
    in_process : bool
        Every rank is a thread of one process (True), or one rank per process (False).
    needs_gpu : bool
        Runs only with a CUDA device (its ``device=`` is passed on; host engines take none).
    probe : str or None
        ``"module:callable"`` returning whether the engine runs on this machine (None: it
        always does); imported only when asked (:meth:`unavailable`).
    requires : str
        What the engine needs, for the message when it cannot run.
    exit_directly : bool
        A process that ran the engine should end through ``os._exit`` once its output is
        flushed (gloo keeps closed groups alive until exit; their destructors at interpreter
        shutdown can abort).
    detects_peer_loss : bool
        A wait on a slot fed by a dead peer raises
        :class:`~mqnc.transport.protocol.PeerLost` at once (True), or runs to its timeout
        (False: NVSHMEM has no connection whose closing would say so).
    """

    name: str
    summary: str
    factory: str
    in_process: bool = False
    needs_gpu: bool = False
    probe: str | None = None
    requires: str = ""
    exit_directly: bool = False
    detects_peer_loss: bool = True

    def unavailable(self) -> str | None:
        """Why this engine cannot run on this machine, or None when it can."""
        if self.probe is None or _load(self.probe)():
            return None
        return f"{self.name!r} needs {self.requires or 'what this machine lacks'}"

    def open_fabric(self, world: int, *, slot_bytes: int, lanes: int = 1):
        """Every rank of an in-process engine: its fabric (``endpoints``, ``endpoint(rank)``,
        ``kill(rank)``)."""
        if not self.in_process:
            raise ValueError(
                f"transport: {self.name!r} runs one rank per process; build this rank's "
                "endpoint with connect(name, rank, world, store, ...)"
            )
        return _load(self.factory)(world, slot_bytes, lanes=lanes)

    def connect(
        self,
        rank: int,
        world: int,
        store,
        *,
        slot_bytes: int,
        lanes: int = 1,
        device=None,
        **options,
    ):
        """This rank's endpoint of a cross-process engine, meeting the others on ``store``
        (a ``torch.distributed`` store). ``device``: the CUDA device of an engine that needs a
        GPU (None: the current one); host engines ignore it. ``options``: the engine's own
        keywords (e.g. gloo's ``idle_timeout_s``, ``host``)."""
        if self.in_process:
            raise ValueError(
                f"transport: {self.name!r} runs every rank in this process; build its ranks "
                "with open_fabric(name, world, ...)"
            )
        if self.needs_gpu:
            options["device"] = device
        return _load(self.factory)(
            rank, world, store, slot_bytes=slot_bytes, lanes=lanes, **options
        )


ENGINES: Mapping[str, Engine] = types.MappingProxyType(
    {
        e.name: e
        for e in (
            Engine(
                name="loopback",
                summary="threads of one process (tests, the single-process demo)",
                factory="mqnc.transport.loopback:LoopbackFabric",
                in_process=True,
            ),
            Engine(
                name="gloo",
                summary="processes over torch.distributed gloo (CPU, any machine)",
                factory="mqnc.transport.torchdist:TorchDistTransport",
                probe="mqnc.transport.torchdist:gloo_available",
                requires="a torch build with the gloo backend",
                exit_directly=True,
            ),
            Engine(
                name="nvshmem",
                summary="NVSHMEM PEs, one-sided puts on the GPU (nvshmem4py)",
                factory="mqnc.transport.nvshmem:NvshmemTransport",
                needs_gpu=True,
                probe="mqnc.transport.nvshmem:nvshmem_available",
                requires="a CUDA device and nvshmem4py (pip install 'mqnc[gpu]')",
                detects_peer_loss=False,
            ),
        )
    }
)
"""Every engine by name, in the order flags list them."""


def names(
    *, in_process: bool | None = None, needs_gpu: bool | None = None, auto: bool = False
) -> tuple[str, ...]:
    """Engine names in registry order, those whose ``in_process`` and ``needs_gpu`` match
    where given (None: either); ``auto=True`` puts the service's policy :data:`AUTO` first.

    ``names()``: every engine; ``names(in_process=False)``: one rank per process (what a
    service can run); ``names(needs_gpu=False)``: what runs on any machine.
    """
    out = tuple(
        e.name
        for e in ENGINES.values()
        if (in_process is None or e.in_process == in_process)
        and (needs_gpu is None or e.needs_gpu == needs_gpu)
    )
    return (AUTO, *out) if auto else out


def engine(name: object, *, argument: str = "transport") -> Engine:
    """The entry of engine ``name``; a ``ValueError`` naming ``argument`` otherwise."""
    found = ENGINES.get(name) if isinstance(name, str) else None
    if found is None:
        raise ValueError(f"{argument}: expected one of {names()}, got {name!r}")
    return found


def unavailable(name: str) -> str | None:
    """Why engine ``name`` cannot run on this machine, or None when it can."""
    return engine(name).unavailable()


def select(choice: str, *, argument: str = "transport") -> str:
    """The engine a service runs for ``choice``: an engine's name is itself; :data:`AUTO` is
    the first engine across processes that runs here, GPU engines first (nvshmem when a CUDA
    device and nvshmem4py are present, else gloo)."""
    if choice != AUTO:
        return engine(choice, argument=argument).name
    across = [e for e in ENGINES.values() if not e.in_process]
    reasons = []
    for e in sorted(across, key=lambda e: not e.needs_gpu):  # stable: registry order within
        why = e.unavailable()
        if why is None:
            return e.name
        reasons.append(why)
    raise RuntimeError(
        f"{argument}: {AUTO!r} found no engine that runs here ({'; '.join(reasons)})"
    )


def describe(choices: tuple[str, ...]) -> str:
    """``"name: summary; ..."`` for ``--help`` (``AUTO`` described as the policy)."""
    return "; ".join(f"{c}: {AUTO_SUMMARY if c == AUTO else engine(c).summary}" for c in choices)


def open_fabric(name: str, world: int, *, slot_bytes: int, lanes: int = 1):
    """Every rank of in-process engine ``name`` (see :meth:`Engine.open_fabric`)."""
    return engine(name).open_fabric(world, slot_bytes=slot_bytes, lanes=lanes)


def connect(name: str, rank: int, world: int, store, *, slot_bytes: int, lanes: int = 1,
            device=None, **options):  # fmt: skip
    """This rank's endpoint of cross-process engine ``name`` (see :meth:`Engine.connect`)."""
    return engine(name).connect(
        rank, world, store, slot_bytes=slot_bytes, lanes=lanes, device=device, **options
    )
