"""qkv's block products (qkv.kernels, q4.c), 4-bit and 8-bit weights times int8 activations: every variant the CPU
runs against a reference of the same integer arithmetic written here in torch (exactly), against the float product
of the dequantized weights (within the error int8 activations add, bounded per block), and the variants against one
another."""

from __future__ import annotations

import os

import pytest
import torch

from qkv import kernels

pytestmark = pytest.mark.skipif(not kernels.available(), reason=kernels.why_not() or "available")

BLOCK = kernels.BLOCK
VARIANTS = [pytest.param(v, marks=pytest.mark.skipif(kernels.available() and not kernels.runs(v),
                                                      reason=f"this CPU does not run {v}")) for v in kernels.VARIANTS]


BITS = [4, 8]  # the weights' formats: Q4_0/Q4_1 blocks (codes and offsets), Q8_0 blocks (codes, no offsets)


def weights(rows: int, n: int, seed: int = 0, bits: int = 4) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Random codes, fp16 scales (one subnormal) and offsets (4-bit only); 8-bit codes span -128..127."""
    g = torch.Generator().manual_seed(seed)
    if bits == 8:
        codes = torch.randint(-128, 128, (rows, n), dtype=torch.int8, generator=g)
    else:
        codes = torch.randint(0, 256, (rows, n // 2), dtype=torch.uint8, generator=g)
    scales = (torch.rand(rows, n // BLOCK, generator=g) * 0.02 + 1e-3).half()
    offsets = (torch.randn(rows, n // BLOCK, generator=g) * 1e-2).half() if bits == 4 else None
    scales[0, 0] = 2**-20  # subnormal in fp16: every variant widens it exactly
    return codes, scales, offsets


def unpacked(codes: torch.Tensor) -> torch.Tensor:
    """The codes (rows, n) in input order, as integers: 8-bit ones as they are; 4-bit ones two a byte, block b's byte
    i holding input 32 b + i (low nibble) and 32 b + 16 + i (high nibble)."""
    if codes.dtype == torch.int8:
        return codes.long()
    rows, half = codes.shape
    blocks = codes.view(rows, half // 16, 16).long()
    return torch.cat([blocks & 15, blocks >> 4], dim=-1).view(rows, 2 * half)


def reference_quantized(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """int8 per block of 32, as q4.c computes it, in float32: p = round(x · 127 / max|x|) (halves to even)."""
    blocks = x.view(x.size(0), -1, BLOCK)
    amax = blocks.abs().amax(-1)
    inverse = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros(()))
    p = (blocks * inverse[..., None]).round()
    xd = amax / 127
    return p.to(torch.int8).view_as(x), xd, xd * p.sum(-1)


@pytest.mark.parametrize("shape", [(4, 64), (1, 32), (3, 576)])
def test_activations_are_quantized_as_the_reference_does(shape):
    x = torch.randn(*shape) * torch.logspace(-3, 3, shape[1] // BLOCK).repeat_interleave(BLOCK)
    x[0, :BLOCK] = 0  # an all-zero block: scale 0, codes 0
    for ours, theirs in zip(kernels.quantize_activations(x), reference_quantized(x), strict=True):
        assert torch.equal(ours, theirs)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(("rows", "n"), [(1, 32), (7, 64), (13, 576), (33, 1536)])
def test_each_block_sum_is_the_exact_integer_sum(variant, rows, n, bits):
    codes, _, _ = weights(rows, n, bits=bits)
    xq = torch.randint(-127, 128, (n,), dtype=torch.int8)
    xq[:BLOCK] = torch.tensor([127, -127] * (BLOCK // 2), dtype=torch.int8)  # the extremes: no 16-bit overflow
    codes[:, :16] = 0xFF if bits == 4 else -128  # 15, or -128: |q| is 128, one past int8's positives
    expected = (unpacked(codes) * xq.long()).view(rows, -1, BLOCK).sum(-1)
    assert torch.equal(kernels.block_sums(codes, xq, variant=variant).long(), expected)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(("batch", "rows", "n"), [(1, 1, 32), (1, 7, 96), (3, 13, 576), (2, 64, 1536)])
@pytest.mark.parametrize("threads", [1, 4])
def test_the_product_is_the_float_product_within_the_int8_activations_error(variant, batch, rows, n, threads, bits):
    codes, scales, offsets = weights(rows, n, seed=rows, bits=bits)
    x = torch.randn(batch, n)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        y = kernels.matmul(x, codes, scales, offsets, variant=variant)
    finally:
        torch.set_num_threads(before)
    d, m = scales.float(), torch.zeros_like(scales.float()) if offsets is None else offsets.float()  # w = q d + m
    w = (unpacked(codes) * d.repeat_interleave(BLOCK, 1) + m.repeat_interleave(BLOCK, 1)).double()  # (rows, n)
    exact = x.double() @ w.T
    # each input is off by at most half a step of its block, max|x| / 254: the bound for each output
    half_step = (x.view(batch, -1, BLOCK).abs().amax(-1) / 254).repeat_interleave(BLOCK, 1).double()  # (batch, n)
    bound = half_step @ w.abs().T + 1e-4 * (x.double().abs() @ w.abs().T)  # + float32 rounding
    assert ((y.double() - exact).abs() <= bound).all()
    # and to the same integer arithmetic in float32, up to the order of the float sums
    xq, xd, xs = reference_quantized(x)
    sums = (unpacked(codes)[None] * xq.long()[:, None]).view(batch, rows, -1, BLOCK).sum(-1).float()
    reference = (d[None] * xd[:, None] * sums + m[None] * xs[:, None]).sum(-1)
    torch.testing.assert_close(y, reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_every_variant_gives_the_portable_ones_outputs(variant, bits):
    codes, scales, offsets = weights(50, 2048, seed=3, bits=bits)
    x = torch.randn(2, 2048)
    torch.testing.assert_close(kernels.matmul(x, codes, scales, offsets, variant=variant),
                               kernels.matmul(x, codes, scales, offsets, variant="portable"), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize(("batch", "n"), [(1, 32), (3, 96), (8, 288), (5, 2048)])
def test_the_avx512_variant_gives_the_avx2_ones_outputs_bit_for_bit(batch, n, bits):
    """AVX-512 VNNI takes two blocks at a time in 512-bit registers, the even blocks' and the odd ones' sums in the
    two halves, in AVX2's order: the same floats, bit for bit, at every block count (eight at once, then the rest)."""
    if not (kernels.available() and kernels.runs("avx512-vnni")):
        pytest.skip("this CPU does not run the AVX-512 VNNI variant")
    codes, scales, offsets = weights(40, n, seed=7, bits=bits)
    x = torch.randn(batch, n)
    assert torch.equal(kernels.matmul(x, codes, scales, offsets, variant="avx512-vnni"),
                       kernels.matmul(x, codes, scales, offsets, variant="avx2"))


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_a_row_in_a_batch_gets_what_it_gets_alone(variant, bits):
    """The kernel takes activation rows four at a time (the codes unpacked once for them): each row's arithmetic
    is the same, so a prompt's rows equal the same rows decoded one by one, bit for bit (cached = uncached)."""
    codes, scales, offsets = weights(24, 288, seed=5, bits=bits)  # 9 blocks: eight at once, then one alone
    x = torch.randn(7, 288)
    together = kernels.matmul(x, codes, scales, offsets, variant=variant)
    alone = torch.cat([kernels.matmul(row[None], codes, scales, offsets, variant=variant) for row in x])
    assert torch.equal(together, alone)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(("batch", "rows", "n"), [(1, 8, 32), (1, 19, 576), (3, 24, 96), (6, 13, 960)])
