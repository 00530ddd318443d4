"""``qkv tour``: a short walk through the pieces, printed as it runs."""

from __future__ import annotations

import argparse
import time

from .common import command
from .numbers import COUNT, SEED


def tour(args: argparse.Namespace) -> None:
    """A short walk through the pieces: attention by hand, the three model families (the decoder-only one in
    GPT-2 and LLaMA style), two invariants, and a Transformer learning to copy."""
    import torch

    torch.manual_seed(args.seed)
    _attention()
    models = _families()
    _invariants(models["GPT (decoder-only, LLaMA style)"].eval())
    _copy_task(args.steps)


def _attention() -> None:
    import torch

    from ..nn import causal_mask, scaled_dot_product_attention

    print("1. Scaled dot-product attention, softmax(QKᵀ/√d_k)·V, on 4 tokens with a causal mask")
    q, k, v = torch.randn(4, 8), torch.randn(4, 8), torch.randn(4, 8)
    _, weights = scaled_dot_product_attention(q, k, v, causal_mask(4))
    for row in weights:
        print("   " + "  ".join(f"{w:.2f}" for w in row.tolist()))
    print("   each row sums to 1; zeros above the diagonal are the future a decoder may not see\n")


def _families() -> dict:
    from .. import BERT, GPT, BERTConfig, GPTConfig, Transformer, TransformerConfig

    print("2. One architecture, three families: encoder-decoder, decoder-only (GPT-2 and LLaMA style), encoder-only")
    models = {
        "Transformer (encoder-decoder)": Transformer(TransformerConfig.from_preset("small", src_vocab_size=8000,
                                                                                   tgt_vocab_size=8000)),
        "GPT (decoder-only, GPT-2 style)": GPT(GPTConfig(vocab_size=8000, d_model=256, n_heads=8, n_layers=4)),
        "GPT (decoder-only, LLaMA style)": GPT(GPTConfig.from_preset("llama", vocab_size=8000, d_model=256, n_heads=8,
                                                                      n_kv_heads=2, n_layers=4)),
        "BERT (encoder-only)": BERT(BERTConfig(vocab_size=8000, d_model=256, n_heads=8, n_layers=4)),
    }
    for name, model in models.items():
        total, body = model.num_parameters(), model.num_parameters(exclude_embeddings=True)
        print(f"   {name:34s} {total / 1e6:6.2f}M parameters ({body / 1e6:.2f}M without embeddings)")
    _pretrained_families()
    return models


def _pretrained_families() -> None:
    from ..interop.families import FAMILIES

    print("   the pretrained families qkv reads (--pretrained), each LLaMA with a few blocks changed:")
    for fam in FAMILIES.values():
        print(f"     {fam.title:8s} {fam.differs}")


def _invariants(gpt) -> None:
    import torch

    print("\n3. Invariants, checked live")
    ids = torch.randint(0, 8000, (2, 24))
    with torch.no_grad():
        full = gpt(ids)
        cache = gpt.new_cache()
        steps = [gpt(ids[:, :8], cache=cache)] + [gpt(ids[:, t : t + 1], cache=cache) for t in range(8, 24)]
        print(f"   KV-cached decoding vs full forward: max |Δlogit| = {(torch.cat(steps, 1) - full).abs().max():.1e}")
        explicit, att = gpt(ids, return_attention=True)  # weights requested: the written-out attention runs
        print(f"   causal: attention above the diagonal = {att[0].triu(1).abs().max():.1e}; "
              f"explicit vs fused attention: max |Δlogit| = {(explicit - full).abs().max():.1e}")


def _copy_task(steps: int) -> None:
    import torch
    import torch.nn.functional as F

    from .. import Transformer, TransformerConfig

    print(f"\n4. A Transformer learns to copy random sequences ({steps} steps)")
    vocab, length, bos = 12, 10, 1
    model = Transformer(TransformerConfig(src_vocab_size=vocab, tgt_vocab_size=vocab, d_model=64, n_heads=4,
                                          n_layers=2, d_ff=128, dropout=0.0, max_seq_len=16))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    start = time.monotonic()
    for step in range(1, steps + 1):
        src = torch.randint(2, vocab, (64, length))
        tgt_in = torch.cat([torch.full((64, 1), bos), src[:, :-1]], 1)
        for group in opt.param_groups:
            group["lr"] = 3e-3 * min(1.0, step / 50)
        loss = F.cross_entropy(model(src, tgt_in).flatten(0, 1), src.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 50 == 0:
            print(f"   step {step:4d}  loss {loss.item():.4f}  ({time.monotonic() - start:.0f}s)")
    model.eval()
    src = torch.randint(2, vocab, (1, length))
    with torch.no_grad():
        memory, cache, ys = model.encode(src), model.new_cache(), torch.tensor([[bos]])
        for _ in range(length):  # greedy decoding with the KV cache
            ys = torch.cat([ys, model.decode(ys[:, -1:], memory, cache=cache)[:, -1:].argmax(-1)], 1)
    print(f"   source {src[0].tolist()}\n   copy   {ys[0, 1:].tolist()}")


def add_commands(sub) -> None:
    p = command(sub, "tour", "a short tour of the building blocks and models")
    p.add_argument("--steps", type=COUNT, default=250, help="training steps of the copy task (default 250)")
    p.add_argument("--seed", type=SEED, default=0)
    p.set_defaults(run=tour)
