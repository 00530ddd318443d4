"""qkv's models out of qkv: Hugging Face folders that ``transformers`` loads with no code of qkv's or custom code.

    qkv export --model RUN --format hf --out DIR

    DIR/config.json              the family's config, with the class transformers builds ("architectures")
    DIR/model.safetensors        the weights, under the family's names and in its layouts
    DIR/tokenizer.json           the tokenizer, as the ``tokenizers`` library writes it
    DIR/tokenizer_config.json    its special tokens (and a chat template, when one is given)
    DIR/generation_config.json   the ids that start, end and pad a text

Each family's names are the inverse of the reader qkv already has (:mod:`qkv.interop.hf_gpt`,
:mod:`~qkv.interop.hf_bert`, :mod:`~qkv.interop.hf_vit`, :mod:`~qkv.interop.hf_marian` read these folders too),
and the export checks itself with that reader: the config and every tensor read back must be the
model's own, or nothing is written.

Tokenizers: a BPE vocabulary (qkv's, or a pretrained model's) is a ``tokenizers`` object already and is written
as it is. A character vocabulary becomes a BPE model with no merges and no pre-tokenizer: each character is one
token, an unknown one ``<unk>``, and decoding fuses the characters back, exactly as qkv's
:class:`~qkv.tokenizers.CharTokenizer` does. A pretrained tokenizer that starts prompts with ``bos``
(``add_bos``) gets a post-processor that does so, as transformers' encode expects.

The folder is written beside ``DIR`` and renamed into place: an interrupted export leaves no half folder, and an
existing ``DIR`` with anything in it is never touched.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..files import check_out, write_atomically
from ..models import BERT, GPT, BERTClassifier, Transformer, ViT, ViTClassifier
from ..tokenizers import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    SPECIALS,
    UNK_ID,
    BPETokenizer,
    CharTokenizer,
    PretrainedTokenizer,
    WordPieceTokenizer,
)

log = logging.getLogger(__name__)


def export_hf(model: nn.Module, tokenizer, out: str | Path, *, chat_template: str | None = None,
              labels: Sequence[str] | None = None) -> Path:
    """Write ``model`` and its tokenizer as a Hugging Face folder ``out`` (see the module's text).

    Args:
        model: a :class:`~qkv.models.GPT` (GPT-2- or LLaMA-style); a :class:`~qkv.models.BERT` or its classifier
            on the pooler; a :class:`~qkv.models.ViT` or its classifier; or a :class:`~qkv.models.Transformer`
            that Marian's configuration holds (Post-Norm, sines-then-cosines positions).
        tokenizer: the GPT's tokenizer (qkv's BPE or character tokenizer, or a pretrained model's); the BERT's
            WordPiece; None for a ViT; the Transformer's ``{"src": ..., "tgt": ...}`` (a Marian folder's, or one
            qkv tokenizer for both sides).
        out: a folder that does not exist yet, or an empty one.
        chat_template: a Jinja chat template for ``tokenizer_config.json`` (None: the model has none).
        labels: a classifier's class names, in the order of its outputs (None: ``LABEL_0``, ...).

    Returns:
        ``out``.

    Raises:
        ValueError: a model with no Hugging Face equivalent (its fields named), a tokenizer that does not fit
            it, or an ``out`` that exists and is not an empty folder.
    """
    out = Path(out)
    check_out(out, "folder")
    check_float(model)
    if isinstance(model, GPT):
        files = _gpt_files(model, tokenizer, chat_template)
    elif isinstance(model, Transformer):
        files = _marian_files(model, tokenizer)
    elif isinstance(model, (BERT, BERTClassifier)):
        files = _bert_files(model, tokenizer, labels)
    elif isinstance(model, (ViT, ViTClassifier)):
        files = _vit_files(model, labels)
    else:
        raise ValueError(f"qkv exports GPTs, BERTs, ViTs and Marian-shaped Transformers to Hugging Face folders; a "
                         f"{type(model).__name__} has no exporter")
    write_atomically(out, lambda folder: _write(folder, files), folder=True)
    config = files["config.json"]
    log.info("wrote %s: a %s (%s weights) that transformers loads with its own classes", out,
             config["architectures"][0], f"{sum(t.numel() for t in files['model.safetensors'].values()):,}")
    return out


def _gpt_files(model: GPT, tokenizer, chat_template: str | None) -> dict[str, Any]:
    from .hf_gpt import gpt_config_from_hf, gpt_config_to_hf, gpt_state_dict_from_hf, gpt_state_dict_to_hf

    cfg = model.config
    config = gpt_config_to_hf(cfg)
    tensors = gpt_state_dict_to_hf(model.state_dict(), cfg)
    _check_read_back(model, gpt_state_dict_from_hf(tensors, gpt_config_from_hf(config), config["model_type"]))
    tokenizer_json, specials = hf_tokenizer(tokenizer)
    check_size(tokenizer_json.get_vocab_size(with_added_tokens=True), cfg.vocab_size,
               spare_rows=isinstance(tokenizer, PretrainedTokenizer))
    ids = {f"{role}_token_id": tokenizer_json.token_to_id(token) for role, token in specials.items() if role != "unk"}
    tokenizer_config = _fast_tokenizer_config(specials, cfg.max_seq_len)
    if chat_template is not None:
        tokenizer_config["chat_template"] = chat_template
    return {"model.safetensors": tensors, "config.json": config | ids | {"torch_dtype": _dtype(tensors)},
            "generation_config.json": ids, "tokenizer_config.json": tokenizer_config, "tokenizer.json": tokenizer_json}


def _marian_files(model: Transformer, tokenizers) -> dict[str, Any]:
    """A ``MarianMTModel`` folder: Marian's SentencePiece files for a Marian model's tokenizers, a
    ``tokenizer.json`` for one qkv tokenizer shared by both sides."""
    from ..tasks.translation import translation_ids
    from .hf_marian import (
        MarianTokenizer,
        marian_config_from_hf,
        marian_config_to_hf,
        marian_state_dict_from_hf,
        marian_state_dict_to_hf,
    )

    if not isinstance(tokenizers, dict) or set(tokenizers) != {"src", "tgt"}:
        raise ValueError("a translation model exports with its two tokenizers: {'src': ..., 'tgt': ...}")
    cfg, ids = model.config, translation_ids(tokenizers)
    config = marian_config_to_hf(cfg, ids)
    tensors = marian_state_dict_to_hf(model.state_dict(), cfg)
    _check_read_back(model, marian_state_dict_from_hf(tensors, marian_config_from_hf(config)))
    src, tgt = tokenizers["src"], tokenizers["tgt"]
    check_size(src.vocab_size, cfg.src_vocab_size)
    check_size(tgt.vocab_size, cfg.tgt_vocab_size)
    generation = {k: config[k] for k in ("decoder_start_token_id", "eos_token_id", "pad_token_id",
                                         "forced_eos_token_id", "bad_words_ids")} | {"max_length": cfg.max_seq_len}
    files = {"model.safetensors": tensors, "config.json": config | {"torch_dtype": _dtype(tensors)},
             "generation_config.json": generation}
    if isinstance(src, MarianTokenizer) and isinstance(tgt, MarianTokenizer):
        separate = src.vocab != tgt.vocab
        files |= {"source.spm": src.spm_model, "target.spm": tgt.spm_model, "vocab.json": src.vocab,
                  "tokenizer_config.json": {"tokenizer_class": "MarianTokenizer", "separate_vocabs": separate,
                                            "model_max_length": cfg.max_seq_len}}
        return files | ({"target_vocab.json": tgt.vocab} if separate else {})
    if src.to_dict() != tgt.to_dict():
        raise ValueError("a translation model with two vocabularies of qkv's exports only with Marian's "
                         "SentencePiece tokenizers; train it with one shared vocabulary")
    tokenizer_json, specials = hf_tokenizer(src)
    return files | {"tokenizer.json": tokenizer_json,
                    "tokenizer_config.json": _fast_tokenizer_config(specials, cfg.max_seq_len)}


def _bert_files(model: BERT | BERTClassifier, tokenizer, labels: Sequence[str] | None) -> dict[str, Any]:
    """A ``BertModel`` folder, or a ``BertForSequenceClassification`` one for a classifier on the pooler."""
    from .hf_bert import bert_config_from_hf, bert_config_to_hf, bert_state_dict_from_hf, bert_state_dict_to_hf

    if not isinstance(tokenizer, WordPieceTokenizer):
        raise ValueError(f"a BERT exports with its WordPiece tokenizer, not a {type(tokenizer).__name__}")
    classifier = isinstance(model, BERTClassifier)
    bert, cfg = (model.bert if classifier else model), model.config
    if classifier and cfg.pooling != "pooler":
        raise ValueError("BertForSequenceClassification classifies BERT's pooled [CLS]; a classifier on the mean of "
                         "the token states (pooling='mean') has no Hugging Face class")
    config = bert_config_to_hf(cfg)
    tensors = bert_state_dict_to_hf(bert.state_dict(), cfg, prefix="bert." if classifier else "")
    back = bert_config_from_hf(config)
    back.pooler = cfg.pooler
    _check_read_back(bert, bert_state_dict_from_hf(tensors, back))
    check_size(tokenizer.vocab_size, cfg.vocab_size)
    if classifier:
        config, tensors = _with_classifier(config, tensors, model.classifier, labels, cfg.n_labels,
                                           "BertForSequenceClassification")
    tokenizer_json, specials = hf_tokenizer(tokenizer)
    return {"model.safetensors": tensors, "config.json": config | {"torch_dtype": _dtype(tensors)},
            "tokenizer.json": tokenizer_json,
            "tokenizer_config.json": _fast_tokenizer_config(specials, cfg.max_seq_len)}


def _vit_files(model: ViT | ViTClassifier, labels: Sequence[str] | None) -> dict[str, Any]:
    """A ``ViTModel`` folder, or a ``ViTForImageClassification`` one; the images are what the model reads
    (``pixel_values``, normalised as it was trained), so no image processor is written."""
    from .hf_vit import vit_config_from_hf, vit_config_to_hf, vit_state_dict_from_hf, vit_state_dict_to_hf

    classifier = isinstance(model, ViTClassifier)
    vit, cfg = (model.vit if classifier else model), model.config
    config = vit_config_to_hf(cfg)
    tensors = vit_state_dict_to_hf(vit.state_dict(), cfg, prefix="vit." if classifier else "")
    _check_read_back(vit, vit_state_dict_from_hf(tensors, vit_config_from_hf(config)))
    if classifier:
        config, tensors = _with_classifier(config, tensors, model.head, labels, cfg.n_classes,
                                           "ViTForImageClassification")
    return {"model.safetensors": tensors, "config.json": config | {"torch_dtype": _dtype(tensors)}}


def _fast_tokenizer_config(specials: dict[str, str], max_length: int) -> dict[str, Any]:
    """``tokenizer_config.json`` for a ``tokenizer.json``: transformers' generic fast tokenizer, the special tokens
    by role (``bos_token``, ``pad_token``, ``cls_token``, ...), the longest text the model reads."""
    return {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
            "model_max_length": max_length, **{f"{role}_token": token for role, token in specials.items()}}


def _with_classifier(config: dict[str, Any], tensors: dict[str, torch.Tensor], head: nn.Linear,
                     labels: Sequence[str] | None, n: int, architecture: str):
    """A backbone's config and tensors with a classification layer, ``classifier.*``, and its labels."""
    names = list(labels) if labels is not None else [f"LABEL_{i}" for i in range(n)]
    if len(names) != n:
        raise ValueError(f"{len(names)} labels for a classifier of {n} classes")
    tensors = tensors | {f"classifier.{p}": t.detach().contiguous().clone() for p, t in head.state_dict().items()}
    return config | {"architectures": [architecture], "id2label": dict(enumerate(names)),
                     "label2id": {name: i for i, name in enumerate(names)}}, tensors


