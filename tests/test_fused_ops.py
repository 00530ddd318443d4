"""qkv's fused operations (``ops.c`` through ``qkv.kernels.ops``) against the Python they stand in for: RMSNorm (with
the residual summed in place), the gated activations, and a decoding step's attention (rotary positions of both
layouts, partial rotary, none; grouped key/value heads; a sliding window; a gate; rows of different lengths; a
cache that is a view of a longer one), on odd sizes and 1 to 4 threads; whole models decoding alike through them
and through the Python; and the Python taking over where they do not apply."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

from qkv import GPT, GPTConfig, kernels
from qkv.kernels import ops
from qkv.nn import KVCache, RMSNorm, StackedSelfAttention
from qkv.nn.feedforward import StackedFeedForward
from qkv.nn.position import RotaryEmbedding

pytestmark = pytest.mark.skipif(not kernels.available(), reason=f"qkv's kernel is not here: {kernels.why_not()}")


@pytest.fixture(params=[1, 2, 4], ids=lambda n: f"{n}threads")
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("n", [1, 7, 33, 576, 2049])
@pytest.mark.parametrize("unit_offset", [False, True])
def test_rms_norm_is_the_formula_and_sums_the_residual_first(n, unit_offset):
    torch.manual_seed(n)
    norm = RMSNorm(n, eps=1e-5, unit_offset=unit_offset)
    with torch.no_grad():
        norm.weight.normal_()
        x, add = torch.randn(3, 2, n) * 4, torch.randn(3, 2, n)
        expected = F.rms_norm(x + add, (n,), norm.gains(), 1e-5)
        before = x.clone()
        summed, out = ops.add_rms_norm(x, add, norm.gains(), 1e-5)
        assert torch.equal(summed, x + add) and torch.equal(x, before)  # summed as PyTorch sums, x left alone
        torch.testing.assert_close(out, expected, rtol=2e-6, atol=2e-6)
        torch.testing.assert_close(norm(x), F.rms_norm(x, (n,), norm.gains(), 1e-5), rtol=2e-6, atol=2e-6)
        assert torch.equal(norm(x), ops.rms_norm(x, norm.gains(), 1e-5))  # the module takes it here
        with ops.reference():
            assert torch.equal(norm(x), F.rms_norm(x, (n,), norm.gains(), 1e-5))


def test_offset_gains_kept_while_decoding_follow_the_weight():
    norm = RMSNorm(8, unit_offset=True)
    with torch.inference_mode():
        first = norm.gains()
        assert norm.gains() is first and torch.equal(first, torch.ones(8))  # made once while the weight stands
        with torch.no_grad():
            norm.weight.add_(0.5)  # written in place: made again
        assert torch.equal(norm.gains(), torch.full((8,), 1.5))
        norm.weight = torch.nn.Parameter(torch.full((8,), 2.0))  # another tensor: made again
        assert torch.equal(norm.gains(), torch.full((8,), 3.0))
    gains = norm.gains()  # outside inference mode: a new tensor a gradient flows through
    assert gains.requires_grad and not gains.is_inference()


@pytest.mark.parametrize("activation", ["swiglu", "geglu_tanh"])
@pytest.mark.parametrize("d", [1, 5, 64, 1537])
def test_the_gated_activations_are_pytorchs(activation, d, variant):
    torch.manual_seed(d)
    ffn = StackedFeedForward(16, d, activation=activation).eval()
    x = torch.randn(2, 3, 16)
    with torch.no_grad():
        gate_up = ffn.gate_up(x) * 3
        gate, up = gate_up.chunk(2, dim=-1)
        torch.testing.assert_close(ops.gated(gate_up, activation), ffn.act(gate) * up, rtol=4e-6, atol=4e-6)
        fused = ffn(x)
        with ops.reference():
            torch.testing.assert_close(fused, ffn(x), rtol=1e-5, atol=1e-6)


ATTENTION = {  # (heads, kv heads, head dim, rotary: None / "half" / "interleaved" / "partial", window, gated, scale)
    "mha-half": (4, 4, 16, "half", None, False, None),
    "gqa-half": (9, 3, 64, "half", None, False, None),
    "mqa-interleaved": (6, 1, 10, "interleaved", None, False, None),
    "partial": (4, 2, 32, "partial", None, False, 0.2),
    "no-rotary": (3, 3, 8, None, None, False, None),
    "window-gated": (4, 2, 16, "half", 5, True, None),
    "qk-norm": (4, 2, 16, "half", None, False, None, "heads"),  # Qwen3, Gemma 3: each head's queries and keys
    "qk-norm-whole": (4, 2, 16, "half", None, False, None, "whole"),  # OLMo 2: the whole projections
}


def _attention(heads, kv_heads, dim, rotary, window, gated, scale, qk_norm=None):
    torch.manual_seed(heads * 100 + dim)
    turn = None if rotary is None else RotaryEmbedding(dim, rotary_dim=dim // 2 if rotary == "partial" else None,
                                                       interleaved=rotary == "interleaved")
    norms = {}
    if qk_norm is not None:  # gains away from 1 (Gemma's 1 + w on the keys), so that a norm left out shows
        whole = qk_norm == "whole"
        norms = {"q_norm": RMSNorm(heads * dim if whole else dim, eps=1e-6),
                 "k_norm": RMSNorm(kv_heads * dim if whole else dim, eps=1e-6, unit_offset=True),
                 "qk_norm_whole": whole}
        for norm in (norms["q_norm"], norms["k_norm"]):
            torch.nn.init.uniform_(norm.weight, 0.5, 1.5)
    return StackedSelfAttention(heads * dim, heads, n_kv_heads=kv_heads, rotary=turn, head_dim=dim, causal=True,
                                window=window, gated=gated, scale=scale, **norms).eval()


def _decode(attention, prompt, steps, cache, starts=None):
    """The prompt read, then one token at a time: the outputs of the steps."""
    cache.starts = starts
    outs = []
    with torch.no_grad():
        attention(prompt[:, :-steps] if starts is None else prompt[:, :1], cache=cache)
        for t in range(prompt.size(1) - steps if starts is None else 1, prompt.size(1)):
            outs.append(attention(prompt[:, t : t + 1], cache=cache)[0])
    return torch.cat(outs, dim=1)


@pytest.fixture(params=kernels.VARIANTS)
def variant(request, monkeypatch):
    """Each instruction set's loops (the ones this CPU runs), as ``QKV_KERNEL`` chooses them."""
    if not kernels.runs(request.param):
        pytest.skip(f"this CPU does not run the {request.param} variant")
    monkeypatch.setenv("QKV_KERNEL", request.param)
    kernels._best.cache_clear()  # the choice is read once a process; again here, and again after
    request.addfinalizer(kernels._best.cache_clear)
    assert kernels.best_variant() == request.param
    return request.param


