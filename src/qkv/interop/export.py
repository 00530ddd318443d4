"""qkv's models out of qkv: Hugging Face folders that ``transformers`` loads with no code of qkv's or custom code.

    qkv export --model RUN --format hf --out DIR

    DIR/config.json              the family's config, with the class transformers builds ("architectures")
    DIR/model.safetensors        the weights, under the family's names and in its layouts
    DIR/tokenizer.json           the tokenizer, as the ``tokenizers`` library writes it
    DIR/tokenizer_config.json    its special tokens (and a chat template, when one is given)
    DIR/generation_config.json   the ids that start, end and pad a text

Each family's names are the inverse of the reader qkv already has (:mod:`qkv.interop.hf_gpt` reads these
folders too), and the export checks itself with that reader: the config and every tensor read back must be the
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
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..models import GPT
from ..tokenizers import BOS_ID, EOS_ID, PAD_ID, SPECIALS, UNK_ID, BPETokenizer, CharTokenizer, PretrainedTokenizer

log = logging.getLogger(__name__)


def export_hf(model: nn.Module, tokenizer, out: str | Path, *, chat_template: str | None = None) -> Path:
    """Write ``model`` and its ``tokenizer`` as a Hugging Face folder ``out`` (see the module's text).

    Args:
        model: a :class:`~qkv.models.GPT` (GPT-2- or LLaMA-style).
        tokenizer: its tokenizer (qkv's BPE or character tokenizer, or a pretrained model's).
        out: a folder that does not exist yet, or an empty one.
        chat_template: a Jinja chat template for ``tokenizer_config.json`` (None: the model has none).

    Returns:
        ``out``.

    Raises:
        ValueError: a model with no Hugging Face equivalent (its fields named), a tokenizer that does not fit
            it, or an ``out`` that exists and is not an empty folder.
    """
    out = Path(out)
    check_out(out, "folder")
    config, tensors = _hf_model(model)
    tokenizer_json, specials = hf_tokenizer(tokenizer)
    if tokenizer_json.get_vocab_size(with_added_tokens=True) != config["vocab_size"]:
        raise ValueError(f"the tokenizer has {tokenizer_json.get_vocab_size(with_added_tokens=True)} tokens and the "
                         f"model {config['vocab_size']}: they were not trained together")
    ids = {f"{role}_token_id": tokenizer_json.token_to_id(token) for role, token in specials.items() if role != "unk"}
    config |= ids | {"torch_dtype": "float32"}
    tokenizer_config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces":
                                        False, "model_max_length": model.config.max_seq_len}
    tokenizer_config |= {f"{role}_token": token for role, token in specials.items()}
    if chat_template is not None:
        tokenizer_config["chat_template"] = chat_template

    def write(folder: Path) -> None:
        from safetensors.torch import save_file

        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
        _write_json(folder / "config.json", config)
        _write_json(folder / "generation_config.json", ids)
        _write_json(folder / "tokenizer_config.json", tokenizer_config)
        tokenizer_json.save(str(folder / "tokenizer.json"))

    written(out, write)
    log.info("wrote %s: a %s (%s) that transformers loads with AutoModelForCausalLM", out,
             config["architectures"][0], f"{sum(t.numel() for t in tensors.values()):,} weights")
    return out


def _hf_model(model: nn.Module) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(config.json, tensors) of ``model``, checked by reading them back with qkv's reader."""
    if not isinstance(model, GPT):
        raise ValueError(f"qkv exports its GPT language models to Hugging Face folders; a {type(model).__name__} "
                         "has no exporter")
    from .hf_gpt import gpt_config_from_hf, gpt_config_to_hf, gpt_state_dict_from_hf, gpt_state_dict_to_hf

    cfg = model.config
    config = gpt_config_to_hf(cfg)
    state = model.state_dict()
    tensors = gpt_state_dict_to_hf(state, cfg)
    back = gpt_state_dict_from_hf(tensors, gpt_config_from_hf(config), config["model_type"])
    rows = {"tok_emb.weight", "lm_head.weight"}  # cut to the vocabulary on the way out
    changed = [name for name, t in back.items() if not torch.equal(t, state[name][: cfg.vocab_size]
                                                                    if name in rows else state[name])]
    if changed or set(back) != set(state):
        raise RuntimeError(f"the export does not read back as the model ({changed[:3]}); a bug in qkv's exporter")
    return config, tensors


def hf_tokenizer(tokenizer):
    """(``tokenizers.Tokenizer``, special tokens by role: bos, eos, pad, unk) of a qkv tokenizer."""
    from tokenizers import Tokenizer, decoders, models, processors

    if isinstance(tokenizer, CharTokenizer):
        hf = Tokenizer(models.BPE(vocab=dict(tokenizer.stoi), merges=[], unk_token=SPECIALS[UNK_ID]))
        hf.decoder = decoders.Fuse()
    elif isinstance(tokenizer, (BPETokenizer, PretrainedTokenizer)):
        hf = Tokenizer.from_str(tokenizer.hf.to_str())  # a copy: the post-processor below is the export's
    else:
        raise ValueError(f"a {type(tokenizer).__name__} has no Hugging Face tokenizer.json here")
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


def check_out(out: Path, what: str) -> None:
    """``out`` must not exist, or (a folder) be empty: an export never overwrites anything."""
    if out.is_symlink() or (out.exists() and not (out.is_dir() and what == "folder" and not any(out.iterdir()))):
        raise ValueError(f"{out} exists; give --out a new {what} (an export never overwrites)")
    if not out.parent.is_dir():
        raise ValueError(f"{out.parent} is not a folder; create it first")


def written(out: Path, write) -> None:
    """Run ``write(folder)`` into a temporary folder beside ``out``, then rename it to ``out``."""
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        write(tmp)
        if out.is_dir():
            out.rmdir()  # empty (check_out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


__all__ = ["export_hf", "hf_tokenizer"]
