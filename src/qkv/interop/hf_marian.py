"""Marian translation models (Helsinki-NLP's ``opus-mt-*``, Hugging Face folders) in qkv's own Transformer.

Marian is the notes' encoder-decoder, nearly as the paper draws it, so every part has a qkv config field:

=============================================  ==============================================================
Marian (``config.json``, ``MarianMTModel``)    qkv's :class:`~qkv.models.Transformer`
=============================================  ==============================================================
one table for both sides (``model.shared``)    ``share_embeddings`` (or two, ``decoder_vocab_size``)
tokens · √d_model (``scale_embedding``)        ``scale_embeddings``
sinusoidal positions, sines then cosines       ``positional="sinusoidal"``, ``sinusoidal_layout="halves"``
Post-Norm: LayerNorm after each residual       ``norm_first=False``, ``norm="layer"``, no final norm
``activation_function`` ``swish``              ``activation="silu"`` (not gated)
output = the embedding + ``final_logits_bias``  ``tie_output``, ``output_bias``
``pad_token_id`` (the last id), ``eos`` 0      ``pad_id``; a source ends with ``</s>``; decoding starts at pad
=============================================  ==============================================================

The folder:

    config.json                 model_type "marian": sizes, special ids, activation
    model.safetensors           the weights (or pytorch_model.bin, read with torch.load(weights_only=True), which
                                builds tensors and nothing else: no code in the file runs)
    source.spm, target.spm      the SentencePiece models that cut each side's text into pieces
    vocab.json                  piece -> id, shared by both sides (target_vocab.json too, where they differ)
    generation_config.json      the beam size and length limit the authors chose

:class:`MarianTokenizer` does what transformers' ``MarianTokenizer`` does (without sacremoses' punctuation
normalisation): a leading language code ``>>fra<<`` kept whole, the rest cut by the side's SentencePiece model,
each piece looked up in ``vocab.json`` (an unknown one is ``<unk>``), and ``</s>`` at the end of a source.
"""

from __future__ import annotations

import base64
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..config import TransformerConfig
from ..footprint import build_model
from ..models import Transformer
from ..tasks.translation import TranslationIds
from .hf_common import HFStateDict, check_written, hf_field, take_layer

ACTIVATIONS = {"swish": "silu", "silu": "silu", "gelu": "gelu", "gelu_new": "gelu_tanh", "relu": "relu"}
# Marian's names in each layer -> qkv's (the decoder adds its cross-attention)
_PROJECTIONS = ("q", "k", "v", "out")
_LAYER = {"self_attn_layer_norm": "self_attn_norm", "fc1": "feed_forward.up", "fc2": "feed_forward.down",
          "final_layer_norm": "ffn_norm", **{f"self_attn.{p}_proj": f"self_attn.{p}_proj" for p in _PROJECTIONS}}
_CROSS = {"encoder_attn_layer_norm": "cross_attn_norm",
          **{f"encoder_attn.{p}_proj": f"cross_attn.{p}_proj" for p in _PROJECTIONS}}
_WEIGHTS = ("model.safetensors", "pytorch_model.bin")