@pytest.mark.parametrize("rows", [1, 2])  # one row's queries and keys are normed in place
@pytest.mark.parametrize("case", ATTENTION)
def test_decoding_attention_is_the_modules_own(case, rows, threads, variant):
    attention = _attention(*ATTENTION[case])
    prompt = torch.randn(rows, 40, attention.d_model)  # 40 positions: the vector loops' whole registers and a rest
    fused_cache, python_cache = KVCache(), KVCache()
    fused = _decode(attention, prompt, 6, fused_cache)
    with ops.reference():
        python = _decode(attention, prompt, 6, python_cache)
    torch.testing.assert_close(fused, python, rtol=1e-5, atol=1e-5)
    assert len(fused_cache) == len(python_cache) == 40
    # rotary bit for bit; after a query/key norm, the keys to rounding (its mean of squares summed in another order
    # by qkv_rms_norm than by PyTorch's F.rms_norm)
    exact = 0 if len(ATTENTION[case]) < 8 else 1e-5
    torch.testing.assert_close(fused_cache.k, python_cache.k, rtol=exact, atol=exact)
    torch.testing.assert_close(fused_cache.v, python_cache.v, rtol=0, atol=0)


def test_rows_of_different_lengths_each_attend_as_alone():
    """A cache of rows that begin at different positions (continuous batching's ``starts``): each row's output is
    the one it has alone, through the fused step as through the Python."""
    attention = _attention(*ATTENTION["gqa-half"])
    rows = [torch.randn(1, n, attention.d_model) for n in (3, 7)]
    alone = []
    for row in rows:
        cache = KVCache()
        with torch.no_grad():
            attention(row, cache=cache)
            alone.append(attention(row[:, -1:] * 0.5, cache=cache)[0])
    together = KVCache()
    with torch.no_grad():
        first, second = KVCache(), KVCache()
        attention(rows[0], cache=first)
        attention(rows[1], cache=second)
        together.extend(first)
        together.extend(second)
        step = torch.cat([rows[0][:, -1:], rows[1][:, -1:]]) * 0.5
        positions = torch.tensor([[3], [7]])
        out = attention(step, cache=together, positions=positions)[0]
    torch.testing.assert_close(out, torch.cat(alone), rtol=1e-5, atol=1e-6)