@pytest.mark.parametrize("threads", [1, 3])
def test_interleaved_rows_give_the_portable_row_products_bit_for_bit(variant, batch, rows, n, threads):
    """The decoding layout (eight rows' blocks together, each row's sum in its own lane) computes each row's float
    sum block by block, as the portable variant does the rows one after the other: every variant's product of the
    interleaved weights equals the portable one's of the same rows bit for bit, for row counts not a multiple of
    eight (a last group of fewer rows), any batch and thread count."""
    if not kernels.runs(variant):
        pytest.skip(f"this CPU does not run the {variant} variant")
    codes, scales, offsets = weights(rows, n, seed=rows + n)
    x = torch.randn(batch, n) * torch.logspace(-2, 2, n // BLOCK).repeat_interleave(BLOCK)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        y = kernels.matmul(x, *kernels.interleaved(codes, scales, offsets), rows=rows, variant=variant)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(y, kernels.matmul(x, codes, scales, offsets, variant="portable"))


def test_a_state_saved_with_rows_one_after_the_other_is_interleaved_on_loading():
    """A layer saved by a qkv that held the rows in the file's order loads into the interleaved layout: the same
    weights, the same products."""
    from qkv.kernel_layers import KernelInt4Linear

    torch.manual_seed(0)
    layer = KernelInt4Linear.from_linear(torch.nn.Linear(64, 12, bias=False))
    rows = kernels.read_rows(layer.codes, layer.group_scales, layer.offsets, torch.arange(12))
    saved = {"codes": rows[0].reshape(12, -1), "group_scales": rows[1], "offsets": rows[2]}
    loaded = KernelInt4Linear(64, 12)
    loaded.load_state_dict(saved)
    assert torch.equal(loaded.codes, layer.codes) and torch.equal(loaded.dequantized(), layer.dequantized())
    x = torch.randn(2, 64)
    assert torch.equal(loaded(x), layer(x))


def test_shapes_that_do_not_fit_are_named():
    codes, scales, offsets = weights(4, 64)
    with pytest.raises(ValueError, match=r"x must be \(batch, 64\)"):
        kernels.matmul(torch.randn(1, 32), codes, scales, offsets)
    with pytest.raises(ValueError, match=r"scales must be a contiguous CPU tensor \(4, 2\) of torch.float16"):
        kernels.matmul(torch.randn(1, 64), codes, scales.float(), offsets)
    with pytest.raises(ValueError, match=r"codes must be a contiguous CPU tensor \(4, 64\) of torch.int8"):
        kernels.matmul(torch.randn(1, 64), codes, scales)  # no offsets: 8-bit codes expected
    with pytest.raises(ValueError, match="a multiple of 32"):
        kernels.quantize_activations(torch.randn(1, 48))


# ------------------------------------------------------------------------------------- the layer, and without it


def test_the_kernels_layer_holds_a_files_blocks_exactly():
    """Q4_1 blocks (codes, fp16 d and m) written as the GGUF reader gives them (scales d and zero points m + 8 d,
    float32) are held exactly: the bytes, and d and m bit for bit, also extremes of fp16 (a subnormal scale, an
    offset of -65504, Q4_0's m = -8 d); the weights are q d + m; rows written from floats decode within half a
    step, and a product is the dequantized one within the int8 bound."""
    from qkv.kernel_layers import KernelInt4Linear

    torch.manual_seed(0)
    codes, d, m = weights(8, 96, seed=1)
    d[0, 0], m[0, 0], m[1, 0], m[2] = 2**-20, -65504, -8 * d[1, 0], 0
    ours = KernelInt4Linear(96, 19)  # three groups of eight rows, the last one with three
    ours.write_pairs(8, codes, 16, d.float(), m.float() + 8 * d.float())
    held = kernels.read_rows(ours.codes, ours.group_scales, ours.offsets, torch.arange(8, 16))
    assert torch.equal(held[0].view(8, -1), codes)
    assert torch.equal(held[1].view(torch.int16), d.view(torch.int16))
    assert torch.equal(held[2].view(torch.int16), m.view(torch.int16))
    assert torch.equal(ours.scales[8:16], d) and torch.equal(ours.zeros[8:16], m.float() + 8 * d.float())  # by row
    assert torch.equal(ours.codes[1], kernels.interleaved(codes, d, m)[0][0])  # the rows interleaved, as the kernel
    assert ours.codes.shape == (3, 3, 128) and not ours.codes[2].view(3, 4, 8, 4)[:, :, 3:].any()  # reads them
    levels = torch.cat([codes.view(8, 3, 16) & 15, codes.view(8, 3, 16) >> 4], -1).float()  # (rows, block, 32)
    assert torch.equal(ours.dequantized()[8:16], (levels * d.float()[..., None] + m.float()[..., None]).view(8, 96))
    out = torch.empty(5, 96)
    assert torch.equal(ours._decoded_rows(7, 12, out), ours.dequantized()[7:12])
    linear = torch.nn.Linear(96, 40)
    ours = KernelInt4Linear.from_linear(linear)
    steps = (linear.weight.view(40, 3, 32).amax(-1) - linear.weight.view(40, 3, 32).amin(-1)) / 15
    error = (ours.dequantized() - linear.weight).view(40, 3, 32).abs().amax(-1)
    assert (error <= steps * (0.5 + 2**-9)).all()  # half a step, and the fp16 rounding of scale and offset
    x = torch.randn(3, 96)
    with torch.no_grad():
        exact = x.double() @ ours.dequantized().double().T + linear.bias.double()
        half_step = (x.view(3, -1, BLOCK).abs().amax(-1) / 254).repeat_interleave(BLOCK, 1).double()
        assert ((ours(x).double() - exact).abs() <= half_step @ ours.dequantized().abs().double().T + 1e-4).all()
    with pytest.raises(ValueError, match="beyond fp16's range"):
        ours.write_rows(0, codes=torch.zeros(1, 96), scales=torch.full((1, 3), 1e5), zeros=torch.zeros(1, 3))


def test_pytorchs_kernels_are_chosen_when_asked_or_when_qkvs_is_missing(monkeypatch, caplog):
    """By default qkv's kernel layers wherever the library is built (int4 in groups of 32, int8 on whole blocks of
    32 inputs); QKV_KERNEL=torch, or a library that was not built: PyTorch's, the reason said once in one line."""
    from qkv.kernel_layers import KernelInt4Linear, KernelInt8Linear
    from qkv.quantize import _say_once, int4_class, int8_class
    from qkv.quantized import Int4Linear, Int8Linear

    monkeypatch.delenv("QKV_KERNEL", raising=False)
    assert int4_class(32) is KernelInt4Linear and int8_class(576) is KernelInt8Linear
    assert int4_class(64) is Int4Linear and int8_class(100) is Int8Linear  # groups or widths the kernel does not take
    monkeypatch.setenv("QKV_KERNEL", "torch")
    assert int4_class(32) is Int4Linear and int8_class(576) is Int8Linear
    assert kernels.in_use().endswith("(QKV_KERNEL=torch)")
    monkeypatch.setenv("QKV_KERNEL", "llama")
    with pytest.raises(ValueError, match="QKV_KERNEL must be auto, qkv, portable, avx2, avx512-vnni or torch, got "
                       "'llama'"):
        int4_class(32)
    monkeypatch.setenv("QKV_KERNEL", "qkv")
    assert kernels.in_use().startswith(f"kernel: qkv's, {kernels.best_variant()}")
    monkeypatch.setattr(kernels, "_HERE", kernels._HERE / "nothing-built-here")
    kernels._loaded.cache_clear()
    _say_once.cache_clear()
    try:
        with caplog.at_level("INFO"):
            assert int4_class(32) is Int4Linear and int8_class(576) is Int8Linear  # asked for, not there
        assert not kernels.available() and "was not built" in kernels.why_not()
        said = [r.getMessage() for r in caplog.records if "PyTorch's kernels" in r.getMessage()]
        assert said == ["qkv's kernel was not built when qkv was installed (no working C compiler then?); "
                        "quantized layers multiply with PyTorch's kernels"]
    finally:
        kernels._loaded.cache_clear()


def test_a_variant_can_be_named_where_the_cpu_runs_it(monkeypatch):
    """QKV_KERNEL=<variant>: the layers multiply with that variant (its numbers, its widening threshold); one this
    CPU does not run is refused in one line."""
    from qkv.kernel_layers import KernelInt4Linear, widen_rows

    layer = KernelInt4Linear(96, 8)
    layer.codes.copy_(torch.randint(0, 256, layer.codes.shape, generator=torch.Generator().manual_seed(0)))
    layer.group_scales.fill_(0.01)  # one group: eight rows, every lane real
    x = torch.randn(3, 96)
    monkeypatch.setenv("QKV_KERNEL", "portable")
    kernels._best.cache_clear()
    widen_rows.cache_clear()
    try:
        assert kernels.best_variant() == "portable" and widen_rows(4) == widen_rows(8) == 16
        assert torch.equal(layer(x), kernels.matmul(x, layer.codes, layer.group_scales, layer.offsets,
                                                    variant="portable"))
        monkeypatch.setenv("QKV_KERNEL", "avx512-vnni")
        monkeypatch.setattr(kernels, "runs", lambda variant: variant == "portable")
        kernels._best.cache_clear()
        with pytest.raises(ValueError, match="QKV_KERNEL=avx512-vnni: this CPU does not run that variant of qkv's "
                           r"kernel; choose portable$"):
            kernels.best_variant()
    finally:
        kernels._best.cache_clear()
        widen_rows.cache_clear()


def test_many_rows_take_the_widened_weights_with_the_same_numbers():
    """From widen_rows(4) rows on, the layer multiplies the int8-rounded inputs by its weights widened to float32 (a
    tile at a time): the widened weights are the reference's bit for bit, the rounded inputs the reference's
    codes times scales, and each output the one the kernel gives that row alone, up to float rounding."""
    from qkv.kernel_layers import KernelInt4Linear, widen_rows

    torch.manual_seed(0)
    layer = KernelInt4Linear.from_linear(torch.nn.Linear(96, 4100))  # more rows than one tile of widened weights
    out = torch.empty(layer.out_features, 96)
    assert torch.equal(kernels.dequantize(layer.codes, layer.group_scales, layer.offsets, 0, out), layer._decoded())
    assert torch.equal(kernels.dequantize(layer.codes, layer.group_scales, layer.offsets, 4091, out[:9]),
                       layer._decoded()[4091:])
    x = torch.randn(widen_rows(4) + 3, 96)
    xq, xd, _ = reference_quantized(x)
    assert torch.equal(kernels.rounded_activations(x), (xq.float().view(len(x), -1, BLOCK) * xd[..., None]).view_as(x))
    with torch.no_grad():
        together, alone = layer(x), torch.cat([layer(row[None]) for row in x])
    torch.testing.assert_close(together, alone, rtol=1e-5, atol=1e-5)


def test_an_install_without_a_c_compiler_runs_on_pytorchs_kernels(tmp_path):
    """``CC=false pip wheel .``: the install goes on without the library, and qkv, run from that wheel, multiplies
    its quantized layers with PyTorch's kernels and says why."""
    import subprocess
    import sys
    import zipfile
    from pathlib import Path

    from clitools import HANG

    root = Path(__file__).resolve().parents[1]
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(root),
                    "-w", str(tmp_path)], env={**os.environ, "CC": "false"}, check=True, capture_output=True,
                   timeout=HANG)
    (wheel,) = tmp_path.glob("qkv-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        assert not [n for n in archive.namelist() if "/_q4" in n]
        archive.extractall(tmp_path / "site")
    script = ("import torch, qkv.kernels as k; from qkv.quantize import quantize_linear; "
              "layer = quantize_linear(torch.nn.Linear(64, 8), 'int4'); "
              "print(k.available(), type(layer).__name__, tuple(layer(torch.randn(2, 64)).shape)); print(k.in_use())")
    env = {k: v for k, v in os.environ.items() if k != "QKV_KERNEL"}  # the default choice, whatever runs the tests
    run = subprocess.run([sys.executable, "-c", script], env={**env, "PYTHONPATH": str(tmp_path / "site")},
                         capture_output=True, text=True, check=True, timeout=HANG)
    said, in_use = run.stdout.splitlines()
    assert said == "False Int4Linear (2, 8)"
    assert "PyTorch's" in in_use and "was not built" in in_use


def test_a_quantized_model_on_the_kernel_compiles_whole_and_decodes_as_eager(monkeypatch):
    """Under ``torch.compile`` the kernel layers call the registered operator ``qkv::block_linear``: a decoding step
    of a LLaMA-shaped int4 model is one graph (no break at each product, where the library's ctypes call cannot be
    traced; the output layer's largest outputs, a count known only from the data, traced as ``--compile`` traces
    them), its tokens eager's. Inductor's graph of each kernel layer gives eager's numbers too."""
    from decoding_reference import continue_prompts

    from qkv import GPT, GPTConfig
    from qkv.kernel_layers import KernelInt4Linear, KernelInt8Linear
    from qkv.quantize import quantize

    monkeypatch.setenv("QKV_KERNEL", "qkv")
    torch.manual_seed(0)
    cfg = GPTConfig.from_preset("llama", vocab_size=100, d_model=64, n_heads=4, n_kv_heads=2, n_layers=1,
                                max_seq_len=64)
    model = quantize(GPT(cfg).eval(), "int4")
    assert isinstance(model.decoder.layers[0].feed_forward.down, KernelInt4Linear)
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12]]
    eager = continue_prompts(model, prompts, 8)
    torch._dynamo.reset()
    model.compile(dynamic=True, backend="aot_eager")
    counts = torch._dynamo.utils.counters
    counts.clear()
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        assert continue_prompts(model, prompts, 8) == eager
    assert not counts["graph_break"], dict(counts["graph_break"])
    x = torch.randn(3, 96)
    for layer in (KernelInt4Linear.from_linear(torch.nn.Linear(96, 40)),
                  KernelInt8Linear.from_linear(torch.nn.Linear(96, 40))):
        with torch.no_grad():
            torch.testing.assert_close(torch.compile(layer, fullgraph=True)(x), layer(x), rtol=0, atol=0)


def test_a_library_built_from_older_sources_is_refused_in_one_line(tmp_path, monkeypatch):
    """A rebuild that failed leaves the old library in place: one that lacks a function this qkv calls is not
    used (the Python runs instead), and the reason names what to do."""
    import shutil
    import subprocess

    if shutil.which("gcc") is None:
        pytest.skip("needs gcc to build a stand-in library")
    source = tmp_path / "old.c"
    source.write_text("int qkv_best_variant(void) { return 0; }\nint qkv_runs_variant(int v) { return v == 0; }\n")
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(tmp_path / "_q4.so"), str(source)], check=True)
    monkeypatch.setattr(kernels, "_HERE", tmp_path)
    kernels._loaded.cache_clear()
    try:
        library, why = kernels._loaded()
        assert library is None and "is older than this qkv" in why and "reinstall qkv" in why and "\n" not in why
    finally:
        kernels._loaded.cache_clear()
