"""A padded batch's real tokens run end to end (``real=``): the same logits and gradients as the padded batch, for
padding on either side and for packed rows, with stacked and quantized layers too; examples that begin alike
sharing those tokens (``copies=``) give the same again; and the arguments it cannot take are one-line errors."""

import pytest
import torch

from qkv import GPT, GPTConfig
from qkv.lora import LoRAConfig, add_lora
from qkv.nn import MultiHeadAttention
from qkv.nn.unpadded import first_in_rows, shared_tokens, spread, take, unpadded, zeros_at_padding
from qkv.quantize import quantize


def _model(**kw):
    torch.manual_seed(0)
    cfg = GPTConfig.from_preset("llama", vocab_size=64, n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, d_ff=64,
                                max_seq_len=64, **kw)
    return GPT(cfg)


def _batch(lengths, width, *, left=False):
    """Random ids ``(B, width)`` with rows of ``lengths`` real tokens, padded on the right (or left), and the
    mask of the real ones."""
    ids = torch.randint(1, 64, (len(lengths), width), generator=torch.Generator().manual_seed(width))
    real = torch.arange(width) < torch.tensor(lengths)[:, None]
    real = real.flip(1) if left else real
    return ids.masked_fill(~real, 0), real


def test_take_and_spread_undo_each_other():
    where = unpadded(torch.tensor([0, 1, 4, 5, 6]), (2, 4))
    x = torch.arange(8.0).view(2, 4, 1)
    assert take(where, x).flatten().tolist() == [0, 1, 4, 5, 6]
    assert zeros_at_padding(where, spread(where, take(where, x))).flatten().tolist() == [0, 1, 0, 0, 4, 5, 6, 0]
    assert where.real.tolist() == [[True, True, False, False], [True, True, True, False]]


