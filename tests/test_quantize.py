"""Weight-only int8 and int4: each quantized layer equals the fp32 layer of its own dequantized weights (the
kernels against the formula), the dequantized weights are within half a step of the originals, quantized models
keep the decoding invariants, and a quantized model survives save and load bit for bit."""

import pytest
import torch
import torch.nn.functional as F
from decoding_reference import continue_prompts
from safetensors.torch import load_file, save_file
from torch import nn

from qkv import GPT, GPTConfig
from qkv.kernel_layers import KernelInt4Linear, KernelInt8Linear
from qkv.nn import StackedFeedForward, StackedSelfAttention
from qkv.quantize import input_magnitudes, int4_class, int8_class, quantize, quantize_linear
from qkv.quantized import FORMATS, WIDEN_ROWS, Int4Linear, Int8Linear, QuantizedLinear, int4_block, int4_slots, unpaired

MODES = [("int8", 32), ("int4", 32), ("int4", 64)]


def _reference(layer: QuantizedLinear, x: torch.Tensor, bias) -> torch.Tensor:
    """What a quantized layer computes (see qkv.quantize): the inputs as its kernel takes them (:func:`_as_multiplied`)
    times the dequantized weights (rounded to bf16 too where many rows use widened weights), the product rounded
    to bf16 by PyTorch's kernels."""
    weights, ours = layer.dequantized(), _of_qkvs_kernel(layer)
    if layer.mode == "int8" and not ours and x.numel() // x.size(-1) >= WIDEN_ROWS:
        weights = weights.bfloat16().float()
    product = _as_multiplied(layer, x) @ weights.T
    return (product if ours else product.bfloat16().float()) + (0 if bias is None else bias)


def _of_qkvs_kernel(layer: QuantizedLinear) -> bool:
    return isinstance(layer, (KernelInt4Linear, KernelInt8Linear))


def _as_multiplied(layer: QuantizedLinear, x: torch.Tensor) -> torch.Tensor:
    """The inputs as the layer's kernel sees them: rounded to bf16 for PyTorch's; for qkv's own kernel, int8 per
    block of 32 inputs, p = round(x · 127 / max|x|) (tests/test_kernels.py holds the kernel to it)."""
    if not _of_qkvs_kernel(layer):
        return x.bfloat16().float()
    blocks = x.reshape(-1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    inverse = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros(()))
    return ((blocks * inverse).round() * (amax / 127)).view_as(x)


@pytest.mark.parametrize("mode, group", MODES)
@pytest.mark.parametrize("out_features, in_features, bias", [(37, 192, True), (5, 64, False), (130, 128, True)])
@pytest.mark.parametrize("rows", [3, 2 * WIDEN_ROWS])  # the kernels; many rows (int8: widened bf16 weights)
def test_a_quantized_layer_computes_with_its_dequantized_weights(mode, group, out_features, in_features, bias, rows):
    torch.manual_seed(0)
    linear = nn.Linear(in_features, out_features, bias=bias)
    layer = quantize_linear(linear, mode, group_size=group)
    x = torch.randn(2, rows, in_features)
    torch.testing.assert_close(layer(x), _reference(layer, x, linear.bias), atol=1e-5, rtol=8e-3)  # a bf16 step


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_rows_written_after_the_first_product_are_the_ones_multiplied(mode):
    """The int8 kernel reads a copy of the codes padded to its width step (100 inputs: 112); rows written after
    it was made must reach it, as they reach the widened product of many rows."""
    torch.manual_seed(0)
    layer = quantize_linear(nn.Linear(128 if mode == "int4" else 100, 48), mode)
    x = torch.randn(1, 2 * WIDEN_ROWS, layer.in_features)
    layer(x[:, :3])  # the kernel's product made
    fresh = type(layer).encoded(torch.randn(8, layer.in_features), *([layer.group_size] if mode == "int4" else []))
    layer.write_rows(16, **fresh)
    for n in (3, 2 * WIDEN_ROWS):  # the kernel; the widened weights
        torch.testing.assert_close(layer(x[:, :n]), _reference(layer, x[:, :n], layer.bias), atol=1e-5, rtol=8e-3)


