"""What the explorer shows for one input: a model's attention weights as plain data for the page.

Every model kind runs once on the input, with ``return_attention=True``, and comes back as a *result*, a dict that
becomes the page's JSON:

    {"model": name, "kind": "encoder" | "lm" | "translation" | "image", "input": text,
     "views": [{"id", "title", "queries": [labels], "keys": [labels], "stepped": bool,
                "attention": [layer][head][query][key]}],
     "steps": None | {"first": the query row that wrote the first output token, "tokens": [labels],
                      "top": [[{"token", "p"}] per step]},
     "image": None | {"src": PNG data URL, "grid": [rows, columns] of patches, "first_patch": 1}}

* an encoder (BERT, all-MiniLM-L6-v2): one view, every token over every token;
* a language model (qkv's GPT, SmolLM2): the prompt continued greedily; one view over prompt and continuation
  (causal: zero above the diagonal), and each step's most likely next tokens;
* a translation Transformer: the greedy translation; the encoder's self-attention (source × source), the
  decoder's self-attention (target × target) and the cross-attention (target × source), and each step's
  candidates. The decoder's rows are computed from the whole output at once: with the causal mask, row *i* is
  what the decoder attended to when it wrote output *i* + 1, step by step;
* an image model (a ViT classifier, a CLIP's image tower): [CLS] and the patches over each other, the image
  for the page to lay a row's weights over the patches, and a classifier's most likely classes.

Weights are rounded to 4 decimals (the page shows 3): 30 layers × 9 heads × 64² positions is 1.1 million numbers.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn

from ..device import device_of
from ..options import NEW_TOKENS
from ..tokenizers import Tokenizer, token_label

MAX_TOKENS = 64  # longest input (tokens) and longest input + output of a language model
TOP_K = 5  # candidates shown per step


class InputError(ValueError):
    """An input the explorer cannot show: the page gets the message."""


def weights(layers: list[Tensor]) -> list:
    """Per-layer ``(1, H, Tq, Tk)`` attention -> nested lists ``[layer][head][query][key]``, 4 decimals."""
    stacked = torch.stack([layer[0] for layer in layers]).double()  # (L, H, Tq, Tk)
    return stacked.mul(1e4).round().div(1e4).tolist()


def _view(view_id: str, title: str, queries: list[str], keys: list[str], layers: list[Tensor], *,
          stepped: bool = False, kinds: list[str] | None = None) -> dict[str, Any]:
    return {"id": view_id, "title": title, "queries": queries, "keys": keys, "attention": weights(layers),
            "stepped": stepped, "layers": kinds}


def layer_kinds(model: nn.Module) -> list[str] | None:
    """What sets each layer of a language model apart, for the page: ``"local, window 512"``, ``"global"``, ``"no
    positions"`` (Gemma's local and global layers, SmolLM3's NoPE ones); None when every layer is alike."""
    config = getattr(model, "config", None)
    if not hasattr(config, "layer"):
        return None
    kinds = []
    for i in range(config.n_layers):
        spec = config.layer(i)
        kind = f"local, window {spec.window}" if spec.window else "global"
        kinds.append(kind if spec.rotary or config.positional != "rope" else f"{kind}, no positions")
    return kinds if len(set(kinds)) > 1 else None


def _check_length(n_tokens: int, limit: int, what: str) -> None:
    if n_tokens == 0:
        raise InputError(f"the {what} has no tokens: type a sentence")
    if n_tokens > limit:
        raise InputError(f"the {what} is {n_tokens} tokens long; the explorer shows at most {limit}: shorten it")


def _top(probs: Tensor, name: Callable[[int], str]) -> list[list[dict[str, Any]]]:
    """Each row's ``TOP_K`` most likely choices with their probabilities, ``probs (T, V)``; ``name`` labels one."""
    p, ids = probs.float().topk(min(TOP_K, probs.size(-1)), dim=-1)
    return [[{"token": name(i), "p": round(q, 4)} for q, i in zip(ps, row, strict=True)]
            for ps, row in zip(p.tolist(), ids.tolist(), strict=True)]


def _steps(logits: Tensor, tokenizer: Tokenizer, vocab_size: int, never: Collection[int]) -> list[list[dict[str, Any]]]:
    """Each row's most likely next tokens, ``logits (T, V)`` (columns past the vocabulary are padding), from the
    distribution decoding chooses from: the tokens it never writes (``never``: padding, <s>, <unk>) have no
    share of it."""
    logits = logits[:, :vocab_size].float()
    if never:
        logits = logits.index_fill(-1, torch.tensor(sorted(never), device=logits.device), float("-inf"))
    return _top(logits.softmax(-1), partial(token_label, tokenizer))


@torch.no_grad()
def encoder_result(model: nn.Module, tokenizer: Tokenizer, text: str, *, name: str,
                   max_length: int = MAX_TOKENS) -> dict[str, Any]:
    """A BERT's self-attention over one sentence, [CLS] and [SEP] included."""
    from ..tasks.embeddings import frame

    _check_length(len(tokenizer.encode(text)), min(max_length, MAX_TOKENS) - 2, "sentence")
    ids = frame(tokenizer, [text], max_length)[0]
    model.eval()
    attention = model(torch.tensor([ids], device=device_of(model)), return_attention=True).attention
    tokens = [token_label(tokenizer, i) for i in ids]
    return {"model": name, "kind": "encoder", "input": text, "steps": None, "image": None,
            "views": [_view("self", "Self-attention", tokens, tokens, attention)]}


