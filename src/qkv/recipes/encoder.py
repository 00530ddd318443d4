"""What the BERT recipes (``qkv train mlm``, ``qkv train classify``) share: start from a pretrained encoder
(``--init``), or from a new one of a preset's size with a WordPiece vocabulary learnt from the data."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from .base import Recipe
from .settings import TrainingSettings

log = logging.getLogger("qkv")

MODEL_FIELDS = ("d_model", "n_heads", "n_layers", "d_ff", "dropout")


@dataclass
class EncoderSettings(TrainingSettings):
    init: str | None = None
    preset: str = "tiny"
    d_model: int | None = None
    n_heads: int | None = None
    n_layers: int | None = None
    d_ff: int | None = None
    dropout: float | None = None
    vocab_size: int = 8000
    max_length: int = 128
    batch_size: int = 32
    lr: float | None = None  # the recipe's: from scratch or from --init
    warmup: int = 100
    eval_every: int = 200


class EncoderRecipe(Recipe):
    """A BERT recipe: :meth:`encoder` is the tokenizer and config to start from, :meth:`copy_init` the --init
    weights into the built model."""

    Settings = EncoderSettings
    scratch_lr: ClassVar[float]  # the peak learning rate from scratch; 5e-5 with --init

    def prepare(self) -> None:
        """An --init folder is stored absolute, for --resume."""
        from ..interop.sentence import MINILM_NAMES

        if self.args.init is not None and self.args.init.lower() not in MINILM_NAMES:
            self.args.init = str(Path(self.args.init).resolve())

    def learning_rate(self) -> float:
        return self.s.lr if self.s.lr is not None else 5e-5 if self.s.init else self.scratch_lr

    def encoder(self, texts: list[str]):
        """(tokenizer, BERT config) to start from: the --init encoder's, or a WordPiece vocabulary learnt from
        ``texts`` and the preset's size."""
        from ..tokenizers import WordPieceTokenizer

        self.init_encoder = None
        if self.s.init:
            self.init_encoder = self._pretrained()
            return self.init_encoder.tokenizer, self.init_encoder.model.config
        tokenizer = WordPieceTokenizer.train(texts, vocab_size=self.s.vocab_size)
        return tokenizer, self._scratch_config(tokenizer.vocab_size, tokenizer.pad_id)

    def copy_init(self, model) -> None:
        """The --init encoder's weights into ``model.bert``; only a pooler the source lacks starts fresh."""
        if getattr(self, "init_encoder", None) is None:
            return
        missing, unexpected = model.bert.load_state_dict(self.init_encoder.model.state_dict(), strict=False)
        if unexpected or any(not name.startswith("pooler.") for name in missing):
            raise ValueError(f"the --init weights do not fit: missing {missing}, unexpected {unexpected}")
        if missing:
            log.info("--init has no pooler; the pooler starts from random weights")

    def _scratch_config(self, vocab_size: int, pad_id: int):
        from ..config import BERTConfig

        s = self.s
        preset = {k: v for k, v in BERTConfig.PRESETS[s.preset].items() if k != "vocab_size"}
        overrides = {k: getattr(s, k) for k in MODEL_FIELDS if getattr(s, k) is not None}
        cfg = {**preset, **overrides, "vocab_size": vocab_size, "pad_id": pad_id}
        cfg["max_seq_len"] = max(cfg.get("max_seq_len", 512), s.max_length)
        return BERTConfig(**cfg)

    def _pretrained(self):
        """The --init encoder. Its shape and vocabulary are fixed, so options that would change them are an
        error."""
        from ..interop.sentence import load_sentence_encoder

        fixed = [f"--{k.replace('_', '-')}" for k in ("preset", "d_model", "n_heads", "n_layers", "d_ff",
                                                      "vocab_size") if getattr(self.args, k) is not None]
        if fixed:
            raise ValueError(f"--init fixes the model and its tokenizer; drop {' '.join(fixed)}")
        encoder = load_sentence_encoder(self.s.init)
        if self.s.dropout is not None:
            encoder.model.config.dropout = self.s.dropout
        return encoder