def marian_config_from_hf(hf: Mapping[str, Any]) -> TransformerConfig:
    """The :class:`TransformerConfig` of a Marian ``config.json``.

    Raises:
        ValueError: another model type, sizes the two sides do not share, or an activation qkv lacks.
    """
    if hf.get("model_type") != "marian":
        raise ValueError(f"model_type is {hf.get('model_type')!r}, not 'marian'")
    pairs = [("encoder_attention_heads", "decoder_attention_heads"), ("encoder_ffn_dim", "decoder_ffn_dim")]
    for ours, theirs in pairs:
        if hf_field(hf, ours) != hf_field(hf, theirs):
            raise ValueError(f"{ours}={hf[ours]} and {theirs}={hf[theirs]} differ; qkv's Transformer gives both sides "
                             "one size")
    activation = hf_field(hf, "activation_function", "gelu")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation_function {activation!r} is not one qkv has; expected one of "
                         f"{sorted(ACTIVATIONS)}")
    if hf.get("normalize_before") or hf.get("add_final_layer_norm"):
        raise ValueError("a Pre-Norm Marian model (normalize_before) is not the Post-Norm one qkv reads")
    shared = bool(hf.get("share_encoder_decoder_embeddings", True))
    vocab = hf_field(hf, "vocab_size")
    return TransformerConfig(
        src_vocab_size=vocab, tgt_vocab_size=vocab if shared else hf.get("decoder_vocab_size") or vocab,
        d_model=hf_field(hf, "d_model"), n_heads=hf["encoder_attention_heads"], n_layers=hf_field(hf, "encoder_layers"),
        n_encoder_layers=hf["encoder_layers"], n_decoder_layers=hf_field(hf, "decoder_layers"),
        d_ff=hf["encoder_ffn_dim"], max_seq_len=hf_field(hf, "max_position_embeddings"), dropout=0.0,
        pad_id=hf_field(hf, "pad_token_id"), norm_first=False, norm="layer", norm_eps=1e-5,
        activation=ACTIVATIONS[activation], bias=True, positional="sinusoidal", sinusoidal_layout="halves",
        scale_embeddings=bool(hf.get("scale_embedding", False)), share_embeddings=shared,
        tie_output=bool(hf.get("tie_word_embeddings", True)), output_bias=True,
    )


def marian_state_dict_from_hf(state_dict: Mapping[str, Tensor], cfg: TransformerConfig) -> dict[str, Tensor]:
    """A ``MarianMTModel``'s tensors as a qkv :class:`Transformer` state dict; every tensor used, every name
    checked (one error lists every problem)."""
    ckpt = HFStateDict(state_dict, family="Marian", prefix="model.",
                       ignore=lambda key: key.endswith("embed_positions.weight"))  # sinusoidal: not weights
    d = cfg.d_model
    out: dict[str, Tensor | None] = {}
    src_key, tgt_key = ("shared.weight",) * 2 if cfg.share_embeddings else \
        ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight")
    out["src_emb.weight"] = ckpt.take(src_key, (cfg.src_vocab_size, d))
    for side in ("encoder", "decoder"):
        for name in (f"{side}.embed_tokens.weight",) if cfg.share_embeddings else ():
            ckpt.take(name, (cfg.src_vocab_size, d), required=False)  # tied copies of the shared table
    out["tgt_emb.weight"] = out["src_emb.weight"] if cfg.share_embeddings else \
        ckpt.take(tgt_key, (cfg.tgt_vocab_size, d))
    for side, n_layers in (("encoder", cfg.n_encoder_layers), ("decoder", cfg.n_decoder_layers)):
        table = _LAYER | (_CROSS if side == "decoder" else {})
        for i in ckpt.layers(f"{side}.layers.", n_layers):
            out |= take_layer(ckpt, table, f"{side}.layers.{i}.", f"{side}.layers.{i}.", d, cfg.d_ff)
    head = ckpt.take("lm_head.weight", (cfg.tgt_vocab_size, d), required=not cfg.tie_output)
    out["lm_head.weight"] = out["tgt_emb.weight"] if cfg.tie_output else head
    bias = ckpt.take("final_logits_bias", (1, cfg.tgt_vocab_size), required=False)  # zeros when left out
    out["lm_head.bias"] = torch.zeros(cfg.tgt_vocab_size) if bias is None else bias.reshape(-1)
    return ckpt.finish(out)


# ------------------------------------------------------------------------------------ qkv -> Hugging Face

# Besides training's fields: table padding, what the export adds (a zero logits bias), n_layers (each side's own)
_NOT_COMPARED = ("vocab_multiple", "output_bias", "n_layers")


