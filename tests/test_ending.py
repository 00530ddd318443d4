"""Where a sequence ends (qkv.ending.take), the one rule generate and the continuous batch apply: a stop token
(never handed on), the receiver's word (a stop string), a complete constraint, or the limit; and generate's rows end
each on its own receiver's word, as the batch's do."""

import pytest
import torch
from decoding_reference import continue_prompts

from qkv import GPT, GPTConfig
from qkv.ending import take
from qkv.generation import LMDecoder, generate


class Done:
    """A constraint complete after ``after`` tokens."""

    def __init__(self, after: int) -> None:
        self.after, self.taken = after, []

    def take(self, token: int) -> None:
        self.taken.append(token)

    @property
    def done(self) -> bool:
        return len(self.taken) >= self.after


@pytest.mark.parametrize(("tokens", "kwargs", "why", "handed"), [
    ([5, 6], {}, None, [5, 6]),
    ([5, 6, 7], {}, "length", [5, 6, 7]),
    ([5, 2], {}, "stop", [5]),  # the stop token is no text: not handed on
    ([5, 2], {"limit": 2}, "stop", [5]),  # a stop token at the limit is a stop
    ([5, 9], {"says": 9}, "stop", [5, 9]),  # the receiver ends it (a stop string): the token was handed on
    ([5, 6], {"constraint": Done(2)}, "stop", [5, 6]),
])
def test_each_token_ends_the_sequence_or_not(tokens, kwargs, why, handed):
    seen, says, limit = [], kwargs.pop("says", None), kwargs.pop("limit", 3)
    out, ended = [], None
    for token in tokens:
        ended = take(out, token, stop_ids={2}, limit=limit, constraint=kwargs.get("constraint"),
                     on_token=lambda t: seen.append(t) or t == says)
    assert out == tokens and seen == handed and ended == why


def test_generate_ends_a_row_where_its_receiver_says_and_the_others_go_on():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=30, d_model=32, n_heads=4, n_layers=2, d_ff=64, dropout=0.0,
                          max_seq_len=64)).eval()
    prompts = [[4, 5, 6], [7, 8]]
    plain = continue_prompts(model, prompts, 12)
    decoder = LMDecoder(model, prompts)
    seen: dict[int, list[int]] = {0: [], 1: []}

    def on_token(row: int, token: int) -> bool:
        seen[row].append(token)
        return row == 0 and len(seen[0]) == 3

    out = generate(decoder, start=decoder.start, max_new_tokens=12, on_token=on_token)
    assert out == [plain[0][:3], plain[1]] and seen == {0: plain[0][:3], 1: plain[1]}
