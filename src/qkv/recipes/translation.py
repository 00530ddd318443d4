"""``qkv train`` (``qkv train translation``): a translation model — the notes' encoder-decoder Transformer, or an
LSTM encoder-decoder with or without attention — trained on sentence pairs, with BPE or character
vocabularies learnt from them.

The Transformer has two recipes (``--recipe``), measured on Multi30k de→en on 2 CPU cores:

* speedrun (the default): Muon for the attention and feed-forward matrices (``--muon-lr 0.02``) and AdamW for
  the embeddings and norms (``--lr 1e-3``), 200 warmup steps, the rate held and then decayed to zero over the
  last fifth (``wsd``), batches of 2,000 target tokens, and the ``multi30k`` model (see
  :class:`qkv.config.TransformerConfig`).
* classic: the paper's schedule: AdamW at 7e-4 with 1,000 warmup steps and the inverse square root decay,
  batches of 4,000 target tokens, the ``small`` model.

The LSTMs have one recipe, their own (``LSTM_DEFAULTS``; Muon has no attention or feed-forward matrices to
take there).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import ClassVar

from .base import VOCAB_MULTIPLE, Recipe
from .settings import INGREDIENTS, ModelIngredients, TrainingSettings

MODEL_FIELDS = ("d_model", "n_heads", "n_layers", "n_encoder_layers", "n_decoder_layers", "d_ff", "dropout",
                "attention_dropout", "activation_dropout", "positional", *INGREDIENTS)
# --arch -> the LSTM's attention; one model family (checkpoint architecture "lstm"), three ways to read the source
LSTM_ATTENTION = {"lstm": "none", "lstm-dot": "dot", "lstm-additive": "additive"}
RNN_FIELDS = ("embedding_dim", "hidden_size", "n_layers", "bidirectional", "attention_dim", "dropout")
TRANSFORMER_ONLY = ("d_model", "n_heads", "n_encoder_layers", "n_decoder_layers", "d_ff", "attention_dropout",
                    "activation_dropout", "positional", "post_norm", *INGREDIENTS)
LSTM_ONLY = ("embedding_dim", "hidden_size", "bidirectional", "attention_dim")
# The Transformer's recipe before the speedrun one, and that of every run stored before recipes had names.
CLASSIC = dict(preset="small", optimizer="adamw", lr=7e-4, warmup=1000, schedule="inverse_sqrt", batch_tokens=4000)
# The LSTMs' one recipe: the classic one with a higher learning rate and a short warmup (Adam with clipping needs
# little warmup for an LSTM; a long one costs a large part of an hour's run on a CPU).
LSTM_DEFAULTS = {**CLASSIC, "lr": 1e-3, "warmup": 200}


@dataclass
class TranslationSettings(ModelIngredients, TrainingSettings):
    src: str | None = None
    tgt: str | None = None
    tsv: str | None = None
    valid_src: str | None = None
    valid_tgt: str | None = None
    valid_tsv: str | None = None
    valid_size: int = 1000
    test_size: int | None = None
    max_len: int = 128
    target_lang: str | None = None
    tokenizer: str = "bpe"
    target_tokenizer: str | None = None
    vocab_size: int = 8000
    separate_vocab: bool = False
    arch: str = "transformer"
    preset: str = "multi30k"
    d_model: int | None = None
    n_heads: int | None = None
    n_layers: int | None = None
    n_encoder_layers: int | None = None
    n_decoder_layers: int | None = None
    d_ff: int | None = None
    dropout: float | None = None
    attention_dropout: float | None = None
    activation_dropout: float | None = None
    post_norm: bool = False
    positional: str | None = None
    embedding_dim: int | None = None
    hidden_size: int | None = None
    bidirectional: bool | None = None
    attention_dim: int | None = None
    batch_tokens: int = 2000
    optimizer: str = "muon"
    lr: float | None = 1e-3
    warmup: int = 200
    schedule: str = "wsd"
    label_smoothing: float = 0.1
    teacher_forcing: float = 1.0
    bleu_samples: int = 500


def model_config(s: TranslationSettings, tokenizers: dict):
    """A new model's config: the preset of its architecture, then the fields given on the command line."""
    from ..config import RNNConfig, TransformerConfig

    vocab = dict(src_vocab_size=tokenizers["src"].vocab_size, tgt_vocab_size=tokenizers["tgt"].vocab_size,
                 share_embeddings=tokenizers["src"] is tokenizers["tgt"])
    if s.arch in LSTM_ATTENTION:
        overrides = {k: getattr(s, k) for k in RNN_FIELDS if getattr(s, k) is not None}
        return RNNConfig.from_preset(s.preset, attention=LSTM_ATTENTION[s.arch], **vocab, **overrides)
    overrides = {k: getattr(s, k) for k in MODEL_FIELDS if getattr(s, k) is not None}
    return TransformerConfig.from_preset(s.preset, **vocab, max_seq_len=max(s.max_len + 2, 64),
                                         vocab_multiple=VOCAB_MULTIPLE, norm_first=not s.post_norm, **overrides)