@pytest.mark.parametrize("in_features", [37, 100, 1532])
@pytest.mark.parametrize("rows", [1, 2 * WIDEN_ROWS])
def test_int8_takes_any_input_width(in_features, rows):
    """PyTorch's int8 kernel crashes the process on widths that are not a multiple of 16: the layer pads."""
    torch.manual_seed(0)
    linear = nn.Linear(in_features, 24)
    layer = Int8Linear.from_linear(linear)
    x = torch.randn(rows, in_features)
    torch.testing.assert_close(layer(x), _reference(layer, x, linear.bias), atol=1e-5, rtol=8e-3)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_outlier_columns_count_with_their_fp32_weights(mode):
    """A layer whose inputs 3, 40 and 77 are 30 times the rest: kept in fp32, those columns come back exactly, the
    layer computes with those weights, and its error against fp32 drops well below the plain layer's."""
    torch.manual_seed(0)
    linear = nn.Linear(128, 48)
    columns = torch.tensor([3, 40, 77])
    layer = quantize_linear(linear, mode, outlier_columns=columns)
    plain = quantize_linear(linear, mode)
    assert layer.outliers == 3 and "3 fp32 columns" in repr(layer)
    torch.testing.assert_close(layer.dequantized()[:, columns], linear.weight.detach()[:, columns])
    x = torch.randn(5, 128)
    x[:, columns] *= 30
    with torch.no_grad():
        exact = linear(x)
        # the codes' part as the kernel rounds it (bf16 inputs and product), the fp32 columns added exactly; qkv's
        # kernel (int8 inputs per block) takes the outlier inputs as zeros, their codes' share added in fp32
        if _of_qkvs_kernel(layer):
            codes = layer._decoded()
            codes_part = _as_multiplied(layer, x.index_fill(1, columns, 0.0)) @ codes.T
            codes_part += x[:, columns] @ codes[:, columns].T
        else:
            codes_part = (_as_multiplied(layer, x) @ layer._decoded().T).bfloat16().float()
        fp32_part = x[:, columns] @ layer.outlier_weights
        torch.testing.assert_close(layer(x), codes_part + fp32_part + linear.bias, atol=1e-5, rtol=8e-3)
        assert (layer(x) - exact).abs().max() < 0.5 * (plain(x) - exact).abs().max()


def test_input_magnitudes_are_the_mean_absolute_inputs_of_every_linear_layer():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    batches = [torch.randn(4, 6), torch.randn(2, 5, 6)]
    with torch.no_grad():
        magnitudes = input_magnitudes(model, lambda: [model(b) for b in batches])
        inputs = torch.cat([b.reshape(-1, 6) for b in batches])
        torch.testing.assert_close(magnitudes["0"], inputs.abs().mean(0))
        torch.testing.assert_close(magnitudes["2"], model[1](model[0](inputs)).abs().mean(0))
    assert not model[0]._forward_pre_hooks and not model[2]._forward_pre_hooks  # nothing left behind


def test_calibrated_quantization_keeps_the_largest_inputs_in_fp32():
    model = _gpt()
    ids = torch.randint(0, 96, (2, 12))
    with torch.no_grad():
        full = model(ids)
        magnitudes = input_magnitudes(model, lambda: model(ids))
        magnitudes["lm_head"] = torch.zeros(64).index_fill(0, torch.tensor([2, 9]), 5.0)  # two columns stand out
        top = magnitudes["decoder.layers.0.self_attn.q_proj"].topk(2).indices.sort().values
        quantize(model, "int8", magnitudes=magnitudes, outliers=2)
        assert model.lm_head.outlier_columns.tolist() == [2, 9]
        stacked = model.decoder.layers[0].self_attn.qkv_proj  # Q, K, V read one input: W^Q's magnitudes serve
        assert torch.equal(stacked.outlier_columns, top)
        assert model.decoder.layers[0].feed_forward.gate_up.outliers == 2
        assert (model(ids) - full).abs().max() < 0.02 * full.std() * 6


@pytest.mark.parametrize("mode, group", MODES)
def test_dequantized_weights_are_within_half_a_step(mode, group):
    torch.manual_seed(1)
    w = torch.randn(24, 64) * torch.linspace(0.1, 3, 24)[:, None]  # rows of very different ranges
    linear = nn.Linear(64, 24, bias=False)
    linear.weight.data.copy_(w)
    layer = quantize_linear(linear, mode, group_size=group)
    error = (layer.dequantized() - w).abs()
    if mode == "int8":
        step = w.abs().amax(dim=1, keepdim=True) / 127
    else:
        g = w.view(24, -1, group)
        step = ((g.amax(-1) - g.amin(-1)) / 15).repeat_interleave(group, dim=1)
    assert (error <= step / 2 * 1.01 + 1e-6).all()  # half a step, and the scale rounded to bf16
    assert error.max() > 0  # the quantization did something


