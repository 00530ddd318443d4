"""A GGUF file's Q6_K and Q5_K tensors held as stored (qkv's kernel's 6-bit and 5-bit layers) when loaded quantized
at rest: the
layers hold the file's own weights (those of the reference path, which dequantizes the whole file with the ``gguf``
package, exactly) in the file's bytes, each multiplies them by its int8-rounded inputs, cached decoding equals
uncached, and int8 is still what ``mode="int8"`` gives."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hf_greedy import greedy_qkv, greedy_uncached
from tiny_gguf import VOCAB, gguf_tensors, q5_k, q6_k, tiny_llama, write_gguf

from qkv import kernels
from qkv.interop import at_rest, load_gpt_from_gguf
from qkv.interop.at_rest import load_quantized_gpt
from qkv.quantized import QuantizedEmbedding, QuantizedLinear

gguf = pytest.importorskip("gguf", reason="reading GGUF files needs the gguf package: pip install gguf")
pytestmark = pytest.mark.skipif(not kernels.available(), reason=kernels.why_not() or "available")

WIDTH = 256  # a K-quant super-block: every matrix's inputs
ENCODERS = {"Q6_K": q6_k, "Q5_K": q5_k}
HELD_PER_STORED = {"Q6_K": 1.0, "Q5_K": 180 / 176}  # Q5_K's six-bit scales and minimums held a byte each


@pytest.fixture(scope="module", params=list(ENCODERS))
def k_file(request, tmp_path_factory):
    """A tiny LLaMA 256 wide whose every matrix, the tied table too, is stored in one K-quant (Q6_K, Q5_K)."""
    torch.manual_seed(0)
    tensors = gguf_tensors(tiny_llama(tie=True, d_model=WIDTH, d_ff=WIDTH))
    kind = gguf.GGMLQuantizationType[request.param]
    stored = {name: (ENCODERS[request.param](array), kind) if array.ndim == 2 else (array, None)
              for name, array in tensors.items()}
    path = tmp_path_factory.mktemp("k") / f"{request.param}.gguf"
    return request.param, write_gguf(path, stored, d_model=WIDTH, d_ff=WIDTH)


@pytest.fixture(autouse=True)
def held_as_stored(monkeypatch):
    """The K-quants held as stored on any CPU (by default only with AVX-512: see the test below): the kernel's
    other variants compute them as well, the tests check."""
    monkeypatch.setattr(at_rest, "holds_k_quants", lambda: True)


def test_k_quants_are_held_as_stored_by_default_only_with_avx_512(monkeypatch):
    monkeypatch.undo()
    assert at_rest.holds_k_quants() == (kernels.best_variant() == "avx512-vnni")


def _ids(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(seed))


def test_k_quant_matrices_are_held_as_stored(k_file):
    from qkv.kernel_layers import KernelInt5Linear, KernelInt6Linear

    kind, path = k_file
    model, _ = load_quantized_gpt(path, mode="auto")
    layers = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    assert layers and all(type(m) is {"Q6_K": KernelInt6Linear, "Q5_K": KernelInt5Linear}[kind] for m in layers)
    assert isinstance(model.tok_emb, QuantizedEmbedding) and model.tok_emb.table is model.lm_head  # held once
    reader = gguf.GGUFReader(str(path))
    stored = {t.name: t for t in reader.tensors}
    down = stored["blk.1.ffn_down.weight"]
    expected = np.asarray(gguf.quants.dequantize(np.asarray(down.data), down.tensor_type)).reshape(WIDTH, WIDTH)
    layer = model.decoder.layers[1].feed_forward.down
    assert np.array_equal(layer.dequantized().numpy(), expected)
    # 6.6 bits a weight (5.6): the codes and scales take the file's bytes
    held = sum(b.numel() * b.element_size() for b in layer.buffers())
    assert held == np.asarray(down.data).nbytes * HELD_PER_STORED[kind]


def test_each_k_quant_layer_multiplies_its_stored_weights(k_file):
    model, _ = load_quantized_gpt(k_file[1], mode="auto")
    for layer in (m for m in model.modules() if isinstance(m, QuantizedLinear) and not m.exact_largest):
        x = torch.randn(3, layer.in_features)
        with torch.no_grad():
            expected = kernels.rounded_activations(x) @ layer.dequantized().T
            torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))


def test_k_quant_layers_hold_the_reference_paths_weights(k_file):
    """Every 6-bit (5-bit) layer's weights are those the reference path reads from the file (the ``gguf`` package's
    decoding), stacked as qkv stacks them: with the product above, the model is the reference's but for its int8
    activations (which on this random model move the largest logit by a quarter: as for any int8 layer)."""
    model, _ = load_quantized_gpt(k_file[1], mode="auto")
    reference = load_gpt_from_gguf(k_file[1])
    assert torch.equal(model.tok_emb.table.dequantized(), reference.tok_emb.weight)
    for ours, theirs in zip(model.decoder.layers, reference.decoder.layers, strict=True):
        attention, ffn = theirs.self_attn, theirs.feed_forward
        pairs = [(ours.self_attn.qkv_proj, [attention.q_proj, attention.k_proj, attention.v_proj]),
                 (ours.self_attn.out_proj, [attention.out_proj]), (ours.feed_forward.gate_up, [ffn.gate, ffn.up]),
                 (ours.feed_forward.down, [ffn.down])]
        for layer, parts in pairs:
            assert torch.equal(layer.dequantized(), torch.cat([part.weight for part in parts]))


def test_k_quants_are_int8_when_asked_for(k_file):
    model, _ = load_quantized_gpt(k_file[1], mode="int8")
    assert all(m.mode == "int8" for m in model.modules() if isinstance(m, QuantizedLinear))


def test_cached_decoding_equals_uncached_on_k_quant_layers(k_file):
    model, _ = load_quantized_gpt(k_file[1], mode="auto")
    prompt = torch.tensor([[5, 17, 40, 8]])
    assert torch.equal(greedy_qkv(model, prompt, 8), greedy_uncached(model, prompt, 8))


def test_a_k_quant_layer_passes_gradients_prompts_and_compiles_as_eager(k_file):
    """What QLoRA, a prompt and ``--compile`` ask of a layer: the input's gradient through the stored weights, many
    rows at once through the widened weights, and the kernel as one node of a traced graph."""
    model, _ = load_quantized_gpt(k_file[1], mode="auto")
    layer = model.decoder.layers[0].feed_forward.down
    x = torch.randn(3, layer.in_features, requires_grad=True)
    layer(x).sum().backward()
    torch.testing.assert_close(x.grad, torch.ones(3, layer.out_features) @ layer.dequantized())
    prompt = torch.randn(100, layer.in_features)  # past the rows where widened weights take over
    with torch.no_grad():
        torch.testing.assert_close(layer(prompt), kernels.rounded_activations(prompt) @ layer.dequantized().T)
        x = torch.randn(2, layer.in_features)
        assert torch.equal(torch.compile(layer, fullgraph=True, backend="aot_eager")(x), layer(x))
