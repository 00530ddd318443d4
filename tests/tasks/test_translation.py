"""The translation task: what it does with empty input, which tokens it never writes, and how it picks the best
checkpoint when validation translates nothing."""

import torch

from qkv import Transformer, TransformerConfig
from qkv.tasks.translation import NOT_TEXT, ParallelData, TranslationTask, translate, translate_ids
from qkv.tokenizers import EOS_ID, CharTokenizer

TOK = CharTokenizer.train(["abcdefgh "])
TOKS = {"src": TOK, "tgt": TOK}


def model(**kw) -> Transformer:
    torch.manual_seed(0)
    return Transformer(TransformerConfig(src_vocab_size=TOK.vocab_size, tgt_vocab_size=TOK.vocab_size, d_model=32,
                                         n_heads=2, n_layers=1, d_ff=64, max_seq_len=40, **kw)).eval()


def test_empty_input_translates_to_an_empty_line_without_decoding(monkeypatch):
    """An untrained model would happily "translate" nothing into a long line; there is nothing to translate."""
    m = model()
    calls = []
    real = translate_ids

    def counting(model, sources, **kw):
        calls.append(len(sources))
        return real(model, sources, **kw)

    monkeypatch.setattr("qkv.tasks.translation.translate_ids", counting)
    out = translate(m, TOKS, ["", "abc", "", "dea"])
    assert out[0] == "" and out[2] == "" and calls == [2]


def test_tokens_that_are_never_text_are_never_written():
    """Even when <pad>, <s> and <unk> are by far the most likely next tokens, decoding writes none of them."""
    m = model()
    start = m.start_decoding

    def biased(src, *, use_cache=True):
        decoder = start(src, use_cache=use_cache)
        step = decoder.step

        def favour_specials(tokens):
            logits = step(tokens).clone()
            logits[:, list(NOT_TEXT)] += 100.0
            return logits

        decoder.step = favour_specials
        return decoder

    m.start_decoding = biased
    for beam in (1, 3):
        hyps = translate_ids(m, [[5, 6, 7], [8, 9]], beam_size=beam)
        assert all(h and not set(h) & set(NOT_TEXT) for h in hyps), hyps
    assert EOS_ID not in NOT_TEXT


def test_without_bleu_samples_the_loss_picks_the_best_checkpoint():
    pairs = [("abc", "cba"), ("dea", "aed"), ("fgh", "hgf")]
    data = ParallelData.encode(pairs, TOKS, max_len=10, name="train")
    task = TranslationTask(model(), TOKS, data, data, bleu_samples=0)
    assert (task.selection_metric, task.higher_is_better) == ("val_loss", False)
    assert set(task.evaluate(task.model)) == {"val_loss"}
    task = TranslationTask(model(), TOKS, data, data, bleu_samples=2)
    assert (task.selection_metric, task.higher_is_better) == ("val_bleu", True)
