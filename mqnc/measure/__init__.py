"""The measurement harness (§3.2, §4.3, §6): what ``perf/`` and ``mqnc calibrate`` share.

- :mod:`mqnc.measure.echo`: a requester and echo holders on a transport (threads over
  loopback, subprocesses over gloo): the transport term of a primitive, without its compute.
- :mod:`mqnc.measure.holders`: a requester and real holders (kernel stubbed or real) on a
  transport: the package's own host path (``perf/bench_host``, ``mqnc calibrate``).
- :mod:`mqnc.measure.ranks`: holder ranks as child processes over gloo (both sides of standing
  them up, for the two fabrics above).
- :mod:`mqnc.measure.floors`: the machine's floors (a Condition round trip, bare gloo, a
  socketpair) that the host path is measured against.
- :mod:`mqnc.measure.timing`: p20/p50/p80 of repeated calls: kernels by CUDA-graph replay
  over inputs rotated past the L2 (``time_kernel``, each result saying how it was timed),
  host-side work on the host clock (``time_fn``), round-robin over several points.
- :mod:`mqnc.measure.results_file`: the long-format results file (record, read, where it is, the
  git commit of each record).
- :mod:`mqnc.measure.sweep`: the probe + route sweep of Table 1.
- :mod:`mqnc.measure.calibrate`: this machine's fabric profile (``mqnc calibrate``;
  ``from mqnc.measure.calibrate import calibrate``).
- :mod:`mqnc.measure.options`: the command-line options every benchmark takes (one parser),
  and the option types the ``mqnc`` command shares with them.
- :mod:`mqnc.measure.targets`: speed targets as data, checked against a run's records.
- :mod:`mqnc.measure.kernel_report`: the kernels' static sm_90 report at the goal shapes
  (predictions; ``mqnc kernel-report``, ``python -m mqnc.measure.kernel_report``).

The torch-free modules (results, options, targets) are imported with the package; the others, and
the names they define, on first use, so that the figures can read records without torch.
"""

from mqnc.base.lazy import lazy_exports, public_names
from mqnc.measure.options import (
    TRANSPORTS,
    bench_parser,
    finish,
    hidden_alias,
    int_list,
    model_arg,
    nonnegative_int_list,
    parse_bench_args,
    positive_int,
    transport_list,
)
from mqnc.measure.results_file import git_commit, output_path, read_results, record, results_path
from mqnc.measure.targets import Target, check_targets

_LAZY = {
    **dict.fromkeys(public_names(__name__, ".echo", exclude=("TRANSPORTS",)), ".echo"),
    **dict.fromkeys(public_names(__name__, ".timing"), ".timing"),
    **dict.fromkeys(public_names(__name__, ".sweep"), ".sweep"),
    "exit_process": ".ranks",
}
__getattr__ = lazy_exports(__name__, _LAZY)

__all__ = [
    "TRANSPORTS",
    "bench_parser",
    "parse_bench_args",
    "finish",
    "int_list",
    "nonnegative_int_list",
    "positive_int",
    "model_arg",
    "hidden_alias",
    "transport_list",
    "Target",
    "check_targets",
    "git_commit",
    "output_path",
    "read_results",
    "record",
    "results_path",
    *_LAZY,
]