def check_float(model: nn.Module) -> None:
    """Exports write float weights: a model whose layers qkv keeps quantized (int8/int4) is refused, saying
    how to load it in float."""
    from ..quantized import QuantizedEmbedding, QuantizedLinear

    if any(isinstance(m, (QuantizedLinear, QuantizedEmbedding)) for m in model.modules()):
        raise ValueError("this model's layers are quantized (int8/int4); export a float model: load it with "
                         "--quantize none (load_pretrained(..., weights='none'))")


def _check_read_back(model: nn.Module, back: dict[str, torch.Tensor]) -> None:
    """The export read back by qkv's own reader must be the model (tables cut to the vocabulary aside; a zero
    bias the model lacks, such as Marian's logits bias, adds nothing)."""
    state = model.state_dict()
    added = {name for name, t in back.items() if name not in state and not t.any()}
    changed = [name for name, t in back.items() if name not in added and (
        name not in state or not torch.equal(t, state[name][: len(t)]))]
    if changed or set(back) - added != set(state):
        raise RuntimeError(f"the export does not read back as the model ({changed[:3]}); a bug in qkv's exporter")


def _dtype(tensors: dict[str, torch.Tensor]) -> str:
    """config.json's ``torch_dtype``: what most of the weights are stored as ("float32", "bfloat16")."""
    return str(max(tensors.values(), key=torch.Tensor.numel).dtype).removeprefix("torch.")


