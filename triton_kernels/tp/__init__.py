"""A tensor-parallel holder rank's share of the attention (§8): ``scores`` (partial scores over
the rank's column slice) and ``values`` (softmax times the rank's value slice, given the
group's summed scores)."""
