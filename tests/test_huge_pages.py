"""A decoding model's weights moved into huge pages: the same outputs, the same parameters (tied ones still tied),
qkv's kernel layers and experts reading their weights where they now lie; nothing moved where the system offers no
huge pages."""

import pytest
import torch

from qkv import GPT, GPTConfig, huge_pages
from qkv.quantize import float_layers, quantize


def model(tied: bool, experts: bool = False) -> GPT:
    torch.manual_seed(0)
    extra = {"n_experts": 4, "expert_top_k": 2, "expert_d_ff": 64} if experts else {}
    cfg = GPTConfig.from_preset("llama", vocab_size=96, d_model=64, n_heads=4, n_kv_heads=2, n_layers=2, d_ff=128,
                                max_seq_len=32, tie_embeddings=tied, **extra)
    return GPT(cfg).eval()


def greedy(m: GPT) -> tuple[torch.Tensor, torch.Tensor]:
    ids, cache, logits = torch.tensor([[3, 5, 7, 9]]), m.new_cache(), []
    with torch.no_grad():
        step = m(ids, cache=cache, last_only=True)
        for _ in range(6):
            logits.append(step[:, -1])
            ids = torch.cat([ids, step[:, -1].argmax(-1, keepdim=True)], dim=1)
            step = m(ids[:, -1:], cache=cache, last_only=True)
    return ids, torch.stack(logits)


@pytest.mark.parametrize("held", ["float32", "int4", "int4-experts"])
def test_moved_weights_give_the_same_numbers(held, monkeypatch):
    monkeypatch.setattr(huge_pages, "SMALLEST", 1)  # a small model's tensors are all below the real threshold
    monkeypatch.setattr(huge_pages, "offered", lambda: True)
    m = model(tied=held == "float32", experts=held.endswith("experts"))
    float_layers(m) if held == "float32" else quantize(m, "int4")
    before = greedy(m)
    parameters = dict(m.named_parameters())
    moved = huge_pages.into_huge_pages(m)
    assert moved > 0
    # the kernel calls bound to the old addresses are dropped, to be made again where the weights now lie (freed
    # memory still holds the old numbers for a while: the outputs alone could not tell)
    assert all(x.__dict__.get("_product") is None and x.__dict__.get("_decode") is None for x in m.modules())
    after = greedy(m)
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])
    assert all(p is parameters[name] for name, p in m.named_parameters())  # the same parameters, new storage
    if held == "float32":
        assert m.lm_head.weight.data_ptr() == m.tok_emb.weight.data_ptr()  # tied: one copy, as before
    pointers = sorted(t.data_ptr() for t in [*m.parameters(), *m.buffers()] if t.numel())
    assert pointers[-1] - pointers[0] < moved  # all of them in the one region


def test_nothing_moves_where_huge_pages_are_not_offered(monkeypatch):
    monkeypatch.setattr(huge_pages, "SMALLEST", 1)
    monkeypatch.setattr(huge_pages, "offered", lambda: False)
    m = model(tied=False)
    pointers = [p.data_ptr() for p in m.parameters()]
    assert huge_pages.into_huge_pages(m) == 0
    assert [p.data_ptr() for p in m.parameters()] == pointers


def test_the_largest_tensors_become_huge_pages_where_they_lie(monkeypatch):
    """A tensor of LARGE bytes or more is not copied (its copy would double the peak for a moment): its own memory is
    collapsed into huge pages (MADV_COLLAPSE), the numbers unchanged; where the system refuses, it stays as it was."""
    if not huge_pages.offered():
        pytest.skip("this system offers no transparent huge pages")
    monkeypatch.setattr(huge_pages, "LARGE", 1 << 20)
    torch.manual_seed(0)
    cfg = GPTConfig.from_preset("llama", vocab_size=16384, d_model=64, n_heads=4, n_kv_heads=2, n_layers=1, d_ff=128,
                                max_seq_len=32)
    m = GPT(cfg).eval()  # a 4 MB token table (and output layer)
    collapsed = []
    real = huge_pages._collapse
    monkeypatch.setattr(huge_pages, "_collapse", lambda a, n: collapsed.append(n) or real(a, n))
    before, table = greedy(m), m.tok_emb.weight.data_ptr()
    huge_pages.into_huge_pages(m)
    assert collapsed and min(collapsed) >= 1 << 20
    if real(table, 4 << 20):  # the system collapses memory in place (Linux 6.1 on)
        assert m.tok_emb.weight.data_ptr() == table  # not copied
    after = greedy(m)
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])
