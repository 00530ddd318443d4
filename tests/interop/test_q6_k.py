"""A GGUF file's Q6_K tensors held as stored (qkv's kernel's 6-bit layers) when loaded quantized at rest: the
layers hold the file's own weights (those of the reference path, which dequantizes the whole file with the ``gguf``
package, exactly) in the file's bytes, each multiplies them by its int8-rounded inputs, cached decoding equals
uncached, and int8 is still what ``mode="int8"`` gives."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hf_greedy import greedy_qkv
from tiny_gguf import VOCAB, gguf_tensors, q6_k, tiny_llama, write_gguf

from qkv import kernels
from qkv.interop import load_gpt_from_gguf
from qkv.interop.at_rest import load_quantized_gpt
from qkv.quantize import QuantizedEmbedding, QuantizedLinear

gguf = pytest.importorskip("gguf", reason="reading GGUF files needs the gguf package: pip install gguf")
pytestmark = pytest.mark.skipif(not kernels.available(), reason=kernels.why_not() or "available")

WIDTH = 256  # a Q6_K super-block: every matrix's inputs


@pytest.fixture(scope="module")
def q6_file(tmp_path_factory):
    """A tiny LLaMA 256 wide whose every matrix, the tied table too, is stored as Q6_K."""
    torch.manual_seed(0)
    tensors = gguf_tensors(tiny_llama(tie=True, d_model=WIDTH, d_ff=WIDTH))
    stored = {name: (q6_k(array), gguf.GGMLQuantizationType.Q6_K) if array.ndim == 2 else (array, None)
              for name, array in tensors.items()}
    return write_gguf(tmp_path_factory.mktemp("q6") / "q6_k.gguf", stored, d_model=WIDTH, d_ff=WIDTH)


def _ids(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(seed))


def test_q6_k_matrices_are_held_as_stored(q6_file):
    from qkv.kernels.layer import KernelInt6Linear

    model, _ = load_quantized_gpt(q6_file, mode="auto")
    layers = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    assert layers and all(type(m) is KernelInt6Linear for m in layers)
    assert isinstance(model.tok_emb, QuantizedEmbedding) and model.tok_emb.table is model.lm_head  # held once
    reader = gguf.GGUFReader(str(q6_file))
    stored = {t.name: t for t in reader.tensors}
    down = stored["blk.1.ffn_down.weight"]
    expected = np.asarray(gguf.quants.dequantize(np.asarray(down.data), down.tensor_type)).reshape(WIDTH, WIDTH)
    layer = model.decoder.layers[1].feed_forward.down
    assert np.array_equal(layer.dequantized().numpy(), expected)
    # 6.6 bits a weight: the codes and scales take the file's bytes
    held = sum(b.numel() * b.element_size() for b in layer.buffers())
    assert held == np.asarray(down.data).nbytes


def test_each_q6_k_layer_multiplies_its_stored_weights(q6_file):
    model, _ = load_quantized_gpt(q6_file, mode="auto")
    for layer in (m for m in model.modules() if isinstance(m, QuantizedLinear) and not m.exact_largest):
        x = torch.randn(3, layer.in_features)
        with torch.no_grad():
            expected = kernels.rounded_activations(x) @ layer.dequantized().T
            torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))


def test_q6_k_layers_hold_the_reference_paths_weights(q6_file):
    """Every 6-bit layer's weights are those the reference path reads from the file (the ``gguf`` package's
    decoding), stacked as qkv stacks them: with the product above, the model is the reference's but for its int8
    activations (which on this random model move the largest logit by a quarter: as for any int8 layer)."""
    model, _ = load_quantized_gpt(q6_file, mode="auto")
    reference = load_gpt_from_gguf(q6_file)
    assert torch.equal(model.tok_emb.table.dequantized(), reference.tok_emb.weight)
    for ours, theirs in zip(model.decoder.layers, reference.decoder.layers, strict=True):
        attention, ffn = theirs.self_attn, theirs.feed_forward
        pairs = [(ours.self_attn.qkv_proj, [attention.q_proj, attention.k_proj, attention.v_proj]),
                 (ours.self_attn.out_proj, [attention.out_proj]), (ours.feed_forward.gate_up, [ffn.gate, ffn.up]),
                 (ours.feed_forward.down, [ffn.down])]
        for layer, parts in pairs:
            assert torch.equal(layer.dequantized(), torch.cat([part.weight for part in parts]))


def test_requantizing_q6_k_when_asked_for_int8(q6_file):
    model, _ = load_quantized_gpt(q6_file, mode="int8")
    assert all(m.mode == "int8" for m in model.modules() if isinstance(m, QuantizedLinear))


def test_cached_decoding_equals_uncached_on_q6_k_layers(q6_file):
    model, _ = load_quantized_gpt(q6_file, mode="auto")
    prompt = torch.tensor([[5, 17, 40, 8]])
    cached = greedy_qkv(model, prompt, 8)
    ids = prompt
    with torch.no_grad():
        for _ in range(8):
            ids = torch.cat([ids, model(ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(cached, ids[:, 4:])
