"""LoRA: an adapter with B = 0 is its base, merged = unmerged, QLoRA's gradients are LoRA's over the dequantized
weights, a stacked layer's adapters are the separate layers' ones, and the model-level placement by target name."""

import pytest
import torch
from torch import nn

from qkv import GPT, GPTConfig
from qkv.lora import LoRAConfig, add_lora, lora_config_of, lora_layers, merge_lora
from qkv.nn import LoRALinear
from qkv.quantize import quantize, quantize_linear


def _randomized(layer: LoRALinear, seed: int = 1) -> LoRALinear:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        layer.lora_B.copy_(torch.randn(layer.lora_B.shape, generator=g) * 0.1)
    return layer


def _llama(**overrides) -> GPT:
    torch.manual_seed(0)
    sizes = dict(vocab_size=64, n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, d_ff=128, max_seq_len=32)
    cfg = GPTConfig.from_preset("llama", **(sizes | overrides))
    return GPT(cfg).eval()


@pytest.mark.parametrize("base", ["float", "int8", "int4"])
def test_an_adapter_with_b_zero_is_its_base(base):
    torch.manual_seed(0)
    linear = nn.Linear(64, 96)
    layer = linear if base == "float" else quantize_linear(linear, base)
    x = torch.randn(3, 5, 64)
    expected = layer(x)
    adapted = LoRALinear(layer, rank=4, alpha=8)
    torch.testing.assert_close(adapted(x), expected, rtol=0, atol=0)
    assert {n for n, p in adapted.named_parameters() if p.requires_grad} == {"lora_A", "lora_B"}


