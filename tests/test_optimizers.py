"""Muon and AdamW: which parameters each trains, Muon's step against a hand-written Newton–Schulz, and the pair
behaving as one optimizer."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from qkv import GPT, GPTConfig, Transformer, TransformerConfig
from qkv.config import SwinConfig, ViTConfig
from qkv.models.swin import Swin
from qkv.models.vit import ViT
from qkv.nn import FeedForward
from qkv.optimizers import MUON_MOMENTUM, Muon, build_optimizer, hidden_matrices

MODELS = {
    "gpt": lambda: GPT(GPTConfig(vocab_size=50, d_model=32, n_heads=4, n_layers=2, max_seq_len=16,
                                 tie_embeddings=False)),
    "transformer": lambda: Transformer(TransformerConfig(src_vocab_size=40, tgt_vocab_size=40, d_model=32, n_heads=4,
                                                         n_layers=1, d_ff=64, share_embeddings=True)),
    "vit": lambda: ViT(ViTConfig(image_size=8, patch_size=4, d_model=32, n_heads=4, n_layers=1, d_ff=64)),
    "swin": lambda: Swin(SwinConfig(image_size=16, patch_size=2, d_model=16, depths=(1, 1), stage_heads=(2, 4),
                                    window_size=4)),
}


def newton_schulz(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Muon's orthogonalisation, written out in float64: X ← aX + (bA + cA²)X with A = XXᵀ, on the wide side."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g.double()
    tall = x.shape[0] > x.shape[1]
    x = x.T if tall else x
    x = x / x.norm()
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return (x.T if tall else x).float()


@pytest.mark.parametrize("name", MODELS)
def test_every_parameter_is_in_exactly_one_optimizer(name):
    model = MODELS[name]()
    opt = build_optimizer(model, kind="muon", lr=1e-3)
    muon, adamw = (opt.parts[k].param_groups for k in ("muon", "adamw"))
    in_muon = [id(p) for g in muon for p in g["params"]]
    in_adamw = [id(p) for g in adamw for p in g["params"]]
    assert not set(in_muon) & set(in_adamw)
    assert sorted(in_muon + in_adamw) == sorted(id(p) for p in model.parameters())
    names = {id(p): n for n, p in model.named_parameters()}
    taken = [names[i] for i in in_muon]
    assert taken and all(n.endswith(("_proj.weight", "up.weight", "down.weight", "reduction.weight"))
                         for n in taken), taken
    assert all(p.dim() == 2 for g in muon for p in g["params"])
    left = [names[i] for i in in_adamw]
    assert not any(("_proj.weight" in n or "feed_forward" in n) and n.endswith("weight") for n in left), left


def test_the_output_layer_and_embeddings_stay_with_adamw():
    model = MODELS["gpt"]()
    muon = {id(p) for p in hidden_matrices(model)}
    assert id(model.lm_head.weight) not in muon and id(model.tok_emb.weight) not in muon
    assert len(muon) == 2 * 6  # per layer: q, k, v, out; up, down


def test_muon_step_is_the_orthogonalised_nesterov_momentum():
    """One step from zero momentum: W ← W(1 − lr·λ) − lr·sqrt(max(1, rows/cols))·NS(g + μg), NS in fp32 on a CPU."""
    torch.manual_seed(0)
    ffn = FeedForward(16, 48, activation="relu")
    model = nn.Sequential(ffn)
    lr, decay = 0.05, 0.1
    opt = build_optimizer(model, kind="muon", lr=1e-3, muon_lr=lr, weight_decay=decay)
    for w in (ffn.up.weight, ffn.down.weight):  # tall (48 × 16) and wide (16 × 48)
        w.grad = torch.randn_like(w)
    before = {w: (w.detach().clone(), w.grad.clone()) for w in (ffn.up.weight, ffn.down.weight)}
    opt.step()
    for w, (w0, g) in before.items():
        scale = math.sqrt(max(1, w.shape[0] / w.shape[1]))
        expected = w0 * (1 - lr * decay) - lr * scale * newton_schulz(g * (1 + MUON_MOMENTUM))
        torch.testing.assert_close(w.detach(), expected, atol=lr * scale * 1e-5, rtol=0)
        update = (w0 * (1 - lr * decay) - w.detach()) / (lr * scale)
        singular = torch.linalg.svdvals(update)
        assert singular.min() > 0.5 and singular.max() < 1.3, singular  # orthogonalised: all near 1
        assert not torch.allclose(update, g / g.norm() * singular.mean(), atol=0.05)  # not a plain rescale
    # A second step: momentum B = μ g1 + g2, and the Nesterov step orthogonalises g2 + μ B.
    w, (_, g1) = ffn.up.weight, before[ffn.up.weight]
    w1, g2 = w.detach().clone(), torch.randn_like(w)
    w.grad = g2.clone()
    opt.step()
    expected = w1 * (1 - lr * decay) - lr * 3 ** 0.5 * newton_schulz(g2 + MUON_MOMENTUM * (MUON_MOMENTUM * g1 + g2))
    torch.testing.assert_close(w.detach(), expected, atol=lr * 3 ** 0.5 * 1e-5, rtol=0)


def test_muon_follows_torch_optim_muon():
    """Three steps against PyTorch's own Muon (which orthogonalises in bf16: hence the tolerance), matrices of
    three shapes, orthogonalised in batches here and one by one there."""
    torch.manual_seed(0)
    shapes = [(24, 8), (8, 24), (16, 16), (16, 16)]
    ours = [torch.randn(s, requires_grad=True) for s in shapes]
    theirs = [p.detach().clone().requires_grad_() for p in ours]
    a = Muon(ours, lr=0.02, weight_decay=0.1)
    b = torch.optim.Muon(theirs, lr=0.02, weight_decay=0.1, momentum=MUON_MOMENTUM, adjust_lr_fn="original")
    for _ in range(3):
        for p, q in zip(ours, theirs, strict=True):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        a.step()
        b.step()
    for p, q in zip(ours, theirs, strict=True):
        torch.testing.assert_close(p, q, atol=0.02 * 3 * 0.02 * 3 ** 0.5, rtol=0)  # bf16's 1% of each step
        assert not torch.equal(p, q)  # two implementations, not one


def test_the_pair_saves_and_restores_both_states():
    model = MODELS["gpt"]()
    opt = build_optimizer(model, kind="muon", lr=1e-3)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    state = opt.state_dict()
    again = build_optimizer(model, kind="muon", lr=1e-3)
    again.load_state_dict(state)
    w = model.decoder.layers[0].feed_forward.up.weight
    head = model.lm_head.weight
    assert torch.equal(again.parts["muon"].state[w]["momentum_buffer"], opt.parts["muon"].state[w]["momentum_buffer"])
    assert torch.equal(again.parts["adamw"].state[head]["exp_avg"], opt.parts["adamw"].state[head]["exp_avg"])
    with pytest.raises(ValueError, match="another --optimizer"):
        again.load_state_dict(build_optimizer(model, lr=1e-3).state_dict())
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())


def test_an_unknown_optimizer_and_muon_without_matrices_are_refused():
    with pytest.raises(ValueError, match="optimizer must be one of"):
        build_optimizer(MODELS["gpt"](), kind="sgd", lr=1e-3)
    with pytest.raises(ValueError, match="and LSTM has none; use --optimizer adamw"):
        build_optimizer(nn.LSTM(4, 4), kind="muon", lr=1e-3)


def steps_to_copy(settings: dict, *, limit: int = 250) -> int:
    """Optimizer steps until a small GPT copies 6 random symbols after a separator with a loss under 0.05
    nats on the copied part, trained with ``settings``' optimizer, learning rates, warmup and schedule."""
    from qkv.training import TrainOptions, learning_rate

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=12, d_model=32, n_heads=2, n_layers=2, max_seq_len=16))
    opts = TrainOptions(out="-", max_steps=limit, lr=settings["lr"], warmup=settings["warmup"],
                        schedule=settings["schedule"], min_lr_ratio=0.1)
    opt = build_optimizer(model, kind=settings["optimizer"], lr=opts.lr, muon_lr=settings["muon_lr"],
                          betas=(0.9, 0.95), weight_decay=0.1)
    peaks = [g["lr"] for g in opt.param_groups]
    g = torch.Generator().manual_seed(1)
    for step in range(1, limit + 1):
        symbols = torch.randint(1, 11, (32, 6), generator=g)
        seq = torch.cat([symbols, torch.full((32, 1), 11), symbols], dim=1)
        logits = model(seq[:, :-1])[:, 6:]  # the predictions of the copied symbols
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), seq[:, 7:].reshape(-1))
        if loss.item() < 0.05:
            return step
        loss.backward()
        lr = learning_rate(step, opts, limit)
        for group, peak in zip(opt.param_groups, peaks, strict=True):
            group["lr"] = lr * peak / opts.lr
        opt.step()
        opt.zero_grad()
    return limit + 1


def test_the_speedrun_recipe_learns_the_copy_task_in_fewer_steps():
    """`qkv train lm`'s speedrun settings (Muon, its rates, warmup, wsd) against its classic ones (AdamW, cosine),
    on the same model and data: measured 102 steps, where the classic ones are still above the bound after 250
    (and after 400)."""
    from dataclasses import asdict

    from qkv.recipes.language_model import CLASSIC, LMSettings

    speedrun = asdict(LMSettings())
    classic = {**speedrun, **CLASSIC}
    fast, slow = steps_to_copy(speedrun), steps_to_copy(classic)
    assert fast <= 0.6 * slow, (fast, slow)