@pytest.mark.parametrize("rows, inputs", [(16, 64), (32, 64), (48, 128), (96, 32), (80, 256), (960, 64)])
def test_int4_codes_lie_where_pytorchs_own_converter_puts_them(rows, inputs):
    """The layout Int4Linear writes (int4_slots) is the one PyTorch's CPU kernel reads: its own converter, given
    the same codes, makes the same bytes, for whole blocks of rows (32 on AVX2, 64 on AVX-512) and a shorter last
    one."""
    codes = torch.randint(0, 16, (rows, inputs), generator=torch.Generator().manual_seed(rows), dtype=torch.int32)
    theirs = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    layer = Int4Linear(inputs, rows)
    layer.write_rows(0, codes=codes.to(torch.uint8), scales=torch.ones(rows, inputs // 32),
                     zeros=torch.zeros(rows, inputs // 32))
    assert torch.equal(layer.codes, theirs)
    slots, nibbles = int4_slots(torch.arange(rows), inputs, rows)
    assert len(set(zip(slots.flatten().tolist(), nibbles.repeat_interleave(inputs).tolist(), strict=True))) == \
        rows * inputs  # every code its own place


@pytest.fixture(params=[32, 64], ids=["avx2", "avx512"])
def either_int4_layout(request, monkeypatch):
    """Each of the layouts PyTorch's int4 kernel reads on some CPU (rows in blocks of 32 or 64), whatever this
    CPU's is: how the codes are written must agree with where int4_slots says they lie in both."""
    monkeypatch.setattr("qkv.quantized._BLOCK", request.param)
    return request.param


def test_the_int4_layout_is_found_once_and_an_unknown_one_is_one_clear_error(monkeypatch):
    assert int4_block() in (32, 64) and int4_block() == int4_block()
    monkeypatch.setattr("qkv.quantized._BLOCK", None)
    monkeypatch.setattr(torch.ops.aten, "_convert_weight_to_int4pack_for_cpu",
                        lambda codes, inner: torch.zeros(len(codes), codes.size(1) // 2, dtype=torch.uint8))
    with pytest.raises(RuntimeError, match=r"int4 kernel reads another layout .* use --quantize int8 or none"):
        int4_block()


@pytest.mark.parametrize("span", [16, 32])
def test_int4_codes_written_two_to_a_byte_equal_them_written_one_by_one(span, either_int4_layout):
    """write_pairs moves ggml's bytes (inputs j and j + span) into the kernel's (rows i and i + block / 2) by
    shifts and masks: the same layer as the codes unpacked and written one by one, whole blocks or not."""
    rows, inputs = 112, 128  # whole blocks of rows, then a shorter one
    pairs = torch.randint(0, 256, (rows, inputs // 2), generator=torch.Generator().manual_seed(span),
                          dtype=torch.uint8)
    codes = unpaired(pairs, span)
    assert torch.equal(codes[:, span], pairs[:, 0] >> 4)  # input span: the high nibble of the run's first byte
    assert torch.equal(codes[:, 2 * span + 1], pairs[:, span + 1] & 15)  # the second run's second input
    scales, zeros = torch.rand(rows, inputs // 32), torch.rand(rows, inputs // 32)
    one_by_one, paired = Int4Linear(inputs, rows), Int4Linear(inputs, rows)
    one_by_one.write_rows(0, codes, scales, zeros)
    for start, end in [(0, 64), (64, 77), (77, 112)]:  # whole blocks, then rows that share bytes with others
        paired.write_pairs(start, pairs[start:end], span, scales[start:end], zeros[start:end])
    assert torch.equal(paired.codes, one_by_one.codes)
    slots, nibbles = int4_slots(torch.arange(rows), inputs, rows)
    assert torch.equal(paired.codes.view(-1)[slots] >> 4 * nibbles[:, None] & 15, codes)  # where int4_slots says
    assert torch.equal(paired.scales_and_zeros, one_by_one.scales_and_zeros)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_rows_widened_in_place_are_the_dequantized_rows(mode, either_int4_layout):
    """The backward pass widens tiles of rows into one buffer (_decoded_rows): whole int4 blocks from their bytes,
    other rows gathered; every tile is exactly those rows of the dequantized weight."""
    layer = quantize_linear(_linear(torch.randn(112, 64)), mode)  # int4: whole blocks, then a shorter one
    full = layer._decoded()
    buffer = torch.empty(112, 64)
    for start, end in [(0, 112), (0, 64), (64, 112), (32, 96), (3, 111), (96, 97)]:
        assert torch.equal(layer._decoded_rows(start, end, buffer[: end - start]), full[start:end]), (start, end)


def test_int4_rows_written_in_pieces_equal_the_whole_and_padding_rows_are_zero():
    w = torch.randn(40, 64)
    whole = Int4Linear.from_linear(_linear(w))
    pieces = Int4Linear(64, 40)
    for start in (0, 7, 23):  # arbitrary cuts: rows that share a byte written apart
        end = {0: 7, 7: 23, 23: 40}[start]
        pieces.write_rows(start, **Int4Linear.encoded(w[start:end], 32))
    assert torch.equal(pieces.codes, whole.codes) and torch.equal(pieces.scales_and_zeros, whole.scales_and_zeros)
    assert whole.codes.shape == (48, 32)  # 40 rows padded to 48
    x = torch.randn(3, 64)
    torch.testing.assert_close(whole(x), x @ whole.dequantized().T, atol=0.05, rtol=0.02)


def _linear(w: torch.Tensor) -> nn.Linear:
    linear = nn.Linear(w.size(1), w.size(0), bias=False)
    with torch.no_grad():
        linear.weight.copy_(w)
    return linear


@pytest.mark.parametrize("mode, group", MODES)
def test_stacked_projections_quantize_to_the_codes_of_the_layers_they_replace(mode, group):
    model = _gpt()
    attention, ffn = model.decoder.layers[1].self_attn, model.decoder.layers[1].feed_forward
    alone = [quantize_linear(m, mode, group_size=group) for m in
             (attention.q_proj, attention.k_proj, attention.v_proj, ffn.gate, ffn.up)]
    quantize(model, mode, group_size=group)
    layer = model.decoder.layers[1]
    assert isinstance(layer.self_attn, StackedSelfAttention) and isinstance(layer.feed_forward, StackedFeedForward)
    assert "self_attn.q_proj.codes" not in str(model.state_dict())
    for stacked, parts in ((layer.self_attn.qkv_proj, alone[:3]), (layer.feed_forward.gate_up, alone[3:])):
        assert torch.equal(stacked.dequantized(), torch.cat([p.dequantized() for p in parts]))
        for name in ("scales",) + (("zeros",) if mode == "int4" else ()):
            assert torch.equal(getattr(stacked, name), torch.cat([getattr(p, name) for p in parts]))


def test_each_format_is_a_class_and_a_quantized_model_keeps_its_layer_names():
    """One class per format (the factory's map); the quantized layers sit where the linear ones were, under the same
    names, except the stacked projections, which replace the layers they are made of."""
    assert dict(FORMATS) == {"int8": Int8Linear, "int4": Int4Linear}
    assert all(issubclass(layer, QuantizedLinear) for layer in FORMATS.values())
    model = _gpt()
    before = {key.rpartition(".")[0] for key in model.state_dict()}
    quantize(model, "int4")
    assert type(model.lm_head) is int8_class(64) and type(model.decoder.layers[0].self_attn.out_proj) is int4_class()
    after = {key.rpartition(".")[0] for key in model.state_dict()}
    layers = [f"decoder.layers.{i}." for i in range(2)]
    assert after - before == {p + name for p in layers for name in ("self_attn.qkv_proj", "feed_forward.gate_up")}
    assert before - after == {p + name for p in layers for name in ("self_attn.q_proj", "self_attn.k_proj",
                                                                     "self_attn.v_proj", "feed_forward.gate",
                                                                     "feed_forward.up")}
    with pytest.raises(ValueError, match="unknown quantization 'int3'; choose one of int8, int4"):
        quantize_linear(nn.Linear(64, 8), "int3")
    with pytest.raises(ValueError, match="not divisible by the group size 64"):
        Int4Linear(96, 8, group_size=64)


def _gpt(seed=0):
    torch.manual_seed(seed)
    return GPT(GPTConfig.from_preset("llama", vocab_size=96, d_model=64, n_heads=4, n_kv_heads=2, n_layers=2,
                                     d_ff=128, max_seq_len=64)).eval()


@pytest.mark.parametrize("mode, group", MODES)
def test_a_quantized_model_stays_close_and_keeps_the_decoding_invariants(mode, group):
    model = _gpt()
    ids = torch.randint(0, 96, (2, 12))
    with torch.no_grad():
        full = model(ids)
        quantize(model, mode, group_size=group)
        quantized = model(ids)
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert model.lm_head.mode == "int8" and model.decoder.layers[0].self_attn.qkv_proj.mode == mode  # output at 8 bits
    bound = 0.02 if mode == "int8" else 0.2  # of the logits' spread
    assert (quantized - full).abs().max() < bound * full.std() * 6
    prompts = [[5, 6, 7, 8, 9], [10, 11]]
    cached = continue_prompts(model, prompts, 10)
    assert cached == continue_prompts(model, prompts, 10, use_cache=False)
    for prompt, row in zip(prompts, cached, strict=True):
        assert continue_prompts(model, [prompt], 10)[0] == row


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantize_save_load_gives_identical_outputs(tmp_path, mode):
    magnitudes = {"lm_head": torch.arange(64.0)} if mode == "int8" else None  # with outlier columns
    model = quantize(_gpt(), mode, group_size=32, magnitudes=magnitudes)
    save_file(model.state_dict(), tmp_path / "model.safetensors")
    fresh = quantize(_gpt(seed=1), mode, group_size=32, magnitudes=magnitudes)  # same structure, other weights
    fresh.load_state_dict(load_file(tmp_path / "model.safetensors"))
    ids = torch.randint(0, 96, (2, 9))
    with torch.no_grad():
        assert torch.equal(fresh(ids), model(ids))


def test_bad_quantization_requests_are_clear_and_change_nothing():
    model = _gpt()
    with pytest.raises(ValueError, match="unknown quantization 'int3'; choose one of none, int8, int4"):
        quantize(model, "int3")
    with pytest.raises(ValueError, match=r"cannot quantize .* to int4: its 64 inputs are not divisible by the group "
                                         r"size 128"):
        quantize(model, "int4", group_size=128)
    with pytest.raises(ValueError, match="the int4 group size must be one of 32, 64, 128, 256, got 48"):
        quantize(model, "int4", group_size=48)
    assert any(isinstance(m, nn.Linear) for m in model.modules())  # untouched
    assert quantize(model, "none") is model


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_a_quantized_translator_decodes_the_same_with_and_without_its_cache(mode):
    """Encoder, decoder and cross-attention layers quantized; beam and greedy, cached = uncached, and a padded
    batch = one sentence at a time."""
    from qkv import Transformer, TransformerConfig
    from qkv.tasks.translation import translate_ids

    torch.manual_seed(0)
    model = Transformer(TransformerConfig(src_vocab_size=64, tgt_vocab_size=64, d_model=64, n_heads=4, n_layers=2,
                                          d_ff=128, max_seq_len=32)).eval()
    quantize(model, mode)
    assert model.lm_head.mode == "int8"
    sources = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14]]
    for beam in (1, 3):
        cached = translate_ids(model, sources, beam_size=beam)
        assert cached == translate_ids(model, sources, beam_size=beam, use_cache=False)
        assert cached == [translate_ids(model, [s], beam_size=beam)[0]
                          for s in sources]


@pytest.mark.parametrize("mode, group", MODES)
def test_an_output_layer_computes_its_largest_outputs_in_fp32(mode, group):
    """The kernel's bf16 output rounds logits near 16 to steps of 1/16, which ties tokens fp32 tells apart: an
    output layer recomputes each row's largest outputs from its codes in fp32, so greedy picks what the
    dequantized weights in fp32 pick."""
    torch.manual_seed(0)
    linear = nn.Linear(64, 500, bias=True)
    layer = quantize_linear(linear, mode, group_size=group, outlier_columns=torch.tensor([3, 17]))
    x = torch.randn(300, 64) * 4
    with torch.no_grad():
        exact = F.linear(x, layer.dequantized(), layer.bias)
        rounded = layer(x)
        layer.exact_largest = True
        refined = layer(x)
    assert (rounded.max(-1).values - exact.max(-1).values).abs().max() > 1e-3  # the bf16 rounding the test sees
    torch.testing.assert_close(refined.max(-1).values, exact.max(-1).values, atol=1e-4, rtol=1e-5)
    assert torch.equal(refined.argmax(-1), exact.argmax(-1))
    assert (refined - exact).abs().max() < 0.05 * exact.abs().max()  # the rest as the kernel gives it