def test_a_cache_that_is_a_view_of_a_longer_one():
    """After ``drop_left`` the cache is a view whose rows lie further apart than its length: read as such."""
    attention = _attention(*ATTENTION["gqa-half"])
    prompt = torch.randn(1, 10, attention.d_model)
    outs = []
    for way in (contextlib.nullcontext, ops.reference):  # the fused step, then the Python
        cache = KVCache()
        with torch.no_grad(), way():
            attention(prompt[:, :8], cache=cache)
            cache.drop_left(3)
            outs.append(attention(prompt[:, 8:9], cache=cache, positions=torch.tensor([8]))[0])
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", ["gqa-half", "mqa-interleaved", "partial", "window-gated", "no-rotary", "qk-norm"])
@pytest.mark.parametrize("ragged", [False, True], ids=["aligned", "ragged"])
def test_several_new_tokens_at_once_are_each_what_it_is_alone(case, ragged, variant):
    """Speculative decoding's check: seven new tokens a row in one call give, bit for bit, the attention and the
    cache of seven calls of one token (rows of different lengths too: ``starts``). (One token a call is held to the
    module's Python above.)"""
    attention = _attention(*ATTENTION[case])
    heads, kv_heads, dim = attention.n_heads, attention.n_kv_heads, attention.head_dim
    starts = torch.tensor([9, 0]) if ragged else None
    positions = torch.arange(12, 19) - (starts[:, None] if ragged else 0)
    with torch.no_grad():
        qkv = attention.qkv_proj(torch.randn(2, 7, attention.d_model)).contiguous()
    prefix = torch.randn(2, kv_heads, 12, dim), torch.randn(2, kv_heads, 12, dim)
    caches = []
    for _ in range(2):
        keys, values = torch.zeros(2, kv_heads, 24, dim), torch.zeros(2, kv_heads, 24, dim)
        keys[:, :, :12], values[:, :, :12] = prefix
        caches.append((keys, values))

    def call(part, where, length, cache):
        tables = None if attention.rotary is None else attention.rotary.cos_sin(where)
        rotary = dim if attention.rotary is None else attention.rotary.rotary_dim
        interleaved = attention.rotary is not None and attention.rotary.interleaved
        return ops.decode_attention(part.contiguous(), heads, kv_heads, dim, tables, rotary, interleaved, *cache,
                                    length, starts, attention.window, dim ** -0.5 if attention.scale is None else
                                    attention.scale, variant=variant)

    singles = torch.cat([call(qkv[:, j : j + 1], positions[..., j : j + 1], 12 + j, caches[0]) for j in range(7)], 1)
    together = call(qkv, positions, 12, caches[1])
    assert torch.equal(together, singles)
    assert all(torch.equal(a, b) for a, b in zip(caches[0], caches[1], strict=True))