def test_laying_tokens_out_in_rows_keeps_nothing_but_the_positions_for_the_backward_pass():
    """A projection's output laid out in rows must not be kept alive for the backward pass (index_copy keeps its
    source: 6 MB a layer at 1.7B and 256 tokens); what is kept is one index, a number a position."""
    where = unpadded(torch.arange(0, 200, 2), (2, 100))
    x = torch.randn(1, 100, 64, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        spread(where, x * 1).sum().backward()
    assert sum(saved) <= 200 + 1


@pytest.mark.parametrize("left", [False, True], ids=["right", "left"])
def test_real_tokens_alone_give_the_padded_batchs_logits_and_gradients(left):
    model = add_lora(_model(), LoRAConfig(rank=4)).train()
    for p in model.parameters():  # B away from zero: every adapter's gradient counts
        if p.requires_grad:
            torch.nn.init.normal_(p, std=0.05)
    ids, real = _batch([9, 4, 13], 13, left=left)
    index = real.flatten().nonzero().squeeze(1)
    learnt = index[index % 13 != 12]  # some real positions' logits, as a chat's answers
    results = []
    for kwargs in ({"attention_mask": real}, {"real": index}):
        model.zero_grad()
        logits = model(ids, logits_at=learnt, **kwargs)
        logits.square().mean().backward()
        results.append((logits, {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}))
    (padded, padded_grads), (alone, alone_grads) = results
    torch.testing.assert_close(alone, padded, atol=1e-5, rtol=1e-4)
    for name, grad in padded_grads.items():
        assert grad.abs().sum() > 0, name
        torch.testing.assert_close(alone_grads[name], grad, atol=1e-6, rtol=1e-4, msg=name)


@pytest.mark.parametrize("left", [False, True], ids=["right", "left"])
def test_packed_rows_with_padding_give_the_same_logits(left):
    """Segments (packed examples, positions restarting) and the padding beside them: every real position's
    logits."""
    model = _model().eval()
    ids, real = _batch([10, 6], 10, left=left)
    segments = torch.tensor([[0] * 4 + [1] * 6, [0] * 6 + [1, 2, 3, 4]])  # padding: one segment a token
    segments = torch.stack([segments[0], segments[1].roll(4)]) if left else segments
    index = real.flatten().nonzero().squeeze(1)
    with torch.no_grad():
        padded = model(ids, segments=segments)
        alone = model(ids, segments=segments, real=index)
    torch.testing.assert_close(alone[real], padded[real], atol=1e-5, rtol=1e-4)


def test_stacked_and_quantized_layers_run_on_the_real_tokens_alone():
    model = quantize(_model(), "int8").eval()
    ids, real = _batch([7, 12], 12)
    index = real.flatten().nonzero().squeeze(1)
    with torch.no_grad():
        padded = model(ids, attention_mask=real)
        alone = model(ids, real=index)
    torch.testing.assert_close(alone[real], padded[real], atol=1e-4, rtol=1e-3)


def test_an_attention_that_is_not_causal_masks_the_padding_itself():
    torch.manual_seed(0)
    attention = MultiHeadAttention(32, 4).eval()
    x = torch.randn(2, 6, 32)
    real = torch.tensor([[True] * 4 + [False] * 2, [True] * 6])
    where = unpadded(real.flatten().nonzero().squeeze(1), (2, 6))
    expected = attention(x, key_padding_mask=real)[0][real]
    torch.testing.assert_close(attention(take(where, x), unpadded=first_in_rows(where))[0][0], expected)


def test_positions_that_begin_alike_hold_one_token():
    """Two rows, the second of two packed examples; every example begins 5, 6 and the last two go on alike."""
    rows = [[[5, 6, 7]], [[5, 6, 8, 1], [5, 6, 7, 2]]]
    index, copies = shared_tokens(rows, 8)
    assert index.tolist() == [0, 1, 2, 10, 11, 15]  # 5, 6, 7 (row 0); 8, 1 (row 1); 2 (its second example)
    assert copies.tolist() == [[0, 1, 2, -1, -1, -1, -1, -1], [0, 1, 3, 4, 0, 1, 2, 5]]
    index, copies = shared_tokens(rows, 8, share=False)
    assert index.tolist() == [0, 1, 2, 8, 9, 10, 11, 12, 13, 14, 15]
    assert copies.tolist() == [[0, 1, 2, -1, -1, -1, -1, -1], [3, 4, 5, 6, 7, 8, 9, 10]]


def _shared_rows(packed):
    """Rows of examples that begin with the same six tokens (a system prompt), one an exact repeat of another;
    packed: several a row."""
    g = torch.Generator().manual_seed(1)
    start = torch.randint(1, 64, (6,), generator=g).tolist()
    examples = [start + torch.randint(1, 64, (n,), generator=g).tolist() for n in (3, 7, 1, 5)]
    examples.append(examples[1])
    return [examples[:2], examples[2:]] if packed else [[e] for e in examples]


@pytest.mark.parametrize("packed", [False, True], ids=["one-a-row", "packed"])
def test_shared_tokens_give_the_logits_and_gradients_of_every_copy(packed):
    from qkv.tasks.finetune import collate

    model = add_lora(_model(), LoRAConfig(rank=4)).train()
    for p in model.parameters():
        if p.requires_grad:
            torch.nn.init.normal_(p, std=0.05)
    results = []
    for share in (False, True):
        batch = collate([[_example(ids) for ids in row] for row in _shared_rows(packed)], 0, share=share)
        learnt = (batch.copies.flatten() >= 0).nonzero().squeeze(1)  # every real position, shared ones too
        model.zero_grad()
        logits = model(batch.ids, segments=batch.packed_segments, real=batch.real, copies=batch.copies,
                       logits_at=learnt)
        logits.square().mean().backward()
        results.append((batch.real.numel(), logits, {n: p.grad.clone() for n, p in model.named_parameters()
                                                     if p.requires_grad}))
    (apart, each_logits, each_grads), (shared, logits, grads) = results
    assert shared == apart - 4 * 6 - 7  # the beginning once, the repeat not at all
    torch.testing.assert_close(logits, each_logits, atol=1e-5, rtol=1e-4)
    for name, grad in each_grads.items():
        assert grad.abs().sum() > 0, name
        torch.testing.assert_close(grads[name], grad, atol=1e-6, rtol=1e-4, msg=name)


def _example(ids):
    from qkv.tasks.finetune import Example

    return Example(ids, [True] * len(ids))


def test_what_real_tokens_cannot_take_is_a_one_line_error():
    model = _model().eval()
    ids, real = _batch([3, 5], 5)
    index = real.flatten().nonzero().squeeze(1)
    for kwargs in ({"cache": model.new_cache()}, {"last_only": True}, {"return_attention": True},
                   {"attention_mask": real}):
        with pytest.raises(ValueError, match="real"):
            model(ids, real=index, **kwargs)
    with pytest.raises(ValueError, match="copies must come with real"):
        model(ids, copies=torch.zeros_like(ids))
