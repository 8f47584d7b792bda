"""How close a generation over holders is to transformers' own ``generate`` on the whole prompt.

The reference is code nobody here wrote: the same model (same weights, same dtype, its own
attention) generating from ``context + prompt`` in one instance. :func:`check_generation`
compares a run of :mod:`mqnc.integrations.hf` with it, step by step:

- **tokens** must be equal at every step, except at a step where transformers' own two best
  logits are within twice the logit bound of each other (a tie at this precision: no
  implementation of the same arithmetic can be expected to break it the same way; bf16 meets
  such ties, fp32 practically never). A free run's comparison ends at its first difference
  (the sequences part there); a **forced** run (:meth:`HFReference.forcing`: the run is made to
  continue with transformers' tokens, its own raw logits recorded) is compared at every step,
  its greedy choice being the argmax of its logits.
- **logits** at every compared step must agree within a bound derived from transformers' own
  arithmetic, in max-abs and in RMS relative to the reference's RMS:

      bound = rho * (E + S)

  ``E`` is the distance of transformers' own run from exact arithmetic: its logits against the
  same model in float64 teacher-forced on the same tokens. ``S`` is transformers' own
  shift noise, nonzero only when the run places the context at another offset than where it was
  prefilled: RoPE scores depend only on relative positions in exact arithmetic, but
  transformers forms angles ``p * inv_freq`` in fp32 (cos/sin rounded to the model's dtype), so
  the same tokens placed ``delta`` positions later give slightly different logits; ``S`` is that
  difference, measured on transformers' own forward (the same sequence at positions ``0..`` and
  ``delta..``). ``rho`` is :data:`mqnc.testing.TOLERANCES` ``("hf_logits", dtype)``: the
  absorbed path rounds no more often per layer than transformers' expanded one (see the reason
  there), so its own distance from exact arithmetic is at most ``rho - 1`` times transformers',
  and by the triangle inequality the two runs differ by at most ``rho`` times it.
"""

from __future__ import annotations

import copy
import dataclasses

import torch

from mqnc.base.checks import check_int
from mqnc.integrations.hf_model import ATTN_IMPLEMENTATION, check_prompt_ids
from mqnc.testing import tolerance

__all__ = ["Exactness", "HFReference", "check_generation"]


@dataclasses.dataclass(frozen=True)
class Exactness:
    """The outcome of :meth:`HFReference.check` (logit errors in the logits' own units)."""

    steps: int
    compared_steps: int
    mismatches: tuple[int, ...]
    tie_margins: tuple[float, ...]
    forced: bool
    max_abs: float
    rms_rel: float
    bound_max: float
    bound_rms: float
    hf_error_max: float
    hf_error_rms: float
    shift_max: float
    shift_rms: float
    dtype: str

    @property
    def tokens_equal(self) -> bool:
        return not self.mismatches

    @property
    def ok(self) -> bool:
        ties = all(m <= 2 * self.bound_max for m in self.tie_margins)
        return self.max_abs <= self.bound_max and self.rms_rel <= self.bound_rms and ties

    def line(self) -> str:
        """One line for a report."""
        run = "forced onto transformers' tokens, greedy choice" if self.forced else "tokens"
        if self.tokens_equal:
            toks = f"{run}: {self.steps}/{self.steps} equal to transformers' generate"
        else:
            toks = (
                f"{run}: differ at steps {list(self.mismatches)}, ties (transformers' top-2 "
                f"margins {', '.join(f'{m:.2e}' for m in self.tie_margins)} vs 2 x bound)"
            )
        return (
            f"{toks}; logits ({self.dtype}) over {self.compared_steps} steps: max |diff| "
            f"{self.max_abs:.2e} (bound {self.bound_max:.2e}), RMS rel {self.rms_rel:.2e} "
            f"(bound {self.bound_rms:.2e}); transformers' own error vs fp64 {self.hf_error_max:.2e}"
            + (f", its shift noise {self.shift_max:.2e}" if self.shift_max else "")
            + (" -- OK" if self.ok else " -- FAILED")
        )


def _forced_logits(model, sequences: torch.Tensor, first: int, n: int, start: int) -> torch.Tensor:
    """Teacher-forced logits ``[n, B, V]`` float64 of the positions that predicted the tokens
    ``first .. first + n - 1`` of ``sequences``, the sequence placed at positions ``start ..``."""
    seq = sequences[:, : first + n - 1]
    pos = torch.arange(start, start + seq.shape[1], device=seq.device)[None]
    with torch.no_grad():
        out = model(seq, position_ids=pos.expand(seq.shape[0], -1), use_cache=False)
    return out.logits[:, first - 1 :].double().transpose(0, 1)


