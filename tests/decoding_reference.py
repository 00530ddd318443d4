"""Decoding the slow, obvious way: the references that greedy and beam search are checked against; and
:func:`continue_prompts`, qkv's own decoding of a language model in one call, for the tests that compare it
across settings (cached or not, compiled, quantized, on another device).

Imported as ``from decoding_reference import ...`` by tests here and in subfolders: pytest puts ``tests/`` on
``sys.path`` because the ``conftest.py`` there is not inside a package.
"""

from collections.abc import Callable, Collection

import torch
from torch import Tensor, nn

from qkv.generation import LMDecoder, generate, length_penalty
from qkv.tokenizers import BOS_ID, EOS_ID


def continue_prompts(model: nn.Module, prompts: list[list[int]], n: int, *, use_cache: bool = True,
                     **kwargs) -> list[list[int]]:
    """``n`` new tokens for each prompt, the prompts left-padded into one batch (greedy unless ``kwargs`` say
    otherwise: see :func:`qkv.generation.generate`)."""
    decoder = LMDecoder(model, prompts, use_cache=use_cache)
    return generate(decoder, start=decoder.start, max_new_tokens=n, **kwargs)


@torch.no_grad()
def reference_greedy(model: nn.Module, src: list[int], steps: int, *, bos_id: int = BOS_ID, eos_id: int = EOS_ID,
                     suppress_ids: Collection[int] = ()) -> list[int]:
    """Greedy decoding of an encoder-decoder: rerun the whole model on the whole prefix at every step and take
    the most probable token (never one of ``suppress_ids``). Returns the tokens without ``<s>`` and ``</s>``."""
    ys = [bos_id]
    for _ in range(steps):
        logits = model(torch.tensor([src]), torch.tensor([ys]))[0, -1]  # (V,)
        if suppress_ids:
            logits[list(suppress_ids)] = float("-inf")
        ys.append(int(logits.argmax()))
        if ys[-1] == eos_id:
            break
    out = ys[1:]
    return out[: out.index(eos_id)] if eos_id in out else out


def exhaustive_search(logprobs: Callable[[tuple[int, ...]], Tensor], *, max_len: int, eos_id: int,
                      alpha: float = 0.0) -> list[tuple[float, list[int]]]:
    """Every hypothesis beam search can return, with the score it ranks them by, best first.

    A hypothesis ends at its first ``eos_id`` (counted, as its log-probability is) or is cut at ``max_len``
    tokens; its score is its total log-probability divided by lp(n) = ((5 + n) / 6)^α, n its number of tokens.

    Args:
        logprobs: the prefix generated so far -> log-probabilities ``(V,)`` of the next token.

    Returns:
        ``(score, tokens without eos)`` for every hypothesis, highest score first.
    """
    done: list[tuple[float, list[int]]] = []

    def extend(prefix: tuple[int, ...], total: float) -> None:
        for token, lp in enumerate(logprobs(prefix).double().tolist()):
            hyp, score = (*prefix, token), total + lp
            if token == eos_id or len(hyp) == max_len:
                norm = length_penalty(torch.tensor(float(len(hyp))), alpha).item()
                done.append((score / norm, list(hyp[:-1] if token == eos_id else hyp)))
            else:
                extend(hyp, score)

    extend((), 0.0)
    return sorted(done, key=lambda d: d[0], reverse=True)


def reference_beam_search(logprobs: Callable[[tuple[int, ...]], Tensor], *, beam_size: int, max_len: int, eos_id: int,
                          alpha: float = 0.0) -> list[int]:
    """Beam search for one input, written out with lists: at every step each unfinished hypothesis is extended by
    every token, a finished one (ended by ``eos_id`` or cut at ``max_len`` tokens) is carried as it is, and the
    ``beam_size`` best by score / lp(length) survive (scores and lengths as in :func:`exhaustive_search`).

    Returns:
        the best hypothesis, without ``eos_id``.
    """

    def normalised(hyp: tuple[tuple[int, ...], float, bool]) -> float:
        return hyp[1] / length_penalty(torch.tensor(float(len(hyp[0]))), alpha).item()

    beam: list[tuple[tuple[int, ...], float, bool]] = [((), 0.0, False)]  # (tokens, log-probability, finished)
    while not all(done for _, _, done in beam):
        candidates = [hyp for hyp in beam if hyp[2]]
        for tokens, score, done in beam:
            if not done:
                for token, lp in enumerate(logprobs(tokens).double().tolist()):
                    grown = (*tokens, token)
                    candidates.append((grown, score + lp, token == eos_id or len(grown) == max_len))
        beam = sorted(candidates, key=normalised, reverse=True)[:beam_size]
    tokens = max(beam, key=normalised)[0]
    return list(tokens[:-1] if tokens[-1] == eos_id else tokens)