@pytest.mark.parametrize("n", [7, 33, 577])
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_the_float_product_is_pytorchs(n, rows, threads, variant):
    """``x W^T + b`` of a few rows (a decoding step's), the output rows over 1 to 4 threads: PyTorch's to float
    rounding, with a bias and without."""
    torch.manual_seed(n + rows)
    x, w, b = torch.randn(rows, n), torch.randn(300, n), torch.randn(300)
    torch.testing.assert_close(ops.linear(x, w, b, variant=variant), F.linear(x, w, b), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(ops.linear(x[None], w, None, variant=variant), F.linear(x[None], w), rtol=1e-5,
                               atol=1e-4)


def test_a_float_layer_decodes_on_the_kernel_and_leaves_the_rest_to_pytorch(monkeypatch):
    """FloatLinear: a few rows without a gradient go to the kernel; more rows, a gradient or bf16 to PyTorch."""
    from qkv.nn.linear import FEW, FloatLinear

    layer = FloatLinear.adopt(torch.nn.Linear(40, 24))
    calls = []
    monkeypatch.setattr(ops, "linear", lambda *a, **k: calls.append(a[0].shape) or F.linear(*a[:3]))
    with torch.no_grad():
        layer(torch.randn(2, 1, 40))
        layer(torch.randn(FEW + 1, 40))
        layer.to(torch.bfloat16)(torch.randn(1, 40, dtype=torch.bfloat16))
    layer.float()(torch.randn(1, 40))  # a gradient to record
    assert calls == [(2, 1, 40)]
    assert type(torch.nn.Linear(2, 2)) is torch.nn.Linear  # adopting one layer changed no other


def test_a_full_cache_is_refused_not_overrun():
    qkv = torch.randn(1, 1, 3 * 8)
    keys = values = torch.zeros(1, 1, 4, 8)
    with pytest.raises(ValueError, match="no room"):
        ops.decode_attention(qkv, 1, 1, 8, None, 8, False, keys, values, 4, None, None, 1.0)


@pytest.mark.parametrize("options", [{}, {"activation": "geglu_tanh", "attention_scale": 0.3, "residual_scale": 0.7}],
                         ids=["llama", "geglu-scaled"])
def test_a_model_decodes_alike_through_them_and_through_the_python(options, monkeypatch):
    """Greedy tokens and logits of a small model held as the commands decode in float32 (qkv.quantize.float_layers),
    cached, the fused operations and products against the Python (and against no cache at all)."""
    calls = []
    for name in ("decode_attention", "gated", "rms_norm", "linear"):
        real = getattr(ops, name)
        monkeypatch.setattr(ops, name, lambda *a, real=real, name=name, **k: calls.append(name) or real(*a, **k))
    torch.manual_seed(0)
    config = GPTConfig.from_preset("llama", vocab_size=97, d_model=64, n_heads=4, n_kv_heads=2, n_layers=2, d_ff=96,
                                   max_seq_len=64, **options)
    from qkv.quantize import float_layers

    model = GPT(config).eval()
    float_layers(model)  # float32 as the commands decode with it: projections stacked, products on the kernel
    assert isinstance(model.decoder.layers[0].self_attn, StackedSelfAttention)
    prompt = torch.randint(0, 97, (2, 5))

    def greedy():
        cache, ids, logits = model.new_cache(), prompt, []
        with torch.no_grad():
            step = model(ids, cache=cache, last_only=True)
            for _ in range(8):
                logits.append(step[:, -1])
                ids = torch.cat([ids, step[:, -1].argmax(-1, keepdim=True)], dim=1)
                step = model(ids[:, -1:], cache=cache, last_only=True)
        return ids, torch.stack(logits)

    fused_ids, fused_logits = greedy()
    assert {"decode_attention", "gated", "rms_norm", "linear"} <= set(calls)  # each took its part
    with ops.reference():
        python_ids, python_logits = greedy()
    assert torch.equal(fused_ids, python_ids)
    torch.testing.assert_close(fused_logits, python_logits, rtol=1e-4, atol=1e-4)
    with torch.no_grad():
        uncached = model(fused_ids[:, :-1])[:, prompt.size(1) - 1 :].transpose(0, 1)
    torch.testing.assert_close(fused_logits, uncached, rtol=1e-4, atol=1e-4)


def test_the_python_runs_where_they_do_not_apply(monkeypatch):
    x = torch.randn(2, 8)
    with torch.no_grad():
        assert ops.applies(x)
        assert not ops.applies(x.double()) and not ops.applies(x.bfloat16())
        with ops.reference():
            assert not ops.applies(x)
        monkeypatch.setattr(ops, "_library", lambda: None)  # no library (no C compiler at install)
        assert not ops.applies(x)
    assert not ops.applies(x)  # gradients being recorded: training runs the Python


def test_both_doors_into_the_library_call_the_same_functions(monkeypatch):
    """The library's Python module (calls.c) and ctypes hand the same numbers to the same functions: every call a
    decoding step makes gives identical outputs through either; a wrong call through the module is a TypeError."""
    torch.manual_seed(0)
    x, gains = torch.randn(3, 40), torch.rand(40) + 0.5
    attention = _attention(*ATTENTION["window-gated"])
    qkv = torch.randn(2, 3, (4 + 2 * 2) * 16)
    tables = attention.rotary.cos_sin(torch.arange(9, 12))
    weights = torch.randn(24, 40)

    def everything():
        cache = torch.zeros(2, 2, 16, 16), torch.zeros(2, 2, 16, 16)
        return (ops.rms_norm(x, gains, 1e-5), *ops.add_rms_norm(x, x * 0.5, gains, 1e-6), ops.gated(x, "swiglu"),
                ops.decode_attention(qkv, 4, 2, 16, tables, 16, False, *cache, 9, torch.tensor([3, 0]), 5, 0.25),
                *cache, ops.linear(x, weights, gains[:24]))

    module = everything()
    assert type(kernels.calls()).__name__ == "module"
    with pytest.raises(TypeError, match="takes 8 arguments"):
        kernels.calls().rms_norm(1, 2)
    monkeypatch.setenv("QKV_CALLS", "ctypes")
    kernels.calls.cache_clear()
    try:
        assert type(kernels.calls()).__name__ == "_Ctypes"
        through_ctypes = everything()
    finally:
        monkeypatch.undo()
        kernels.calls.cache_clear()
    assert all(torch.equal(a, b) for a, b in zip(module, through_ctypes, strict=True))


@pytest.mark.parametrize("n", [1, 17, 100_003])
def test_trainings_gelu_and_its_gradient_are_pytorchs(n, threads, variant, monkeypatch):
    """GELU's tanh form (GPT-2's) and its gradient on qkv's own, over odd sizes (a rest after the vector loops; more
    than one chunk per thread): PyTorch's to float rounding; elsewhere (bf16, the reference) PyTorch's itself."""
    torch.manual_seed(n)
    x = (torch.randn(n) * 4).requires_grad_()
    grad = torch.randn(n)
    ours = ops.gelu_tanh(x)
    ours.backward(grad)
    ours_grad, x.grad = x.grad, None
    theirs = F.gelu(x, approximate="tanh")
    theirs.backward(grad)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours_grad, x.grad, rtol=1e-5, atol=1e-5)
    calls = []
    monkeypatch.setattr(ops, "_gelu_tanh", lambda *a: calls.append(a) or F.gelu(a[0], approximate="tanh"))
    ops.gelu_tanh(x.detach().bfloat16())
    with ops.reference():
        ops.gelu_tanh(x)
    assert not calls