def check_size(tokens: int, rows: int, *, spare_rows: bool = False) -> None:
    """A tokenizer of ``tokens`` tokens for a model of ``rows`` embeddings: they must be the same size, or (a
    pretrained model's, ``spare_rows``) the table may have rows no token uses, as published models' often do."""
    if tokens > rows or (tokens != rows and not spare_rows):
        raise ValueError(f"the tokenizer has {tokens} tokens and the model {rows}: they were not trained together")


def _write(folder: Path, files: dict[str, Any]) -> None:
    from safetensors.torch import save_file

    for name, content in files.items():
        if name.endswith(".safetensors"):
            save_file(content, str(folder / name), metadata={"format": "pt"})
        elif isinstance(content, bytes):
            (folder / name).write_bytes(content)
        elif isinstance(content, dict):
            (folder / name).write_text(json.dumps(content, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        else:  # a tokenizers.Tokenizer
            content.save(str(folder / name))


def hf_tokenizer(tokenizer):
    """(``tokenizers.Tokenizer``, special tokens by role: bos, eos, pad, unk) of a qkv tokenizer."""
    from tokenizers import Tokenizer, decoders, models, processors

    if isinstance(tokenizer, CharTokenizer):
        hf = Tokenizer(models.BPE(vocab=dict(tokenizer.stoi), merges=[], unk_token=SPECIALS[UNK_ID]))
        hf.decoder = decoders.Fuse()
    elif isinstance(tokenizer, (BPETokenizer, PretrainedTokenizer, WordPieceTokenizer)):
        hf = Tokenizer.from_str(tokenizer.hf.to_str())  # a copy: the post-processor below is the export's
    else:
        raise ValueError(f"a {type(tokenizer).__name__} has no Hugging Face tokenizer.json here")
    if isinstance(tokenizer, WordPieceTokenizer):  # a sentence framed as qkv's wrap() frames it
        cls, sep = tokenizer.specials["cls"], tokenizer.specials["sep"]
        hf.post_processor = processors.TemplateProcessing(
            single=f"{cls} $A {sep}", pair=f"{cls} $A {sep} $B:1 {sep}:1",
            special_tokens=[(cls, tokenizer.cls_id), (sep, tokenizer.sep_id)])
        return hf, {role: token for role, token in tokenizer.specials.items() if hf.token_to_id(token) is not None}
    if not isinstance(tokenizer, PretrainedTokenizer):
        return hf, {role: SPECIALS[i] for role, i in (("bos", BOS_ID), ("eos", EOS_ID), ("pad", PAD_ID),
                                                       ("unk", UNK_ID))}
    specials = {role: hf.id_to_token(i) for role, i in (("bos", tokenizer.bos_id), ("eos", tokenizer.eos_id),
                                                         ("pad", tokenizer.pad_id)) if i is not None}
    if tokenizer.add_bos and hf.post_processor is None:
        bos = (specials["bos"], tokenizer.bos_id)
        hf.post_processor = processors.TemplateProcessing(single=f"{bos[0]} $A", pair=f"{bos[0]} $A {bos[0]} $B",
                                                          special_tokens=[bos])
    return hf, specials


__all__ = ["export_hf", "hf_tokenizer"]
