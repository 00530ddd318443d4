"""BERT's heads: the masked-LM head (parity with transformers' BertForMaskedLM), the classifier, and both saved
and loaded as checkpoints."""

import pytest
import torch

from qkv.checkpoint import load_checkpoint, save_checkpoint
from qkv.config import BERTClassifierConfig, BERTConfig
from qkv.interop import bert_config_from_hf, bert_state_dict_from_hf
from qkv.models import BERTClassifier, BERTForMaskedLM, mean_pool
from qkv.tokenizers import WordPieceTokenizer

VOCAB = 60


def _cfg(**overrides):
    return BERTConfig(**{"vocab_size": VOCAB, "d_model": 32, "n_heads": 4, "n_layers": 2, "d_ff": 64,
                         "max_seq_len": 16, "dropout": 0.0, **overrides})


def test_mlm_head_matches_transformers_bert_for_masked_lm():
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, num_hidden_layers=2,
                                     intermediate_size=64, max_position_embeddings=16, attn_implementation="eager")
    hf = transformers.BertForMaskedLM(config).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    state = hf.state_dict()
    cfg = bert_config_from_hf(config.to_dict())
    cfg.pooler = False  # BertForMaskedLM has none
    model = BERTForMaskedLM(cfg).eval()
    model.bert.load_state_dict(bert_state_dict_from_hf(state, cfg), strict=True)
    head = "cls.predictions."
    model.head.load_state_dict({
        "dense.weight": state[head + "transform.dense.weight"],
        "dense.bias": state[head + "transform.dense.bias"],
        "norm.weight": state[head + "transform.LayerNorm.weight"],
        "norm.bias": state[head + "transform.LayerNorm.bias"],
        "bias": state[head + "bias"],
    }, strict=True)
    torch.testing.assert_close(state[head + "decoder.weight"], model.bert.tok_emb.weight, rtol=0, atol=0)  # tied
    ids = torch.randint(1, VOCAB, (2, 10))
    mask = torch.tensor([[1] * 10, [1] * 6 + [0] * 4])
    with torch.no_grad():
        ours, theirs = model(ids, attention_mask=mask), hf(ids, attention_mask=mask).logits
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


def test_mlm_scores_only_the_selected_positions_and_shares_the_embedding():
    model = BERTForMaskedLM(_cfg()).eval()
    ids = torch.randint(1, VOCAB, (2, 8))
    select = torch.zeros(2, 8, dtype=torch.bool)
    select[0, 3] = select[1, 0] = select[1, 7] = True
    full = model(ids)
    assert full.shape == (2, 8, VOCAB)
    torch.testing.assert_close(model(ids, select=select), full[select])
    assert "head.decoder.weight" not in dict(model.named_parameters())  # the output matrix is tok_emb
    model(ids, select=select).sum().backward()
    assert model.bert.tok_emb.weight.grad.abs().sum() > 0


def test_classifier_pools_cls_or_mean_and_ignores_padding():
    for pooling in ("pooler", "mean"):
        model = BERTClassifier(BERTClassifierConfig(**_cfg().to_dict(), n_labels=3, pooling=pooling)).eval()
        ids = torch.randint(1, VOCAB, (2, 9))
        ids[1, 5:] = 0  # padding
        logits = model(ids)
        assert logits.shape == (2, 3)
        torch.testing.assert_close(logits[1], model(ids[1:, :5])[0], atol=1e-5, rtol=1e-5)
    hidden, mask = torch.randn(1, 3, 4), torch.tensor([[1, 1, 0]])
    torch.testing.assert_close(mean_pool(hidden, mask), hidden[:, :2].mean(1))


@pytest.mark.parametrize(("fields", "message"), [
    (dict(n_labels=1), "n_labels must be >= 2"),
    (dict(n_labels=2, pooling="max"), "pooling must be one of"),
    (dict(n_labels=2, pooler=False), "pooling='pooler' needs pooler=True"),
])
def test_classifier_config_is_checked(fields, message):
    with pytest.raises(ValueError, match=message):
        BERTClassifierConfig(**{**_cfg().to_dict(), **fields})


@pytest.mark.parametrize("arch", ["bert-mlm", "bert-classifier"])
def test_heads_save_and_load_as_checkpoints(tmp_path, arch):
    tok = WordPieceTokenizer.train(["a few words to learn from"] * 3, vocab_size=VOCAB, min_frequency=1)
    if arch == "bert-mlm":
        model = BERTForMaskedLM(_cfg(vocab_size=tok.vocab_size))
    else:
        model = BERTClassifier(BERTClassifierConfig(**_cfg(vocab_size=tok.vocab_size).to_dict(), n_labels=2))
    model.eval()
    save_checkpoint(tmp_path / "ckpt", model, tokenizers={"text": tok}, meta={"labels": ["a", "b"]})
    ckpt = load_checkpoint(tmp_path / "ckpt")
    assert ckpt.arch == arch and type(ckpt.model) is type(model) and ckpt.meta["labels"] == ["a", "b"]
    ids = torch.randint(1, tok.vocab_size, (2, 7))
    with torch.no_grad():
        torch.testing.assert_close(ckpt.model(ids), model(ids), rtol=0, atol=0)
    assert ckpt.tokenizers["text"].encode("a few words") == tok.encode("a few words")