class TranslationRecipe(Recipe):
    name, command, summary = "translation", "train", "a translation model on sentence pairs"
    Settings = TranslationSettings
    paths = ("src", "tgt", "tsv", "valid_src", "valid_tgt", "valid_tsv")
    betas = (0.9, 0.98)
    RECIPES: ClassVar[dict[str, dict]] = {"speedrun": {}, "classic": CLASSIC}

    def defaults(self) -> dict:
        # A resumed run's stored options cover every default, so only a new run's --arch picks the defaults.
        return {**super().defaults(), **(LSTM_DEFAULTS if self.args.arch in LSTM_ATTENTION else {})}

    def recipes(self) -> dict[str, dict]:
        if self.args.resume or self.args.arch not in LSTM_ATTENTION:  # a resumed run: its stored recipe
            return self.RECIPES
        if self.args.recipe not in (None, "classic"):
            raise ValueError(f"--recipe {self.args.recipe} is the Transformer's; the LSTMs (--arch {self.args.arch}) "
                             "have one recipe: drop --recipe")
        return {"classic": {}}  # over LSTM_DEFAULTS

    def setup(self) -> None:
        from ..checkpoint import ARCHITECTURES
        from ..tasks.translation import build_tokenizers

        s = self.s
        self._check_arch_options()
        self.pairs = self._read_pairs()
        previous = self.resumed()
        if previous is not None:
            self.tokenizers, self.cfg, self.model_cls = (previous.tokenizers, previous.model.config,
                                                         type(previous.model))
            return
        self.tokenizers = build_tokenizers(self.pairs[0], kind=s.tokenizer, vocab_size=s.vocab_size,
                                          shared=not s.separate_vocab and not s.target_tokenizer,
                                          target_kind=s.target_tokenizer)
        self.cfg = model_config(s, self.tokenizers)
        self.model_cls = ARCHITECTURES["lstm" if s.arch in LSTM_ATTENTION else "transformer"][0]

    def task(self):
        from ..distributed import current
        from ..tasks.translation import ParallelData, TranslationTask, looks_chinese

        s, (train_pairs, valid_pairs, test_pairs) = self.s, self.pairs
        train = ParallelData.encode(train_pairs, self.tokenizers, max_len=s.max_len, name="train")
        valid = ParallelData.encode(valid_pairs, self.tokenizers, max_len=s.max_len, name="valid")
        if test_pairs is not None and current().main:
            self._write_test_set(test_pairs)
        target_lang = s.target_lang or ("zh" if looks_chinese(valid.tgt_text) else None)
        model = self.built(self.model_cls, self.cfg,
                           what=f"; {len(train)} training pairs, {len(valid)} validation pairs")
        return TranslationTask(model, self.tokenizers, train, valid, batch_tokens=s.batch_tokens, seed=s.seed,
                               label_smoothing=s.label_smoothing, bleu_samples=s.bleu_samples,
                               target_language=target_lang, teacher_forcing=s.teacher_forcing,
                               meta=self.meta(target_lang=target_lang))

    def _read_pairs(self) -> tuple[list, list, list | None]:
        """(training, validation, test or None) pairs, from the files or held out of the training pairs."""
        from ..data import DataError, read_parallel
        from ..tasks.translation import split_off

        s = self.s
        if s.tsv:
            if s.src or s.tgt:
                raise DataError("give either --tsv or --src/--tgt, not both")
            train = read_parallel(s.tsv)
        elif s.src and s.tgt:
            train = read_parallel(s.src, s.tgt)
        else:
            raise DataError("no training data: give --src FILE --tgt FILE, or --tsv FILE")
        test = None
        if s.test_size:
            train, test = split_off(train, s.test_size, s.seed + 1)
        if s.valid_tsv:
            valid = read_parallel(s.valid_tsv)
        elif s.valid_src and s.valid_tgt:
            valid = read_parallel(s.valid_src, s.valid_tgt)
        elif s.valid_src or s.valid_tgt:
            raise DataError("give both --valid-src and --valid-tgt (or --valid-tsv)")
        else:
            train, valid = split_off(train, s.valid_size, s.seed)
        return train, valid, test

    def _check_arch_options(self) -> None:
        """Options that do not apply are a mistake, not something to ignore silently."""
        s, lstm = self.s, self.s.arch != "transformer"
        defaults = {f.name: f.default for f in fields(TranslationSettings)}
        wrong = [k for k in (TRANSFORMER_ONLY if lstm else LSTM_ONLY) if getattr(s, k) != defaults[k]]
        if wrong:
            options = ", ".join("--" + k.replace("_", "-") for k in wrong)
            raise ValueError(f"{options}: {'Transformer' if lstm else 'LSTM'} option(s), not for --arch {s.arch}")
        if s.attention_dim is not None and s.arch != "lstm-additive":
            raise ValueError(f"--attention-dim sizes additive attention (--arch lstm-additive), not --arch {s.arch}")
        if not lstm and s.teacher_forcing != 1.0:
            raise ValueError(f"--teacher-forcing {s.teacher_forcing} needs an LSTM (--arch lstm, lstm-dot or "
                             "lstm-additive); the Transformer is trained with full teacher forcing")
        if self.args.vocab_size is not None and s.tokenizer == "char" and s.target_tokenizer in (None, "char"):
            raise ValueError("--vocab-size sizes a BPE vocabulary; --tokenizer char takes every character of the "
                             "text")

    def _write_test_set(self, pairs: list) -> None:
        """--test-size: the held-out pairs as OUT/test.src.txt and OUT/test.ref.txt, for qkv evaluate."""
        from functools import partial
        from pathlib import Path

        from ..files import write_atomically

        for column, name in enumerate(("test.src.txt", "test.ref.txt")):
            text = "".join(p[column].strip() + "\n" for p in pairs)
            write_atomically(self.out / name, partial(Path.write_text, data=text, encoding="utf-8"))
