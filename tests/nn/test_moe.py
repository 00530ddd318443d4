"""The mixture of experts: the grouped dispatch equals every expert run on every token and masked, does k experts'
work per token (one token reads k experts, no more), equals transformers' Mixtral and Qwen2-MoE blocks on the same
weights, and its balancing loss is transformers'; bad sizes are one line before anything is built."""

from __future__ import annotations

import pytest
import torch

from qkv.nn.moe import MoEFeedForward, Router, balancing_loss, router_z_loss

transformers = pytest.importorskip("transformers")


def dense_reference(moe: MoEFeedForward, x: torch.Tensor) -> torch.Tensor:
    """The same mixture written the slow way: every expert on every token, the unchosen ones weighted 0 (what the
    grouped dispatch must equal)."""
    tokens = x.reshape(-1, x.size(-1))
    weights, experts, _ = moe.router(tokens)
    full = torch.zeros(tokens.size(0), moe.n_experts, dtype=weights.dtype, device=x.device)
    full.scatter_(1, experts, weights)  # (N, E): each token's weight for each expert
    out = sum(full[:, e, None] * expert(tokens) for e, expert in enumerate(moe.experts))
    if moe.shared is not None:
        out = out + torch.sigmoid(moe.shared_gate(tokens)) * moe.shared(tokens)
    return out.reshape(x.shape)


def _moe(seed: int = 0, **options) -> MoEFeedForward:
    torch.manual_seed(seed)
    moe = MoEFeedForward(16, 24, **{"n_experts": 6, "top_k": 2, **options}).eval()
    with torch.no_grad():  # a router far from uniform, so that the top k are well apart
        moe.router.proj.weight.mul_(8.0)
    return moe


@pytest.mark.parametrize("options", [{}, {"normalize": False}, {"shared_d_ff": 20}, {"top_k": 1}, {"top_k": 6}],
                         ids=["renormalised", "as-softmax", "shared-expert", "top-1", "every-expert"])
def test_the_grouped_dispatch_equals_every_expert_masked(options):
    moe = _moe(**options)
    x = torch.randn(3, 7, 16, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        one = x[:1, :1]  # one token, as in decoding: its own path
        torch.testing.assert_close(moe(one), dense_reference(moe, one), atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(moe(x), dense_reference(moe, x), atol=1e-6, rtol=1e-6)
    assert moe.router_logits.shape == (21, 6) and moe.routed.shape == (21, moe.top_k)


def test_each_token_costs_k_experts_and_one_token_reads_k_experts_only():
    moe = _moe(n_experts=8, top_k=2)
    rows: list[int] = []
    for e, expert in enumerate(moe.experts):
        expert.register_forward_hook(lambda module, args, out, e=e: rows.append((e, args[0].size(0))))
    with torch.no_grad():
        moe(torch.randn(1, 10, 16))
        assert sum(n for _, n in rows) == 10 * 2  # k expert rows a token, whichever experts
        rows.clear()
        moe(torch.randn(1, 1, 16))  # one token, as in decoding
    assert len(rows) == 2 and {e for e, _ in rows} == set(moe.routed[0].tolist())


def test_gradients_reach_the_router_through_the_routing_weights():
    moe = _moe().train()
    moe(torch.randn(2, 5, 16)).square().sum().backward()
    assert moe.router.proj.weight.grad.abs().sum() > 0
    assert all(e.down.weight.grad is None or e.down.weight.grad.abs().sum() > 0 for e in moe.experts)


def _copy_into(moe: MoEFeedForward, block) -> None:
    """transformers' block's weights into qkv's: its stacked [gate; up] and down matrices, expert by expert."""
    with torch.no_grad():
        moe.router.proj.weight.copy_(block.gate.weight)
        d_ff = moe.experts[0].up.out_features
        for e, expert in enumerate(moe.experts):
            expert.gate.weight.copy_(block.experts.gate_up_proj[e, :d_ff])
            expert.up.weight.copy_(block.experts.gate_up_proj[e, d_ff:])
            expert.down.weight.copy_(block.experts.down_proj[e])
        if moe.shared is not None:
            for name in ("gate", "up", "down"):
                getattr(moe.shared, name).weight.copy_(getattr(block.shared_expert, f"{name}_proj").weight)
            moe.shared_gate.weight.copy_(block.shared_expert_gate.weight)


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_transformers_blocks_compute_the_same(family):
    """Mixtral (top 2 of 6, renormalised) and Qwen2-MoE (top 2 of 6 as the softmax gave them, and a shared expert
    behind a sigmoid gate) on the same weights."""
    sizes = dict(hidden_size=16, intermediate_size=24, num_attention_heads=2, num_hidden_layers=1)
    torch.manual_seed(0)
    if family == "mixtral":
        config = transformers.MixtralConfig(**sizes, num_local_experts=6, num_experts_per_tok=2)
        block = transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock(config)
        moe = MoEFeedForward(16, 24, 6, 2)
    else:
        config = transformers.Qwen2MoeConfig(**sizes, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=24,
                                             shared_expert_intermediate_size=20, norm_topk_prob=False)
        block = transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock(config)
        moe = MoEFeedForward(16, 24, 6, 2, normalize=False, shared_d_ff=20)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.5)
    _copy_into(moe, block)
    x = torch.randn(2, 9, 16, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(moe.eval()(x), block.eval()(x), atol=1e-5, rtol=1e-5)


def test_the_balancing_loss_is_transformers_and_the_z_loss_its_formula():
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    logits = [torch.randn(12, 8, generator=torch.Generator().manual_seed(i)) * 3 for i in range(3)]
    ours = balancing_loss(logits, top_k=2)
    torch.testing.assert_close(ours, load_balancing_loss_func(tuple(logits), num_experts=8, top_k=2))
    even = torch.zeros(16, 4)
    even[torch.arange(16), torch.arange(16) % 4] = 5.0  # each expert the first choice of a quarter of the tokens
    assert balancing_loss([even], top_k=1) == pytest.approx(1.0, abs=1e-4)  # even use: its least, 1 per rank
    torch.testing.assert_close(router_z_loss(logits), torch.cat(logits).logsumexp(-1).pow(2).mean())


@pytest.mark.parametrize(("experts", "top_k", "message"), [
    (4, 5, "top_k=5 routes each token to more experts than there are"),
    (0, 1, "n_experts must be an int >= 1, got 0"),
    (4, 0, "top_k must be an int >= 1, got 0"),
])
def test_impossible_routings_are_refused_in_one_line(experts, top_k, message):
    with pytest.raises(ValueError, match=message):
        Router(16, experts, top_k)
