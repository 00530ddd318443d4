"""Greedy decoding, token by token, in qkv and in a transformers reference: the parity tests' common loop.

Imported by name (``from hf_greedy import ...``): pytest's default "prepend" import mode puts the folder of
each test module (``tests/interop``, which has no ``__init__.py``) first on ``sys.path``. Every folder of the
test tree shares that path, so this module's name must be unique across it.
"""

from __future__ import annotations

import torch


def greedy_qkv(model, prompt: torch.Tensor, steps: int) -> torch.Tensor:
    """Prompt once, then one token at a time through qkv's KV cache; returns the ``(B, steps)`` new tokens."""
    cache = model.new_cache()
    logits = model(prompt, cache=cache)
    tokens = []
    for _ in range(steps):
        next_id = logits[:, -1].argmax(-1, keepdim=True)  # (B, 1)
        tokens.append(next_id)
        logits = model(next_id, cache=cache)
    return torch.cat(tokens, dim=1)


def greedy_uncached(model, prompt: torch.Tensor, steps: int) -> torch.Tensor:
    """qkv's ``(B, steps)`` greedy tokens with no cache: the whole sequence again at every step."""
    ids = prompt
    with torch.no_grad():
        for _ in range(steps):
            ids = torch.cat([ids, model(ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[:, prompt.size(1) :]


def greedy_hf(hf, prompt: torch.Tensor, steps: int, *, use_cache: bool = False) -> torch.Tensor:
    """The reference's ``(B, steps)`` greedy tokens.

    By default it reruns the whole sequence at every step, so no cache is involved and qkv's cached decoding
    is checked against plain forward passes. ``use_cache=True`` goes through transformers' own cache instead:
    the same tokens, faster, for long continuations of a real model.
    """
    if not use_cache:
        ids = prompt
        for _ in range(steps):
            ids = torch.cat((ids, hf(ids).logits[:, -1].argmax(-1, keepdim=True)), dim=1)
        return ids[:, prompt.size(1):]
    out = hf(prompt, use_cache=True)
    tokens = []
    for _ in range(steps):
        next_id = out.logits[:, -1].argmax(-1, keepdim=True)  # (B, 1)
        tokens.append(next_id)
        # transformers 5 renames the cache `cache` family by family (the old name warns, and goes in 5.40)
        cached = {"cache": out["cache"]} if "cache" in out else {"past_key_values": out.past_key_values}
        out = hf(next_id, **cached, use_cache=True)
    return torch.cat(tokens, dim=1)
