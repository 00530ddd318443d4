"""torch.compile gives the same numbers as eager PyTorch, for every model family, on the CPU; and the forward
has no graph break (no value read back from the device: see ``check_ids``)."""

import pytest
import torch
from decoding_reference import continue_prompts

from qkv import BERT, GPT, BERTConfig, GPTConfig, LSTMSeq2Seq, RNNConfig, Transformer, TransformerConfig

pytestmark = pytest.mark.slow  # compiling takes seconds per model


def _families():
    yield "gpt2", GPT(GPTConfig(vocab_size=100, d_model=32, n_heads=2, n_layers=2, max_seq_len=32)), \
        (torch.randint(0, 100, (2, 16)),), True
    yield "llama", GPT(GPTConfig.from_preset("llama", vocab_size=100, d_model=32, n_heads=4, n_kv_heads=2,
                                             n_layers=2, max_seq_len=32)), (torch.randint(0, 100, (2, 16)),), True
    src, tgt = torch.randint(1, 50, (2, 9)), torch.randint(1, 50, (2, 7))
    src[1, 6:] = 0  # padding: the masked path, not only the causal one
    # with the speedruns' ReLU² and QK-norm
    yield "transformer", Transformer(TransformerConfig(src_vocab_size=50, tgt_vocab_size=50, d_model=32, n_heads=2,
                                                       n_layers=1, d_ff=64, max_seq_len=32, activation="relu2",
                                                       qk_norm=True)), (src, tgt), True
    yield "bert", BERT(BERTConfig(vocab_size=60, d_model=32, n_heads=2, n_layers=1, d_ff=64, max_seq_len=32)), \
        (torch.randint(1, 60, (2, 11)),), True
    # nn.LSTM over packed sequences reads lengths on the host: compiled in pieces, still equal
    yield "lstm", LSTMSeq2Seq(RNNConfig(src_vocab_size=50, tgt_vocab_size=50, embedding_dim=16, hidden_size=32,
                                        n_layers=1, attention="additive")), (src, tgt), False


@pytest.mark.parametrize("name, model, inputs, fullgraph", [pytest.param(*f, id=f[0]) for f in _families()])
def test_compiled_equals_eager(name, model, inputs, fullgraph):
    torch._dynamo.reset()
    model.eval()
    with torch.no_grad():
        eager = model(*inputs)
        compiled = torch.compile(model, fullgraph=fullgraph)(*inputs)
    torch.testing.assert_close(compiled, eager, atol=2e-5, rtol=1e-4)


def test_a_compiled_training_step_equals_an_eager_one():
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=100, d_model=32, n_heads=2, n_layers=2, max_seq_len=32)
    eager, compiled = GPT(cfg), GPT(cfg)
    compiled.load_state_dict(eager.state_dict())
    compiled.compile()
    ids = torch.randint(0, 100, (4, 17))
    for model in (eager, compiled):
        logits = model(ids[:, :-1])
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()).backward()
    for (name, a), b in zip(eager.named_parameters(), compiled.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.parametrize("prompts", [[[5, 6, 7, 8, 9, 10], [11, 12]], [[5, 6, 7, 8, 9, 10]]], ids=["padded", "alone"])
def test_compiled_cached_decoding_equals_eager(prompts):
    """Decoding compiles with dynamic shapes: left-padded prompts (the masked path) or one prompt (the fused
    kernel's own causal mask), then one token at a time into the preallocated KV cache (rotary positions, grouped
    key/value heads); the same tokens as eager, and one graph for the prompt and one for every later step, not
    one per step.

    Graphs and graph breaks are TorchDynamo's and the traced operations AOTAutograd's, so this runs on the
    ``aot_eager`` backend; the kernels Inductor writes are compared with eager above (a cold Inductor compile
    of two dynamic-shape graphs takes minutes on 2 cores)."""
    torch.manual_seed(0)
    cfg = GPTConfig.from_preset("llama", vocab_size=100, d_model=32, n_heads=4, n_kv_heads=2, n_layers=2,
                                max_seq_len=64)
    model = GPT(cfg).eval()
    eager = continue_prompts(model, prompts, 20)
    torch._dynamo.reset()
    model.compile(dynamic=True, backend="aot_eager")
    counts = torch._dynamo.utils.counters
    counts.clear()
    assert continue_prompts(model, prompts, 20) == eager
    assert not counts["graph_break"], dict(counts["graph_break"])  # whole steps compiled, not pieces
    assert counts["stats"]["unique_graphs"] <= 2  # the prompt (empty cache) and every later step
