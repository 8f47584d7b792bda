"""Bridges from other people's models to mqnc's holders (route / fetch / local, §2.1).

- :mod:`mqnc.integrations.hf`: Hugging Face transformers DeepSeek-V2 / V3 causal LMs decode
  with their shared context's latent cache on holders, through ``model.generate`` (the design;
  the public names). Its parts: :mod:`~mqnc.integrations.hf_model` (models, the context's
  prefill), :mod:`~mqnc.integrations.hf_session` (the attention hook and the session),
  :mod:`~mqnc.integrations.hf_predicate` (calibration, route / fetch / local per chunk),
  :mod:`~mqnc.integrations.hf_serve` (``mqnc serve --generate``'s requester job).
- :mod:`mqnc.integrations.hf_v32`: a DeepSeek-V3.2 (DSA) model: its indexer's top-k selection
  of every query token routed to the holders of the selected entries (bf16 or FP8 cache).
- :mod:`mqnc.integrations.hf_exactness`: how close such a run is to transformers' own
  ``generate`` on the whole prompt (tokens, logits, the derived bound).

``mqnc demo --hf`` is :mod:`mqnc.demo.hf_demo`; ``mqnc corpus`` and ``mqnc serve`` are
:mod:`mqnc.cli.cmd_corpus` and :mod:`mqnc.cli.cmd_serve`. This layer sits above serving and beside
:mod:`mqnc.measure` (layer 5), so that the demo layer can use it. Nothing here imports
transformers at import time.
"""