def test_a_call_through_the_module_lets_other_threads_run():
    """As ctypes does, a call through the library's module releases Python's lock while it computes: a server's
    other threads (reading requests, serving a page) go on meanwhile. One long product on one thread; a thread that
    stamps the time must stamp well inside it (holding the lock, only at its edges)."""
    import threading
    import time

    door = kernels.calls()
    if type(door).__name__ != "module":
        pytest.skip("the library's module door is not built")
    w, x, y = torch.randn(4096, 4096), torch.randn(8, 4096), torch.empty(8, 4096)
    stamps, stop, started = [], threading.Event(), threading.Event()

    def stamp():
        started.set()
        while not stop.is_set():
            stamps.append(time.perf_counter())

    before_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    stamper = threading.Thread(target=stamp)
    stamper.start()
    started.wait()
    try:
        start = time.perf_counter()
        door.linear_f32(0, x.data_ptr(), 8, 4096, w.data_ptr(), None, 4096, y.data_ptr())  # portable: ~30 ms or more
        end = time.perf_counter()
    finally:
        stop.set()
        stamper.join()
        torch.set_num_threads(before_threads)
    margin = (end - start) / 4
    assert end - start > 0.01, "the call was too short to tell"
    assert any(start + margin < t < end - margin for t in stamps)