@pytest.mark.parametrize("rslora", [False, True])
def test_merged_equals_unmerged_on_a_float_base(rslora):
    torch.manual_seed(0)
    adapted = _randomized(LoRALinear(nn.Linear(48, 80), rank=6, alpha=12, rslora=rslora))
    x = torch.randn(7, 48)
    delta = adapted.scale * (adapted.lora_B @ adapted.lora_A)
    assert adapted.scale == pytest.approx(12 / (6**0.5 if rslora else 6))
    torch.testing.assert_close(adapted(x), x @ (adapted.base.weight + delta).T + adapted.base.bias)
    torch.testing.assert_close(adapted.merged()(x), adapted(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("parts", [None, (("q", 32), ("k", 16), ("v", 16))], ids=["one", "stacked"])
@pytest.mark.parametrize("bias", [True, False])
def test_a_float_layers_fused_product_gives_the_separate_products_and_their_gradients(parts, bias):
    """The forward and backward written out (``_Adapted``) against autograd over the products as the docstring
    writes them, ``x Wᵀ + b + s · (x Aᵀ) Bᵀ``; a stacked layer with one part not adapted; and an input that
    needs no gradient (a model's first layer) gets none."""
    torch.manual_seed(0)
    adapted = _randomized(LoRALinear(nn.Linear(48, 64, bias=bias), rank=4, alpha=8, parts=parts,
                                     targets=None if parts is None else ("q", "v")))
    x = torch.randn(2, 5, 48, requires_grad=True)
    assert adapted._fusable(x)
    fused = adapted(x)
    g = torch.randn_like(fused)
    fused.backward(g)
    got = [t.grad.clone() for t in (x, adapted.lora_A, adapted.lora_B)]
    for t in (x, adapted.lora_A, adapted.lora_B):
        t.grad = None
    base = adapted.base
    explicit = nn.functional.linear(x, base.weight, base.bias) + adapted.scale * (
        x @ adapted.lora_A.T) @ adapted._up(adapted.lora_B).T
    explicit.backward(g)
    torch.testing.assert_close(fused, explicit, rtol=1e-5, atol=1e-6)
    for mine, theirs in zip(got, (x.grad, adapted.lora_A.grad, adapted.lora_B.grad), strict=True):
        assert theirs.abs().sum() > 0
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)
    for t in (adapted.lora_A, adapted.lora_B):
        t.grad = None
    adapted(x.detach()).backward(g)  # no gradient asked for the input: none made, the adapter's the same
    torch.testing.assert_close(adapted.lora_A.grad, got[1], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(adapted.lora_B.grad, got[2], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_qlora_gradients_equal_lora_over_the_dequantized_weights(mode):
    torch.manual_seed(0)
    quantized = quantize_linear(nn.Linear(64, 96), mode)
    float_twin = nn.Linear(64, 96)
    with torch.no_grad():
        float_twin.weight.copy_(quantized.dequantized())
        float_twin.bias.copy_(quantized.bias)
    q_lora = _randomized(LoRALinear(quantized, rank=4, alpha=8))
    f_lora = LoRALinear(float_twin, rank=4, alpha=8)
    f_lora.load_state_dict({k: v for k, v in q_lora.state_dict().items() if k.startswith("lora_")}, strict=False)
    x = torch.randn(6, 64)
    weights = torch.randn(6, 96)
    grads = []
    for layer in (q_lora, f_lora):
        xi = x.clone().requires_grad_()
        (layer(xi) * weights).sum().backward()
        grads.append((layer.lora_A.grad, layer.lora_B.grad, xi.grad))
    # the adapters' gradients see the same input and output gradient: exact; the input's goes through the
    # quantized product's backward, in its forward's input precision (bf16 for PyTorch's kernels: 2⁻⁸ relative
    # to each of its inputs; float32 for qkv's own int4 kernel)
    torch.testing.assert_close(grads[0][0], grads[1][0], rtol=0, atol=0)
    torch.testing.assert_close(grads[0][1], grads[1][1], rtol=0, atol=0)
    error = (grads[0][2] - grads[1][2]).norm() / grads[1][2].norm()
    assert error < 2**-7, error
    with torch.no_grad():  # the quantized product was taken: its forward is not the float one
        assert not torch.equal(q_lora(x), f_lora(x))
    assert quantized.bias.grad is None and not quantized.bias.requires_grad


def test_a_stacked_layer_has_the_separate_layers_adapters():
    model = _llama()
    separate = add_lora(_llama(), LoRAConfig(rank=4, targets=("q_proj", "v_proj", "gate_proj", "up_proj")))
    for layer in lora_layers(separate).values():
        _randomized(layer, seed=layer.out_features)
    stacked = add_lora(quantize(model, "int8"), LoRAConfig(rank=4, targets=("q_proj", "v_proj", "gate_proj",
                                                                              "up_proj")))
    block, twin = stacked.decoder.layers[0], separate.decoder.layers[0]
    assert block.self_attn.qkv_proj.targets == ("q_proj", "v_proj")  # k_proj is in the stack, not adapted
    with torch.no_grad():
        for name, parts in (("self_attn.qkv_proj", {"q_proj": "self_attn.q_proj", "v_proj": "self_attn.v_proj"}),
                            ("feed_forward.gate_up", {"gate_proj": "feed_forward.gate", "up_proj": "feed_forward.up"})):
            for target, separate_name in parts.items():
                a, b = block.get_submodule(name).part(target)
                a.copy_(twin.get_submodule(separate_name).lora_A)
                b.copy_(twin.get_submodule(separate_name).lora_B)
    x = torch.randn(2, 5, 64)
    for name, parts in (("self_attn.qkv_proj", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
                        ("feed_forward.gate_up", ("feed_forward.gate", "feed_forward.up"))):
        ours = block.get_submodule(name)
        deltas = torch.cat([(twin.get_submodule(p).delta() if isinstance(twin.get_submodule(p), LoRALinear)
                             else torch.zeros_like(twin.get_submodule(p).weight)) for p in parts])
        torch.testing.assert_close(ours.delta(), deltas)
        torch.testing.assert_close(ours(x) - ours.base(x), x @ deltas.T, rtol=1e-5, atol=1e-5)


def test_a_model_is_frozen_but_its_adapters_and_merges_back():
    model = _llama()
    ids = torch.randint(0, 64, (2, 9))
    add_lora(model, LoRAConfig(rank=4, alpha=8))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(n.endswith(("lora_A", "lora_B")) for n in trainable)
    assert len(lora_layers(model)) == 2 * 7
    assert lora_config_of(model) == LoRAConfig(rank=4, alpha=8)
    for layer in lora_layers(model).values():
        _randomized(layer)
    with torch.no_grad():
        adapted = model(ids)
        merged = merge_lora(model)(ids)
    assert not lora_layers(model)
    torch.testing.assert_close(merged, adapted, rtol=1e-5, atol=1e-5)


def test_targets_of_another_family_other_models_and_ranks_too_large_are_one_line_errors():
    with pytest.raises(ValueError, match=r"^the LoRA target modules \['fc1'\] are not projections of a LLaMA-family "
                                         r"model; choose among q_proj, .*, down_proj$"):
        add_lora(_llama(), LoRAConfig(targets=("q_proj", "fc1")))  # Marian's first feed-forward layer
    gpt2_style = GPT(GPTConfig(vocab_size=64, d_model=32, n_heads=2, n_layers=1, d_ff=64, max_seq_len=16))
    with pytest.raises(ValueError, match=r"^LoRA adapters are placed by .*, got a GPT with norm='layer'") as err:
        add_lora(gpt2_style, LoRAConfig())  # no Hugging Face names to place them by
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match=r"decoder.layers.0.self_attn.q_proj: the LoRA rank must be between 1 and "
                                         r"the layer's smaller side \(64\), got 80"):
        add_lora(_llama(), LoRAConfig(rank=80))
    with pytest.raises(ValueError, match="unknown LoRA target modules"):
        LoRAConfig(targets=("c_attn",))


def test_an_adapted_model_compiled_block_by_block_trains_as_eager():
    """What ``qkv finetune --compile`` does: each block compiled with dynamic shapes, here whole (no graph breaks:
    ``fullgraph``), traced into forward and backward graphs as inductor compiles them but run by PyTorch's own
    kernels (``aot_eager``: seconds, where inductor's C++ takes a minute of these two cores); the loss and every
    adapter's gradient are eager's, at two lengths of padded rows, with one graph for both. (One block: each graph takes
    seconds to trace, and a model's first block, whose input needs no gradient, has a graph of its own.)"""
    import copy

    from torch._dynamo.utils import counters

    from qkv.models.common import compile_blocks

    eager = add_lora(_llama(n_layers=1), LoRAConfig(rank=4)).train()
    for layer in lora_layers(eager).values():
        _randomized(layer)
    torch._dynamo.reset()
    counters.clear()
    compiled = compile_blocks(copy.deepcopy(eager), dynamic=True, fullgraph=True, backend="aot_eager")
    for length in (12, 17):  # padded rows, the products on their real tokens alone, as FineTuneTask runs them
        ids = torch.randint(0, 64, (3, length), generator=torch.Generator().manual_seed(length))
        real = (torch.arange(length) < torch.tensor([length, length - 3, length - 5])[:, None]).flatten()
        index = real.nonzero().squeeze(1)
        losses = []
        for model in (eager, compiled):
            model.zero_grad()
            logits = model(ids, real=index, logits_at=index)
            loss = nn.functional.cross_entropy(logits, ids.flatten()[index])
            loss.backward()
            losses.append(loss.item())
        assert losses[1] == pytest.approx(losses[0], rel=1e-5)
        theirs = dict(compiled.named_parameters())
        for name, p in eager.named_parameters():
            if p.requires_grad:
                torch.testing.assert_close(theirs[name].grad, p.grad, atol=1e-5, rtol=1e-4)
    assert counters["stats"]["unique_graphs"] == 1