def marian_config_to_hf(cfg: TransformerConfig, ids: TranslationIds) -> dict[str, Any]:
    """The ``config.json`` of a ``MarianMTModel`` holding ``cfg`` with the special ``ids``; read back with
    :func:`marian_config_from_hf`, a field that would come back different is an error, not a silent change.

    Raises:
        ValueError: a Transformer Marian cannot hold (Pre-Norm, other positions or norms, grouped heads, ...),
            naming the fields.
    """
    activation = {ours: theirs for theirs, ours in ACTIVATIONS.items() if theirs != "silu"}.get(cfg.activation)
    if activation is None:
        raise ValueError(f"Marian has no activation {cfg.activation!r}")
    hf = {"model_type": "marian", "architectures": ["MarianMTModel"], "vocab_size": cfg.src_vocab_size,
          "decoder_vocab_size": cfg.tgt_vocab_size, "share_encoder_decoder_embeddings": cfg.share_embeddings,
          "d_model": cfg.d_model, "encoder_layers": cfg.n_encoder_layers, "decoder_layers": cfg.n_decoder_layers,
          "encoder_attention_heads": cfg.n_heads, "decoder_attention_heads": cfg.n_heads,
          "encoder_ffn_dim": cfg.d_ff, "decoder_ffn_dim": cfg.d_ff, "max_position_embeddings": cfg.max_seq_len,
          "activation_function": activation, "scale_embedding": cfg.scale_embeddings,
          "tie_word_embeddings": cfg.tie_output, "dropout": cfg.dropout, "is_encoder_decoder": True,
          "attention_dropout": cfg.dropout if cfg.attention_dropout is None else cfg.attention_dropout,
          "activation_dropout": cfg.dropout if cfg.activation_dropout is None else cfg.activation_dropout,
          "pad_token_id": ids.pad, "eos_token_id": ids.eos, "decoder_start_token_id": ids.start,
          "forced_eos_token_id": ids.eos if ids.transformers_search else None,
          "bad_words_ids": [[i] for i in ids.never] or None}
    if cfg.pad_id != ids.pad:
        raise ValueError(f"the model pads with {cfg.pad_id} and its tokenizer with {ids.pad}")
    check_written(cfg.to_dict(), marian_config_from_hf(hf).to_dict(), "Marian", ignore=_NOT_COMPARED)
    return hf


def marian_state_dict_to_hf(state_dict: Mapping[str, Tensor], cfg: TransformerConfig) -> dict[str, Tensor]:
    """A :class:`Transformer`'s tensors under ``MarianMTModel``'s names (the inverse of
    :func:`marian_state_dict_from_hf`): tables cut to the vocabularies, tied ones written once, a zero logits
    bias where the model has none; fresh contiguous copies."""
    sd = {k: v.detach() for k, v in state_dict.items()}
    out = {"model.shared.weight" if cfg.share_embeddings else "model.encoder.embed_tokens.weight":
           sd["src_emb.weight"][: cfg.src_vocab_size]}
    if not cfg.share_embeddings:
        out["model.decoder.embed_tokens.weight"] = sd["tgt_emb.weight"][: cfg.tgt_vocab_size]
    if not cfg.tie_output:
        out["lm_head.weight"] = sd["lm_head.weight"][: cfg.tgt_vocab_size]
    bias = sd.get("lm_head.bias")
    out["final_logits_bias"] = (torch.zeros(cfg.tgt_vocab_size) if bias is None else bias[: cfg.tgt_vocab_size])[None]
    for side, n_layers in (("encoder", cfg.n_encoder_layers), ("decoder", cfg.n_decoder_layers)):
        table = _LAYER | (_CROSS if side == "decoder" else {})
        for i in range(n_layers):
            for theirs, ours in table.items():
                for part in ("weight", "bias"):
                    out[f"model.{side}.layers.{i}.{theirs}.{part}"] = sd[f"{side}.layers.{i}.{ours}.{part}"]
    return {name: t.contiguous().clone() for name, t in out.items()}


def load_marian_from_hf(state_dict: Mapping[str, Tensor], hf_config: Mapping[str, Any]) -> Transformer:
    """A :class:`Transformer` holding a Marian checkpoint, strictly loaded, in eval mode."""
    cfg = marian_config_from_hf(hf_config)
    converted = marian_state_dict_from_hf(state_dict, cfg)
    model = build_model(Transformer, cfg, what="the Marian model", initialise=False)
    model.load_state_dict(converted, strict=True)
    return model.eval()


