"""The host machinery every kernel family shares (private): the op registry (``op``), argument
checks (``validate``), the interpreter mode, launch lock and poisoned outputs (``execution``), the
store-side rounding (``numerics``), a launch as data (``launch``) and the split / grid policy
(``grid``). Nothing here is an op; nothing here imports a kernel family."""