def _err(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    d = (a.double() - b.double()).abs()
    rms_b = float(b.double().pow(2).mean().sqrt())
    return float(d.max()), float(d.pow(2).mean().sqrt()) / rms_b


def _check_detached(model) -> None:
    if model.config._attn_implementation == ATTN_IMPLEMENTATION:
        raise ValueError(
            "model: attached to an mqnc session; the reference is the model's own attention "
            "(check after the session closes)"
        )


class HFReference:
    """transformers' own greedy ``generate`` on ``context + prompt``, and its own error.

    Parameters
    ----------
    model : DeepseekV2ForCausalLM or DeepseekV3ForCausalLM
        The model with its own attention (not attached to a session).
    context_ids : ``[C]`` the shared context; prompt_ids : ``[B, S]`` the prompts.
    max_new_tokens : int
        ``N`` generated tokens.
    position : int
        Where the context was prefilled (the reference places it there).

    Attributes
    ----------
    output : GenerateOutput
        ``sequences [B, C + S + N]`` and ``logits`` (``N`` raw ``[B, V]``).
    hf_error : (float, float)
        ``E``: max-abs and RMS-relative distance of its logits from the float64 model's
        (teacher-forced on the same tokens, float64 weights and activations).
    """

    def __init__(self, model, context_ids, prompt_ids, *, max_new_tokens: int, position: int = 0):
        _check_detached(model)
        self.model = model
        self.position = check_int("position", position, minimum=0)
        check_prompt_ids(prompt_ids, "prompt_ids")
        self.prompt_len = int(prompt_ids.shape[1])
        ctx = torch.as_tensor(context_ids).reshape(1, -1).to(prompt_ids.device)
        full = torch.cat([ctx.expand(prompt_ids.shape[0], -1), prompt_ids], dim=1)
        self.full_len = int(full.shape[1])
        pos = torch.arange(self.position, self.position + full.shape[1], device=full.device)[None]
        with torch.no_grad():
            self.output = model.generate(
                full,
                position_ids=pos.expand(full.shape[0], -1),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
            )
        self.tokens = self.output.sequences[:, self.full_len :]
        self.logits = torch.stack([x.double() for x in self.output.logits])  # [N, B, V]
        exact_model = copy.deepcopy(model).double()
        exact_model.set_experts_implementation("eager")  # grouped_mm has no float64 kernel
        n = self.tokens.shape[1]
        exact = _forced_logits(exact_model, self.output.sequences, self.full_len, n, self.position)
        del exact_model
        self.hf_error = _err(self.logits, exact)
        self._shifts: dict[int, tuple[float, float]] = {}

    def shift_noise(self, delta: int) -> tuple[float, float]:
        """``S``: transformers' own change of these logits (teacher-forced) when the whole
        sequence sits ``delta`` positions later; (0, 0) for ``delta = 0``."""
        if not delta:
            return 0.0, 0.0
        if delta not in self._shifts:
            _check_detached(self.model)
            seq, n, p = self.output.sequences, self.tokens.shape[1], self.position
            base = _forced_logits(self.model, seq, self.full_len, n, p)
            shifted = _forced_logits(self.model, seq, self.full_len, n, p + delta)
            self._shifts[delta] = _err(shifted, base)
        return self._shifts[delta]

    def forcing(self):
        """A ``LogitsProcessorList`` for a run's ``generate(..., logits_processor=...)`` that
        makes it continue with this reference's tokens (its raw logits stay its own)."""
        from transformers import LogitsProcessor, LogitsProcessorList

        tokens, start = self.tokens, self.prompt_len

        class _Force(LogitsProcessor):
            def __call__(self, input_ids, scores):
                step = input_ids.shape[1] - start
                keep = tokens[:, step].to(scores.device)
                out = torch.full_like(scores, float("-inf"))
                return out.scatter(1, keep[:, None], scores.gather(1, keep[:, None]))

        return LogitsProcessorList([_Force()])

    def check(self, sequences: torch.Tensor, logits, *, offset: int | None = None, forced=False):
        """Compare a run (``sequences [B, S + N]``, ``N`` raw ``logits [B, V]``) that placed
        the context at ``offset`` (default: where it was prefilled); ``forced``: the run was made
        to follow this reference's tokens (:meth:`forcing`). Returns :class:`Exactness`."""
        n = self.tokens.shape[1]
        ours_logits = torch.stack([x.double() for x in logits])
        if ours_logits.shape != self.logits.shape:
            raise ValueError(
                f"logits: expected {n} steps of {tuple(self.logits.shape[1:])}, got "
                f"{tuple(ours_logits.shape)}"
            )
        if forced:
            ours = ours_logits.argmax(-1).T
            if not torch.equal(sequences[:, self.prompt_len :], self.tokens):
                raise ValueError("sequences: a forced run must continue with the reference tokens")
        else:
            ours = sequences[:, self.prompt_len :]
        if ours.shape != self.tokens.shape:
            raise ValueError(
                f"sequences: expected {tuple(self.tokens.shape)} generated tokens, got "
                f"{tuple(ours.shape)}"
            )
        differ = (ours != self.tokens).any(dim=0).nonzero().flatten().tolist()
        compared = n if forced or not differ else differ[0] + 1
        mismatches = tuple(s for s in differ if s < compared)
        margins = []
        for s in mismatches:
            b = int((ours[:, s] != self.tokens[:, s]).nonzero()[0])
            step = self.logits[s, b]
            margins.append(float(step[self.tokens[b, s]] - step[ours[b, s]]))
        e_max, e_rms = self.hf_error
        delta = 0 if offset is None else check_int("offset", offset, minimum=0) - self.position
        s_max, s_rms = self.shift_noise(delta)
        rho = tolerance("hf_logits", str(self.model.dtype).replace("torch.", ""))
        max_abs, rms_rel = _err(ours_logits[:compared], self.logits[:compared])
        return Exactness(
            steps=n,
            compared_steps=compared,
            mismatches=mismatches,
            tie_margins=tuple(margins),
            forced=bool(forced),
            max_abs=max_abs,
            rms_rel=rms_rel,
            bound_max=rho.atol * (e_max + s_max),
            bound_rms=rho.rms_rtol * (e_rms + s_rms),
            hf_error_max=e_max,
            hf_error_rms=e_rms,
            shift_max=s_max,
            shift_rms=s_rms,
            dtype=str(self.model.dtype).replace("torch.", ""),
        )


def check_generation(
    model, context_ids, prompt_ids, sequences, logits, *, position=0, offset=None
) -> Exactness:
    """One-shot :class:`HFReference` (greedy, ``len(logits)`` tokens) and its check."""
    ref = HFReference(model, context_ids, prompt_ids, max_new_tokens=len(logits), position=position)
    return ref.check(sequences, logits, offset=offset)
