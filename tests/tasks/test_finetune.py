"""Fine-tuning data: packed rows give each example's own loss and gradients, nothing is attended across examples,
prompt/completion and plain text learn what they should, and bad lines are one-line errors naming the line."""

import json

import pytest
import torch

from qkv import GPT, GPTConfig
from qkv.data import DataError
from qkv.lora import LoRAConfig, add_lora
from qkv.nn import segment_positions
from qkv.tasks.finetune import IGNORE, Example, FineTuneTask, collate, fitting, held_out, pack, read_examples


class _Tokenizer:
    """Characters as ids, with a bos and an eos: enough for the data side."""

    bos_id, eos_id, pad_id, add_bos = 1, 2, 0, True

    def encode(self, text):
        return [3 + ord(c) % 60 for c in text]

    def encode_prompt(self, text):
        return [self.bos_id, *self.encode(text)]


def _model():
    torch.manual_seed(0)
    cfg = GPTConfig.from_preset("llama", vocab_size=64, n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, d_ff=64,
                                max_seq_len=64)
    return add_lora(GPT(cfg), LoRAConfig(rank=4))


def _examples(n=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(4, 12, (), generator=g))
        ids = torch.randint(3, 64, (length,), generator=g).tolist()
        learn = [i >= length // 2 for i in range(length)]
        out.append(Example(ids, learn))
    return out


def _loss_and_grads(task, model):
    model.zero_grad()
    total, n = 0.0, 0
    for batch in task.batches(0):
        loss, items = task.loss(model, batch)
        loss.backward()
        total, n = total + loss.item(), n + items
    return total, n, {k: p.grad.clone() for k, p in model.named_parameters() if p.requires_grad}


def test_packed_rows_give_the_loss_and_gradients_of_each_example_alone():
    examples = _examples()
    model = _model()
    for p in model.parameters():  # B away from zero, so that A's gradients are not all zero
        if p.requires_grad:
            torch.nn.init.normal_(p, std=0.05)
    results = []
    for packed in (True, False):
        task = FineTuneTask(model, _Tokenizer(), examples, examples[:1], context=32, batch_size=64, packed=packed)
        assert (len(task.rows) < 7) if packed else len(task.rows) == 7
        results.append(_loss_and_grads(task, model))
    (packed_loss, packed_n, packed_grads), (alone_loss, alone_n, alone_grads) = results
    assert packed_n == alone_n == sum(sum(e.learn[1:]) for e in examples)
    assert packed_loss == pytest.approx(alone_loss, rel=1e-5)
    for name, grad in packed_grads.items():
        assert grad.abs().sum() > 0, name
        torch.testing.assert_close(grad, alone_grads[name], rtol=1e-4, atol=1e-6)


def test_no_token_attends_across_examples_and_positions_restart():
    a, b = _examples(2, seed=1)
    batch = collate(pack([a, b], 32), pad_id=0)
    la, lb = len(a.ids), len(b.ids)
    assert segment_positions(batch.segments)[0, : la + lb].tolist() == [*range(la), *range(lb)]
    model = _model().eval()
    changed = batch.ids.clone()
    changed[0, :la] = (changed[0, :la] + 1) % 64  # another first example
    with torch.no_grad():
        before = model(batch.ids, segments=batch.segments)
        after = model(changed, segments=batch.segments)
    second = slice(la, la + lb)
    torch.testing.assert_close(after[0, second], before[0, second], rtol=0, atol=0)
    assert not torch.allclose(after[0, :la], before[0, :la])


def test_targets_are_the_next_tokens_that_are_learnt():
    batch = collate([[Example([5, 6, 7, 8], [False, False, True, True])]], pad_id=0)
    assert batch.targets[0].tolist() == [IGNORE, 7, 8, IGNORE]
    assert batch.n_tokens == 2


def test_prompt_completion_learns_the_completion_and_its_end(tmp_path):
    path = tmp_path / "pc.jsonl"
    path.write_text(json.dumps({"prompt": "ab", "completion": "cd"}) + "\n\n", encoding="utf-8")
    [example] = read_examples(path, _Tokenizer(), None)
    tok = _Tokenizer()
    assert example.ids == [1, *tok.encode("ab"), *tok.encode("cd"), 2]
    assert example.learn == [False, False, False, True, True, True]


def test_plain_text_is_learnt_whole_and_cut_to_the_context(tmp_path):
    from qkv.tasks.finetune import split_text

    path = tmp_path / "text.txt"
    path.write_text("x" * 50, encoding="utf-8")
    examples = split_text(read_examples(path, _Tokenizer(), None), 16)
    assert [len(e.ids) for e in examples] == [16, 16, 16, 3] and all(all(e.learn) for e in examples)


@pytest.mark.parametrize(("line", "message"), [
    ("{not json", "line 2 is not valid JSON"),
    ('{"text": "x"}', "line 2: expected an object with \"messages\""),
    ('{"messages": [{"role": "user", "content": "hi"}]}', "line 2: a chat example, but the model has no chat "
                                                          "template"),
])
def test_a_bad_line_is_one_error_naming_its_number(tmp_path, line, message):
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps({"prompt": "a", "completion": "b"}) + "\n" + line + "\n", encoding="utf-8")
    with pytest.raises(DataError, match="line") as err:
        read_examples(path, _Tokenizer(), None)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_an_error_quotes_at_most_80_characters_of_the_input_and_its_length(tmp_path):
    from qkv.chat import chat_training_ids

    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps({"text": "x" * 2_000_000}) + "\n", encoding="utf-8")
    with pytest.raises(DataError) as err:
        read_examples(path, _Tokenizer(), None)
    assert len(str(err.value)) < 400 and "characters)" in str(err.value)  # the path, the words, 80 quoted
    with pytest.raises(ValueError) as err:  # a role of 2 MB
        chat_training_ids("{{ x }}", [{"role": "r" * 2_000_000, "content": "hi"}], _Tokenizer())
    assert len(str(err.value)) < 300 and "2,000,002 characters" in str(err.value)


def test_examples_longer_than_the_context_are_dropped_and_counted(caplog):
    examples = [Example([3] * 10, [True] * 10), Example([3] * 40, [True] * 40)]
    with caplog.at_level("WARNING"):
        assert fitting(examples, 16, "data.jsonl") == examples[:1]
    assert "1 of 2 examples dropped (1 longer than the context of 16 tokens" in caplog.text
    with pytest.raises(DataError, match="every example is longer than the context of 8 tokens"):
        fitting(examples, 8, "data.jsonl")


def test_a_held_out_split_is_fixed_by_the_seed_and_leaves_both_sides_some():
    examples = _examples(20)
    train, valid = held_out(examples, 0.1, seed=3)
    assert len(valid) == 2 and len(train) == 18
    assert held_out(examples, 0.1, seed=3) == (train, valid)
    assert all(e not in train for e in valid)
    with pytest.raises(DataError, match="too few"):
        held_out(examples[:1], 0.1, seed=0)


def test_the_logits_of_the_learnt_positions_are_those_of_the_whole_rows():
    model = _model().eval()
    batch = collate(pack(_examples(5), 32), pad_id=0)
    learnt = (batch.targets.flatten() != IGNORE).nonzero().squeeze(1)
    with torch.no_grad():
        whole = model(batch.ids, segments=batch.segments).flatten(0, 1)
        some = model(batch.ids, segments=batch.segments, logits_at=learnt)
    assert some.shape == (batch.n_tokens, 64)
    torch.testing.assert_close(some, whole[learnt], rtol=0, atol=0)
