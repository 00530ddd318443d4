"""Learning from preferences: the objectives that make a chosen answer more likely than a rejected one.

A preference pair is a prompt x, a chosen answer y_w and a rejected one y_l. Each objective below is a loss on the
log-probabilities of the two answers given the prompt, log π(y|x) = Σ_t log π(y_t | x, y_<t) over the answer's
tokens, under the model being trained (the *policy* π) and, for the first three, under a frozen *reference* π_ref
(the model before this training: with LoRA, the same model with its adapters switched off). With

    h = [log π(y_w|x) − log π_ref(y_w|x)] − [log π(y_l|x) − log π_ref(y_l|x)]

the implicit reward of an answer is r(y) = β (log π(y|x) − log π_ref(y|x)), and

=======  =================================================================  ==========================================
dpo      −log σ(β h)                                                        trl ``DPOConfig(loss_type="sigmoid")``
         (Rafailov et al. 2023, "Direct Preference Optimization", eq. 7)
ipo      (h̄ − 1/(2β))², h̄ the same difference with each answer's log-       ``DPOConfig(loss_type="ipo")``
         probabilities averaged over its tokens (Azar et al. 2023, eq. 17;
         the averaging is trl's, confirmed by the authors)
hinge    max(0, 1 − β h)  (SLiC, Zhao et al. 2023; RSO, Liu et al. 2023)    ``DPOConfig(loss_type="hinge")``
simpo    −log σ(β (ā_w − ā_l) − γ), ā = log π(y|x) / |y| the average per    trl's ``CPOConfig(loss_type="simpo",
         token; no reference (Meng et al. 2024, "SimPO", eq. 6)              cpo_alpha=0)``, ``simpo_gamma`` = γ
orpo     NLL(y_w) − β log σ(log odds(y_w) − log odds(y_l)), odds(y) =        trl's ``ORPOConfig`` (``beta`` = λ)
         p/(1 − p) of p = exp(ā), the NLL the chosen answers' mean cross-
         entropy per token; no reference (Hong et al. 2024, "ORPO", eq. 6-7)
=======  =================================================================  ==========================================

The rewards a run logs are trl's: β (log π − log π_ref) of each answer, summed over its tokens (the reference-free
objectives: β times the policy's average log-probability), their difference (the margin), and how often the
chosen answer's reward is the larger (the accuracy).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where a loss is computed: the command line's --help reads OBJECTIVES alone
    from torch import Tensor

OBJECTIVES = ("dpo", "ipo", "hinge", "simpo", "orpo")
REFERENCE_FREE = ("simpo", "orpo")  # no reference model: nothing to switch off, copy or precompute
AVERAGED = ("ipo", "simpo", "orpo")  # the answers' log-probabilities averaged over their tokens


@dataclass
class Answers:
    """The log-probabilities of a batch's pairs ``(P,)`` each: summed over each answer's tokens, and the answers'
    token counts."""

    chosen: Tensor
    rejected: Tensor
    chosen_tokens: Tensor
    rejected_tokens: Tensor

    def averaged(self) -> tuple[Tensor, Tensor]:
        """The average log-probability per token of the chosen and the rejected answers."""
        return self.chosen / self.chosen_tokens.clamp(min=1), self.rejected / self.rejected_tokens.clamp(min=1)


@dataclass
class PairLosses:
    """Each pair's loss ``(P,)`` and the rewards trl logs ``(P,)``; ``nll``: ORPO's mean cross-entropy per token of
    the chosen answers (a scalar added once to the batch's mean loss), else None."""

    losses: Tensor
    chosen_rewards: Tensor
    rejected_rewards: Tensor
    nll: Tensor | None = None

    def metrics(self) -> dict[str, Tensor]:
        """Sums over the pairs (divided by the pairs' number later, over every batch of a step or an evaluation):
        trl's names."""
        chosen, rejected = self.chosen_rewards.detach(), self.rejected_rewards.detach()
        return {"rewards/chosen": chosen.sum(), "rewards/rejected": rejected.sum(),
                "rewards/accuracies": (chosen > rejected).float().sum(), "rewards/margins": (chosen - rejected).sum()}


def pair_losses(objective: str, policy: Answers, reference: Answers | None, *, beta: float, gamma: float = 0.5,
                chosen_nll: Tensor | None = None) -> PairLosses:
    """The loss of each pair under ``objective`` (see the module's table), from the policy's log-probabilities and,
    unless the objective is reference-free, the reference's. ``gamma``: SimPO's target margin γ; ``chosen_nll``:
    ORPO's mean cross-entropy per token of the chosen answers.

    Raises:
        ValueError: an unknown objective, a reference missing (or given to a reference-free objective), or ORPO
            without ``chosen_nll``.
    """
    import torch.nn.functional as F

    if objective not in OBJECTIVES:
        raise ValueError(f"the objective must be one of {', '.join(OBJECTIVES)}, got {objective!r}")
    if (reference is None) != (objective in REFERENCE_FREE):
        raise ValueError(f"{objective} {'takes no' if objective in REFERENCE_FREE else 'needs a'} reference model's "
                         "log-probabilities")
    if objective in REFERENCE_FREE:
        chosen, rejected = policy.averaged()
        rewards = beta * chosen.detach(), beta * rejected.detach()
        if objective == "simpo":
            return PairLosses(-F.logsigmoid(beta * (chosen - rejected) - gamma), *rewards)
        if chosen_nll is None:
            raise ValueError("orpo needs the chosen answers' cross-entropy (chosen_nll)")
        log_odds = (chosen - rejected) - (_log1mexp(chosen) - _log1mexp(rejected))
        return PairLosses(-beta * F.logsigmoid(log_odds), *rewards, nll=chosen_nll)
    chosen_ratio, rejected_ratio = policy.chosen - reference.chosen, policy.rejected - reference.rejected
    rewards = beta * chosen_ratio.detach(), beta * rejected_ratio.detach()
    if objective == "dpo":
        return PairLosses(-F.logsigmoid(beta * (chosen_ratio - rejected_ratio)), *rewards)
    if objective == "hinge":
        return PairLosses((1 - beta * (chosen_ratio - rejected_ratio)).clamp(min=0), *rewards)
    averaged = (chosen_ratio / policy.chosen_tokens.clamp(min=1)
                - rejected_ratio / policy.rejected_tokens.clamp(min=1))
    return PairLosses((averaged - 1 / (2 * beta)) ** 2, *rewards)  # ipo


def _log1mexp(x: Tensor) -> Tensor:
    """log(1 − eˣ) for x < 0, accurate on both sides of −log 2 (Mächler 2012)."""
    x = x.clamp(max=-1e-7)
    return x.expm1().neg().log().where(x > -math.log(2), x.exp().neg().log1p())


__all__ = ["AVERAGED", "OBJECTIVES", "REFERENCE_FREE", "Answers", "PairLosses", "pair_losses"]
