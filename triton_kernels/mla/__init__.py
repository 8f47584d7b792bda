"""Partial absorbed-MLA attention (§3.3, §6.3), dense paged and sparse top-k, with its backends:

- ``decode`` / ``sparse``: the portable ``tl`` kernels and the public ops (any device Triton
  runs on, the interpreter included); ``tile``: their shared device-side tile loop; ``plan``:
  their shared host side (tile choice, operand checks, split-KV outputs, plans);
- ``gluon`` / ``gluon_kernels``: the Hopper (sm_90) Gluon kernels and their launcher.

The public functions are re-exported by :mod:`mqnc.triton_kernels`."""
