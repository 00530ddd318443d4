"""Masked-language modelling: the 15% / 80-10-10 corruption measured on many tokens, packing, the task's
batches, and a tiny BERT that learns to fill in a predictable text."""

import math

import pytest
import torch

from qkv import BERTConfig
from qkv.models import BERTForMaskedLM
from qkv.tasks.masked_lm import IGNORE, MaskedLMTask, encode_for_mlm, fill_mask, mask_tokens, pack
from qkv.tokenizers import WordPieceTokenizer
from qkv.training import Trainer, TrainOptions

MASK, SPECIALS, VOCAB = 4, torch.arange(5), 1000


def _corrupt(seed=0, shape=(400, 128)):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, VOCAB, shape, generator=g)
    lengths = torch.randint(10, shape[1] + 1, (shape[0],), generator=g)
    real = torch.arange(shape[1])[None, :] < lengths[:, None]
    ids[:, 0], ids[torch.arange(shape[0]), lengths - 1] = 2, 3  # [CLS] ... [SEP]
    ids[~real] = 0  # padding
    maskable = real & ~torch.isin(ids, SPECIALS)
    replacements = torch.arange(5, VOCAB)
    inputs, labels = mask_tokens(ids, maskable=maskable, mask_id=MASK, replacements=replacements, generator=g)
    return ids, maskable, inputs, labels


def _within(observed: int, n: int, p: float, sigmas: float = 5.0) -> bool:
    return abs(observed - n * p) <= sigmas * math.sqrt(n * p * (1 - p))


def test_fifteen_percent_are_chosen_then_80_10_10():
    ids, maskable, inputs, labels = _corrupt()
    chosen = labels != IGNORE
    n, k = int(maskable.sum()), int(chosen.sum())
    assert n > 20_000 and _within(k, n, 0.15)
    assert torch.equal(labels[chosen], ids[chosen])  # the labels are the originals
    masked = chosen & (inputs == MASK)
    kept = chosen & (inputs == ids)
    randomized = chosen & (inputs != MASK) & (inputs != ids)
    assert _within(int(masked.sum()), k, 0.8)
    # A random token equals the original with probability 1/995; that share is counted as "kept".
    assert _within(int(randomized.sum()), k, 0.1 * (1 - 1 / 995))
    assert _within(int(kept.sum()), k, 0.1 + 0.1 / 995)


def test_special_tokens_and_padding_are_never_touched():
    ids, maskable, inputs, labels = _corrupt(seed=1)
    assert (labels[~maskable] == IGNORE).all()
    assert torch.equal(inputs[~maskable], ids[~maskable])
    changed = inputs != ids
    assert not torch.isin(inputs[changed & (inputs != MASK)], SPECIALS).any()  # random tokens are never special
    assert (changed <= (labels != IGNORE)).all()  # only chosen tokens change


def test_masking_is_reproducible_with_a_seed_and_differs_without():
    _, _, a, _ = _corrupt(seed=3)
    _, _, b, _ = _corrupt(seed=3)
    ids, maskable = _corrupt(seed=3)[:2]
    _, _, c, _ = (ids, maskable, *mask_tokens(ids, maskable=maskable, mask_id=MASK,
                                             replacements=torch.arange(5, VOCAB),
                                             generator=torch.Generator().manual_seed(4)))
    assert torch.equal(a, b) and not torch.equal(a, c)
    with pytest.raises(ValueError, match=r"probability must be in \(0, 1\)"):
        mask_tokens(ids, maskable=maskable, mask_id=MASK, replacements=torch.arange(5, VOCAB), probability=1.0)


def test_pack_cuts_one_stream():
    assert pack([[1, 2, 3], [4], [5, 6, 7, 8]], 3) == [[1, 2, 3], [4, 5, 6], [7, 8]]
    assert pack([], 3) == []


# A text where every hidden word can be read off the others: each line (one sequence of 30 tokens) repeats one word.
WORDS = ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]
LINES = [" ".join([WORDS[i % 10]] * 30) for i in range(200)]


@pytest.fixture(scope="module")
def tok():
    return WordPieceTokenizer.train(LINES, vocab_size=60, min_frequency=1)


def test_sequences_are_framed_and_fit(tok):
    sequences = encode_for_mlm(tok, [*LINES[:20], "", "  "], 16)
    assert all(s[0] == tok.cls_id and s[-1] == tok.sep_id and len(s) <= 16 for s in sequences)
    assert sum(len(s) - 2 for s in sequences) == sum(len(tok.encode(line)) for line in LINES[:20])


def _task(tok, seed=0):
    torch.manual_seed(seed)
    cfg = BERTConfig(vocab_size=tok.vocab_size, d_model=32, n_heads=2, n_layers=1, d_ff=64, max_seq_len=32,
                     dropout=0.0, pad_id=tok.pad_id)
    sequences = encode_for_mlm(tok, LINES, 32)
    return MaskedLMTask(BERTForMaskedLM(cfg), tok, sequences[:-20], sequences[-20:], batch_size=16, seed=seed)


def test_batches_are_a_function_of_seed_and_epoch(tok):
    a, b = _task(tok), _task(tok)
    assert all(torch.equal(x.inputs, y.inputs) for x, y in zip(a.batches(0), b.batches(0), strict=True))
    assert not torch.equal(a.batches(0)[0].labels, a.batches(1)[0].labels)  # a new masking every epoch
    batch = a.batches(0)[0]
    assert batch.n_tokens == int((batch.labels != IGNORE).sum()) > 0


def test_a_tiny_bert_learns_to_fill_in_the_numbers(tok, tmp_path):
    task = _task(tok)
    with torch.no_grad():
        before = task.evaluate(task.model)
    assert before["val_accuracy"] < 0.3
    opts = TrainOptions(out=str(tmp_path), max_steps=150, lr=1e-2, warmup=10, schedule="cosine", eval_every=150,
                        progress=False)
    result = Trainer(task, opts).run()
    after = result.last_eval
    assert after["val_loss"] < before["val_loss"] / 4 and after["val_accuracy"] > 0.9, (before, after)
    guesses = fill_mask(task.model, tok, "six six six [MASK] six six")[0]
    assert guesses[0][0] == "six" and guesses[0][1] > 0.5, guesses
    with pytest.raises(ValueError, match=r"no \[MASK\]"):
        fill_mask(task.model, tok, "three four")


def test_a_tokenizer_without_mask_is_refused(tok):
    from tokenizers import Tokenizer

    hf = Tokenizer.from_str(tok.hf.to_str())
    no_mask = WordPieceTokenizer(hf, specials={"mask": "[NOT-THERE]"})
    cfg = BERTConfig(vocab_size=tok.vocab_size, d_model=8, n_heads=2, n_layers=1, max_seq_len=8)
    with pytest.raises(ValueError, match=r"needs a \[MASK\] token"):
        MaskedLMTask(BERTForMaskedLM(cfg), no_mask, [[2, 5, 3]], [[2, 5, 3]], batch_size=1)
