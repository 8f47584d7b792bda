"""The cost layer (§4, §5): fabric profiles, every term of the cost model, its fit to
measurements, one machine's profile, and the closed-form route / fetch / local predicate.

- :mod:`mqnc.cost.fabric`: :class:`FabricProfile`, the paper's Table 2 fabrics, JSON load/save.
- :mod:`mqnc.cost.terms`: one function per term of §4 (route, fetch, local; congestion, host
  overhead, TP pairing), on floats or numpy grids.
- :mod:`mqnc.cost.fitting`: constants from measured round trips (:func:`fit`, §4.3), the
  holder's knee (§6.3), MAPE.
- :mod:`mqnc.cost.results_reader`: the results-file reader (:func:`read_jsonl`,
  :func:`check_record`).
- :mod:`mqnc.cost.calibration_fits`: :func:`fit_route`, the one way every calibration turns its
  measured probes and round trips into the fabric's route terms.
- :mod:`mqnc.cost.profile`: :class:`MachineProfile` (the fabric and the compute terms of one
  machine; one versioned JSON schema that every calibration writes) and :class:`Request` (one
  (chunk, request) to decide): the predicate's two inputs.
- :mod:`mqnc.cost.predicate`: :func:`decide` (argmin per (chunk, request), §5), the grids of
  Fig. 3(b) / 6(a), and the paper's closed forms.

Every public name of each is re-exported here (``from mqnc.cost import decide, fit``).
Pure Python + numpy: importing it loads neither torch nor triton (a test checks).
"""

from mqnc.cost import calibration_fits, fabric, fitting, predicate, profile, results_reader, terms
from mqnc.cost.calibration_fits import *  # noqa: F403 - re-exports, as listed in each module's __all__
from mqnc.cost.fabric import *  # noqa: F403
from mqnc.cost.fitting import *  # noqa: F403
from mqnc.cost.predicate import *  # noqa: F403
from mqnc.cost.profile import *  # noqa: F403
from mqnc.cost.results_reader import *  # noqa: F403
from mqnc.cost.terms import *  # noqa: F403

__all__ = [
    "calibration_fits",
    "fabric",
    "fitting",
    "predicate",
    "profile",
    "results_reader",
    "terms",
    *calibration_fits.__all__,
    *fabric.__all__,
    *fitting.__all__,
    *predicate.__all__,
    *profile.__all__,
    *results_reader.__all__,
    *terms.__all__,
]