@torch.no_grad()
def lm_result(model: nn.Module, tokenizer: Tokenizer, text: str, *, name: str, new_tokens: int = NEW_TOKENS,
              stop_ids: frozenset[int] = frozenset()) -> dict[str, Any]:
    """A language model's greedy continuation of ``text`` (qkv's decoding, with its KV cache), then one pass
    over prompt and continuation for the attention and each step's candidates."""
    from ..generation import LMDecoder, generate

    prompt = tokenizer.encode(text)
    _check_length(len(prompt), MAX_TOKENS - new_tokens, "prompt")
    model.eval()
    decoder = LMDecoder(model, [prompt])
    never = set(getattr(tokenizer, "special_ids", ())) - set(stop_ids)  # as qkv generate: see language_model.py
    output = generate(decoder, start=decoder.start, max_new_tokens=new_tokens, stop_ids=stop_ids,
                      suppress_ids=never)[0]
    ids = prompt + output
    logits, attention = model(torch.tensor([ids], device=device_of(model)), return_attention=True)
    tokens = [token_label(tokenizer, i) for i in ids]
    first = len(prompt) - 1  # the prompt's last token is the query that writes the first new one
    top = _steps(logits[0, first : len(ids) - 1], tokenizer, model.config.vocab_size, never)
    return {"model": name, "kind": "lm", "input": text, "image": None,
            "views": [_view("self", "Self-attention (causal)", tokens, tokens, attention, stepped=True,
                            kinds=layer_kinds(model))],
            "steps": {"first": first, "tokens": tokens[first + 1 :], "top": top}}


@torch.no_grad()
def translation_result(model: nn.Module, tokenizers: dict[str, Tokenizer], text: str, *,
                       name: str) -> dict[str, Any]:
    """A translation Transformer's greedy translation of ``text`` (qkv's decoding, with the model's own special
    ids: a Marian model's source ends with ``</s>`` and its translation starts from ``<pad>``), then one pass over
    the source and the translation for the three kinds of attention and each step's candidates."""
    from ..tasks.translation import position_limit, translate_ids, translation_ids

    ids = translation_ids(tokenizers)
    source = tokenizers["src"].encode(text)
    _check_length(len(source), min(MAX_TOKENS, (position_limit(model) or MAX_TOKENS) - 2) - ids.source_eos,
                  "sentence")
    output = translate_ids(model, [source], ids=ids)[0]
    source += [ids.eos] if ids.source_eos else []
    src = torch.tensor([source], device=device_of(model))
    tgt_in = torch.tensor([[ids.start, *output]], device=device_of(model))  # row i reads token i, writes i + 1
    logits, attention = model(src, tgt_in, return_attention=True)
    tgt = tokenizers["tgt"]
    src_labels = [token_label(tokenizers["src"], i) for i in source]
    written = [token_label(tgt, i) for i in output] + ["</s>"]
    read = [token_label(tgt, ids.start), *written[:-1]]
    top = _steps(logits[0], tgt, model.config.tgt_vocab_size, ids.never)
    return {"model": name, "kind": "translation", "input": text, "image": None,
            "views": [_view("encoder", "Encoder self-attention", src_labels, src_labels, attention["encoder"]),
                      _view("decoder", "Decoder self-attention", read, read, attention["decoder_self"], stepped=True),
                      _view("cross", "Cross-attention", read, src_labels, attention["decoder_cross"], stepped=True)],
            "steps": {"first": 0, "tokens": written, "top": top}}


@torch.no_grad()
def image_result(vit: nn.Module, pixels: Tensor, *, mean: list[float], std: list[float], name: str,
                 labels: list[str] | None = None, probs: Tensor | None = None) -> dict[str, Any]:
    """A ViT's self-attention over one image's [CLS] and patch tokens, the image itself (PNG) for the page to lay
    the weights over, and, for a classifier, its most likely classes.

    Args:
        vit: a :class:`~qkv.models.ViT` (a classifier's backbone or a CLIP's image tower).
        pixels: the image, uint8 ``(C, H, W)`` at the model's size.
        mean, std: the normalisation it was trained with.
        labels, probs: the classifier's class names and its probabilities for this image ``(n_classes,)``.
    """
    from ..images import normalize

    patch = vit.config.patch_size
    grid = [pixels.size(1) // patch, pixels.size(2) // patch]
    attention = vit(normalize(pixels[None].to(device_of(vit)), mean, std), return_attention=True).attention
    tokens = ["[CLS]"] + [f"{r},{c}" for r in range(grid[0]) for c in range(grid[1])]  # patches by row, column
    steps = None
    if labels is not None and probs is not None:
        top = _top(probs[None], labels.__getitem__)
        steps = {"first": 0, "tokens": [top[0][0]["token"]], "top": top}  # [CLS]'s row decides the class
    return {"model": name, "kind": "image", "input": "image", "steps": steps,
            "views": [_view("self", "Self-attention", tokens, tokens, attention)],
            "image": {"src": png_data_url(pixels), "grid": grid, "first_patch": 1}}


def png_data_url(pixels: Tensor) -> str:
    """uint8 ``(C, H, W)`` -> ``data:image/png;base64,...``."""
    import base64
    import io

    from PIL import Image

    array = pixels.permute(1, 2, 0).cpu().numpy()
    image = Image.fromarray(array[..., 0] if array.shape[2] == 1 else array)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")
