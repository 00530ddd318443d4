"""A mixture of experts' decoding step in two calls of qkv's kernel (``qkv.nn.moe.picked_step``): the same numbers as
its k experts run one by one, in a layer and through a whole greedy decode; float or adapted experts keep the
layer's own path."""

from __future__ import annotations

import pytest
import torch

from qkv import GPT, GPTConfig, kernels
from qkv.nn.moe import MoEFeedForward
from qkv.quantize import quantize

pytestmark = pytest.mark.skipif(not kernels.available(), reason=kernels.why_not() or "available")


def _model(**changes) -> GPT:
    torch.manual_seed(0)
    cfg = GPTConfig.from_preset("llama", vocab_size=96, d_model=64, n_heads=4, n_kv_heads=2, n_layers=2, d_ff=64,
                                max_seq_len=64, n_experts=6, expert_top_k=3, **changes)
    model = GPT(cfg).eval()
    with torch.no_grad():  # routers far from uniform: the top k well apart
        for layer in model.decoder.layers:
            layer.feed_forward.router.proj.weight.mul_(8.0)
    return model


def _one_by_one(moe: MoEFeedForward, monkeypatch) -> None:
    monkeypatch.setattr(moe, "_kernel_step", lambda: None)


def test_the_step_is_the_experts_one_by_one_exactly(monkeypatch):
    model = quantize(_model(), "int4")
    moe = model.decoder.layers[0].feed_forward
    x = torch.randn(1, 1, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert moe._kernel_step() is not None  # every expert a 4-bit kernel layer
        fast = moe(x)
        _one_by_one(moe, monkeypatch)
        assert torch.equal(fast, moe(x))  # the same blocks times the same int8 activations


def test_a_greedy_decode_is_the_same_with_and_without_it(monkeypatch):
    from decoding_reference import continue_prompts

    model = quantize(_model(shared_expert_d_ff=32), "int4")
    prompts = [[5, 9, 30, 2], [7]]
    fast = continue_prompts(model, prompts, 12)
    for layer in model.decoder.layers:
        _one_by_one(layer.feed_forward, monkeypatch)
    assert continue_prompts(model, prompts, 12) == fast


@torch.no_grad()
def test_float_or_adapted_experts_keep_the_layers_own_path():
    from qkv.lora import LoRAConfig, add_lora

    assert _model().decoder.layers[0].feed_forward._kernel_step() is None  # float experts
    model = quantize(_model(), "int4")
    moe = model.decoder.layers[0].feed_forward
    assert moe._kernel_step() is not None
    moe.experts[2] = moe.experts[1]  # a different module: made again for the experts as they are now
    assert moe._kernel_step() is not None
    with torch.enable_grad():  # training goes through the experts one by one, where gradients flow
        assert moe._kernel_step() is None
    add_lora(model, LoRAConfig(rank=2, targets=("q_proj",)))
    assert moe._kernel_step() is not None  # adapters on attention leave the experts as they were
