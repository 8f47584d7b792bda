"""mqnc: move the query, not the cache.

Triton kernels, transport and cost model for cross-instance latent (MLA) and sparse attention,
after Ma et al., "Move the Query, Not the Cache" (2026). Importing ``mqnc`` never touches a GPU.

Layout, bottom to top: ``mqnc.triton_kernels`` (the kernels), ``mqnc.reference`` (their fp64
references), ``mqnc.geometry`` (model dims and byte sizes), ``mqnc.testing`` (the comparison
helper), ``mqnc.cli`` (the ``mqnc`` command).
"""

__version__ = "0.1.0"
