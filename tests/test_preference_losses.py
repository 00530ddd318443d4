"""The preference objectives (qkv.preference): each the formula of its paper on given log-probabilities, pair by pair
in plain Python, and trl's own where trl is installed."""

import math
from types import SimpleNamespace

import pytest
import torch

from qkv.preference import OBJECTIVES, REFERENCE_FREE, Answers, pair_losses

BETA, GAMMA = 0.3, 0.7


def _answers(seed: int) -> Answers:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, 9, (2, 5), generator=g).double()
    logps = -torch.rand(2, 5, generator=g, dtype=torch.float64) * tokens * 3  # a few nats a token
    return Answers(logps[0], logps[1], tokens[0], tokens[1])


def _sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def _paper(objective: str, p: Answers, r: Answers, i: int) -> float:
    """Pair i's loss, written from each paper's equation."""
    pw, pl, rw, rl = float(p.chosen[i]), float(p.rejected[i]), float(r.chosen[i]), float(r.rejected[i])
    nw, nl = float(p.chosen_tokens[i]), float(p.rejected_tokens[i])
    h = (pw - rw) - (pl - rl)
    if objective == "dpo":  # Rafailov et al., eq. 7
        return -math.log(_sigmoid(BETA * h))
    if objective == "hinge":  # SLiC's calibration loss with margin 1/β scaled by β
        return max(0.0, 1 - BETA * h)
    if objective == "ipo":  # Azar et al., eq. 17, per-token averages (trl's)
        return ((pw - rw) / nw - (pl - rl) / nl - 1 / (2 * BETA)) ** 2
    if objective == "simpo":  # Meng et al., eq. 6
        return -math.log(_sigmoid(BETA / nw * pw - BETA / nl * pl - GAMMA))
    # ORPO (Hong et al., eq. 6-7): the odds-ratio part; its NLL is added once a batch
    odds = [math.log(math.exp(a) / (1 - math.exp(a))) for a in (pw / nw, pl / nl)]
    return -BETA * math.log(_sigmoid(odds[0] - odds[1]))


@pytest.mark.parametrize("objective", OBJECTIVES)
def test_each_objective_is_its_papers_formula(objective):
    policy, reference = _answers(1), _answers(2)
    out = pair_losses(objective, policy, None if objective in REFERENCE_FREE else reference, beta=BETA, gamma=GAMMA,
                      chosen_nll=torch.tensor(1.5, dtype=torch.float64))
    expected = [_paper(objective, policy, reference, i) for i in range(5)]
    torch.testing.assert_close(out.losses, torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    assert (out.nll is not None) == (objective == "orpo")
    if objective in REFERENCE_FREE:  # trl logs β times the average log-probability
        chosen, rejected = policy.averaged()
    else:  # β times the log-ratio to the reference, summed over the answer
        chosen, rejected = policy.chosen - reference.chosen, policy.rejected - reference.rejected
    torch.testing.assert_close(out.chosen_rewards, BETA * chosen)
    torch.testing.assert_close(out.rejected_rewards, BETA * rejected)
    metrics = out.metrics()
    assert float(metrics["rewards/accuracies"]) == float((chosen > rejected).sum())


def test_the_objectives_start_where_their_papers_say():
    """With the policy equal to the reference, DPO is log 2 a pair, IPO (1/(2β))², hinge 1."""
    same = _answers(3)
    start = {o: pair_losses(o, same, same, beta=BETA).losses for o in ("dpo", "ipo", "hinge")}
    torch.testing.assert_close(start["dpo"], torch.full((5,), math.log(2), dtype=torch.float64))
    torch.testing.assert_close(start["ipo"], torch.full((5,), (1 / (2 * BETA)) ** 2, dtype=torch.float64))
    torch.testing.assert_close(start["hinge"], torch.ones(5, dtype=torch.float64))


def test_a_missing_or_needless_reference_and_an_unknown_objective_are_refused():
    a = _answers(4)
    with pytest.raises(ValueError, match="dpo needs a reference"):
        pair_losses("dpo", a, None, beta=0.1)
    with pytest.raises(ValueError, match="simpo takes no reference"):
        pair_losses("simpo", a, a, beta=0.1)
    with pytest.raises(ValueError, match="one of dpo, ipo"):
        pair_losses("kto", a, a, beta=0.1)


def test_orpo_far_below_minus_log_2_stays_finite():
    """log(1 − p) of an average log-probability near 0 or far below it: no inf, no NaN."""
    a = Answers(torch.tensor([-1e-9, -80.0]), torch.tensor([-50.0, -1e-9]), torch.ones(2), torch.ones(2))
    out = pair_losses("orpo", a, None, beta=0.1, chosen_nll=torch.tensor(1.0))
    assert torch.isfinite(out.losses).all()


def test_the_reference_free_losses_are_trls(monkeypatch):
    """SimPO through trl's CPO trainer's loss, ORPO's odds ratio through trl's ORPO trainer's (called on their own)."""
    pytest.importorskip("trl")
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    from trl.experimental.cpo import CPOTrainer
    from trl.experimental.orpo import ORPOTrainer

    policy = _answers(5)
    chosen, rejected = (x.float() for x in policy.averaged())
    cpo = SimpleNamespace(beta=BETA, loss_type="simpo", simpo_gamma=GAMMA, label_smoothing=0.0, alpha=0.0,
                          accelerator=SimpleNamespace(device="cpu"))
    trl_losses, trl_chosen, trl_rejected = CPOTrainer.cpo_loss(cpo, chosen, rejected)
    ours = pair_losses("simpo", policy, None, beta=BETA, gamma=GAMMA)
    torch.testing.assert_close(ours.losses.float(), trl_losses, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours.chosen_rewards.float(), trl_chosen)
    torch.testing.assert_close(ours.rejected_rewards.float(), trl_rejected)
    orpo = SimpleNamespace(beta=BETA, accelerator=SimpleNamespace(device="cpu"))
    ratio_losses, *_ = ORPOTrainer.odds_ratio_loss(orpo, chosen, rejected)  # trl's loss is nll − its mean
    ours = pair_losses("orpo", policy, None, beta=BETA, chosen_nll=torch.tensor(0.0))
    torch.testing.assert_close(ours.losses.float(), -ratio_losses, rtol=1e-5, atol=1e-6)
