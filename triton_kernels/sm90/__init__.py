"""sm_90 without a GPU: launch-exact compiles of every production launch (``compile``), the
production shapes and the launches they make (``variants``) and the generated occupancy table
the split policy reads off a GPU (``table``). Imports nothing itself: ``_core.grid`` reads the
table without pulling in the compiler."""