class MarianTokenizer:
    """One side of a Marian model's tokenizer: its SentencePiece model and the piece ids of ``vocab.json``.

    Attributes:
        ids: the :class:`TranslationIds` of the model (pad, the decoder's start (pad), eos, unk).
    """

    kind = "marian"

    def __init__(self, spm_model: bytes, vocab: Mapping[str, int], *, pad_id: int, eos_id: int, unk_id: int,
                 never: Iterable[int] = ()) -> None:
        import sentencepiece

        self.spm_model, self.vocab = spm_model, dict(vocab)
        self.spm = sentencepiece.SentencePieceProcessor(model_proto=spm_model)
        if self.spm.get_piece_size() == 0:  # an empty model parses, then fails at its first text
            raise RuntimeError("the SentencePiece model has no pieces")
        self.pieces = {i: piece for piece, i in self.vocab.items()}
        self.pad_id, self.eos_id, self.unk_id = pad_id, eos_id, unk_id
        self.ids = TranslationIds(pad=pad_id, start=pad_id, eos=eos_id, source_eos=True, never=tuple(never),
                                  transformers_search=True)
        self.special_ids = frozenset((pad_id, eos_id, unk_id))

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def tokens(self, text: str) -> list[str]:
        """The pieces of ``text``: a leading language code (``>>fra<<``) whole, then SentencePiece's."""
        code = []
        if text.startswith(">>") and (end := text.find("<<")) != -1:
            code, text = [text[: end + 2]], text[end + 2 :]
        return code + self.spm.encode(text, out_type=str)

    def encode(self, text: str) -> list[int]:
        return [self.vocab.get(piece, self.unk_id) for piece in self.tokens(text)]

    def decode(self, ids: Iterable[int]) -> str:
        """The text of ``ids``, the special tokens left out (as transformers' ``skip_special_tokens=True``)."""
        pieces = [self.pieces[i] for i in ids if i not in self.special_ids and i in self.pieces]
        return self.spm.decode_pieces(pieces).replace("▁", " ").strip()

    def id_to_token(self, token_id: int) -> str:
        return self.pieces.get(token_id, "")

    def to_dict(self) -> dict:
        return {"kind": self.kind, "spm": base64.b64encode(self.spm_model).decode("ascii"), "vocab": self.vocab,
                "pad_id": self.pad_id, "eos_id": self.eos_id, "unk_id": self.unk_id, "never": list(self.ids.never)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> MarianTokenizer:
        return cls(base64.b64decode(data["spm"]), data["vocab"], pad_id=data["pad_id"], eos_id=data["eos_id"],
                   unk_id=data["unk_id"], never=data.get("never", ()))


@dataclass
class MarianModel:
    """A Marian folder read: the model, the tokenizers of each side, and the decoding its authors chose."""

    model: Transformer
    tokenizers: dict[str, MarianTokenizer]
    beam_size: int
    length_penalty: float
    name: str
    max_new_tokens: int | None = None  # the folder's own cap on a translation's tokens, where it sets one


def load_marian_folder(folder: str | Path) -> MarianModel:
    """Read a Marian folder (see the module's text) into qkv's Transformer and tokenizers.

    Raises:
        ValueError: a missing file (named), a config that is not Marian's, weights that do not fit it (every
            problem named), a vocabulary without ``<unk>``, or no ``sentencepiece`` package.
    """
    from .hf_folder import read_config

    folder = Path(folder)
    config = read_config(folder, model_types=("marian",))
    missing = [name for name in ("source.spm", "target.spm", "vocab.json") if not (folder / name).is_file()]
    if not any((folder / name).is_file() for name in _WEIGHTS):
        missing.append(" or ".join(_WEIGHTS))
    if missing:
        raise ValueError(f"{folder} is not a whole Marian folder: it lacks {', '.join(missing)}")
    try:
        import sentencepiece  # noqa: F401
    except ImportError:
        raise ValueError("Marian's tokenizers need the sentencepiece package: pip install sentencepiece") from None
    cfg = marian_config_from_hf(config)
    generation = config | (_read_json(folder / "generation_config.json")
                           if (folder / "generation_config.json").is_file() else {})
    tokenizers = _tokenizers(folder, generation, cfg)
    try:
        model = load_marian_from_hf(_weights(folder), config)
    except ValueError as err:
        raise ValueError(f"{folder}: {err}") from None
    return MarianModel(model, tokenizers, int(generation.get("num_beams") or 1),
                       float(generation.get("length_penalty", 1.0)), folder.resolve().name, _length_cap(generation))


def _length_cap(generation: Mapping[str, Any]) -> int | None:
    """The most tokens transformers would generate for this folder: its ``max_new_tokens``, else ``max_length``
    less the decoder's start token; None where it sets neither (transformers' own default of 20 is not a choice
    the authors made)."""
    for key, start in (("max_new_tokens", 0), ("max_length", 1)):
        value = generation.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value - start < 1:
            raise ValueError(f"{key}={value!r} in the folder's generation settings; expected a whole number of at "
                             f"least {1 + start}")
        return value - start
    return None


def _tokenizers(folder: Path, config: Mapping[str, Any], cfg: TransformerConfig) -> dict[str, MarianTokenizer]:
    """Each side's tokenizer; ``config``: config.json with generation_config.json over it (the tokens the authors
    never generate, ``bad_words_ids``, are read from there: Marian's padding)."""
    never = [ids[0] for ids in config.get("bad_words_ids") or () if isinstance(ids, list) and len(ids) == 1]
    source_vocab = _read_json(folder / "vocab.json")
    target_vocab = _read_json(folder / "target_vocab.json") if (folder / "target_vocab.json").is_file() else \
        source_vocab
    out = {}
    for side, vocab, size in (("src", source_vocab, cfg.src_vocab_size), ("tgt", target_vocab, cfg.tgt_vocab_size)):
        _check_vocab(vocab, size, f"{folder}: the {side} vocabulary")
        spm = folder / ("source.spm" if side == "src" else "target.spm")
        try:
            out[side] = MarianTokenizer(spm.read_bytes(), vocab, pad_id=cfg.pad_id,
                                        eos_id=int(config.get("eos_token_id", 0)), unk_id=vocab["<unk>"], never=never)
        except RuntimeError:  # sentencepiece's own error, from C++: what failed, not which file
            raise ValueError(f"{spm} is not a SentencePiece model (it does not parse); the folder is damaged: copy "
                             "it again") from None
    return out


def _check_vocab(vocab: Mapping[str, Any], size: int, what: str) -> None:
    """A vocabulary maps pieces to the model's ``size`` ids one to one (a piece per id, as every Marian folder's
    does), ``<unk>`` among them: otherwise texts would be read and written wrongly, with no error."""
    if "<unk>" not in vocab:
        raise ValueError(f"{what} has no <unk>; the folder is damaged: copy it again")
    ids = set(vocab.values())
    if len(vocab) != size or ids != set(range(size)):
        raise ValueError(f"{what} maps {len(vocab)} pieces to {len(ids)} distinct ids, not one piece to each of the "
                         f"model's {size} ids (0 to {size - 1}); the folder is damaged: copy it again")


def _weights(folder: Path) -> dict[str, Tensor]:
    from .hf_folder import read_safetensors

    if (folder / "model.safetensors").is_file():
        return read_safetensors(folder)
    try:  # weights_only: the unpickler builds tensors and plain containers, never runs code from the file
        state = torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
    except Exception as err:
        raise ValueError(f"cannot read {folder / 'pytorch_model.bin'} as tensors: {' '.join(str(err).split())[:200]}"
                         ) from None
    if not isinstance(state, dict):
        raise ValueError(f"{folder / 'pytorch_model.bin'} holds no state dict")
    return state


def _read_json(path: Path) -> dict[str, Any]:
    from ..files import read_json

    return read_json(path)


__all__ = ["MarianModel", "MarianTokenizer", "load_marian_folder", "load_marian_from_hf", "marian_config_from_hf",
           "marian_config_to_hf", "marian_state_dict_from_hf", "marian_state_dict_to_hf"]
