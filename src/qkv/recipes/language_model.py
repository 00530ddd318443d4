"""``qkv train lm``: a GPT language model (GPT-2 or LLaMA style) trained on text, with a character or
byte-level BPE vocabulary learnt from it.

Two recipes (``--recipe``), measured on tinyshakespeare's characters on 2 CPU cores
(``benchmarks/bench_time_to_quality.py``):

* speedrun (the default): the 4 × 128 ``tiny`` GPT (exact GELU; two layers given ``--max-minutes`` under
  :data:`SHALLOW_BELOW_MINUTES`), context 64, 48 windows a step, Muon for the
  attention and feed-forward matrices (``--muon-lr 0.04``) and AdamW for the rest (``--lr 3e-3``), no warmup
  (Muon's steps have a fixed size: without warmup the first minute ends 0.02 to 0.04 lower), the rate held and
  then decayed to zero over the last fifth (``wsd``). Muon takes most of the gain: at the same 2,000
  steps of nanoGPT's CPU recipe it ends at a validation loss of 1.67 where AdamW ends at 1.90.
  Given an hour it reaches 1.456 (below the 1.47 of nanoGPT's 10.7M model on a GPU), as ``--preset mini
  --dropout 0.1 --batch-size 32`` (4 × 256, context 128, dropout on the residual stream) does (1.453); at 10
  minutes the tiny model is far ahead (1.514 against 1.660), so the recipe keeps the ``tiny`` preset at every budget.
* classic: the recipe before it: the 4 × 256 ``mini`` GPT, context 128, 32 windows a step, AdamW at 1e-3, 200
  warmup steps, cosine decay to a tenth.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .base import VOCAB_MULTIPLE, Recipe
from .settings import INGREDIENTS, ModelIngredients, TrainingSettings

MODEL_FIELDS = ("d_model", "n_heads", "n_layers", "d_ff", "dropout", *INGREDIENTS)


@dataclass
class LMSettings(ModelIngredients, TrainingSettings):
    experts: int | None = None
    top_k: int | None = None
    text: list[str] | None = None
    valid_text: list[str] | None = None
    valid_fraction: float = 0.1
    tokenizer: str = "char"
    vocab_size: int = 4000
    preset: str = "tiny"
    style: str = "gpt2"
    d_model: int | None = None
    n_heads: int | None = None
    n_layers: int | None = None
    d_ff: int | None = None
    dropout: float | None = None
    context: int | None = None
    batch_size: int = 48
    optimizer: str = "muon"
    muon_lr: float = 0.04
    lr: float | None = 3e-3
    warmup: int = 0
    schedule: str = "wsd"
    min_lr_ratio: float = 0.0
    weight_decay: float = 0.1
    eval_every: int = 250
    eval_windows: int | None = None


# The recipe before the speedrun one, and that of every run stored before recipes had names.
CLASSIC = dict(preset="mini", batch_size=32, optimizer="adamw", lr=1e-3, warmup=200, schedule="cosine",
               min_lr_ratio=0.1)


def eval_windows(s: LMSettings, world: int = 1) -> int | None:
    """--eval-windows, or the default that bounds evaluation's share of the run: a forward pass costs about a
    third of a training step, so 0.3 x eval_every steps' windows (of all ``world`` processes) take about 10% of
    the time between two validations. None: every window."""
    if s.eval_windows is not None:
        return s.eval_windows or None
    return max(1, 3 * s.eval_every * s.batch_size * s.accum * world // 10)


def model_config(s: LMSettings, vocab_size: int):
    """A new model's config: the preset, the style's fields, then those given on the command line."""
    from ..config import GPTConfig

    overrides = {k: getattr(s, k) for k in MODEL_FIELDS if getattr(s, k) is not None}
    if s.experts is not None:  # a mixture of experts in place of each feed-forward network
        overrides |= {"n_experts": s.experts, "expert_top_k": s.top_k or 2}
    if s.context is not None:
        overrides["max_seq_len"] = s.context
    style = GPTConfig.PRESETS["llama"] if s.style == "llama" else {}
    preset = {k: v for k, v in GPTConfig.PRESETS[s.preset].items() if k != "vocab_size"}
    return GPTConfig(**{**preset, **style, **overrides, "vocab_size": vocab_size, "pad_id": None,
                        "vocab_multiple": VOCAB_MULTIPLE})


# Below this --max-minutes the speedrun GPT has two layers rather than the tiny preset's four: twice the steps in
# the time. One run each, side by side on 2 CPU cores, tinyshakespeare's validation loss: 1.767/1.773 against
# 1.817/1.807 (two seeds) at 0.7 minutes, 1.685 against 1.750 at 1, 1.617 against 1.644 at 2, 1.552 against 1.559
# at 4, where the two meet.
SHALLOW_BELOW_MINUTES = 4.0


class LanguageModelRecipe(Recipe):
    name, command, summary = "lm", "train lm", "a GPT language model on text"
    Settings = LMSettings
    paths = ("text", "valid_text")
    betas = (0.9, 0.95)
    RECIPES: ClassVar[dict[str, dict]] = {"speedrun": {}, "classic": CLASSIC}
    LAYERS_BY_MINUTES = ((0.0, 2), (SHALLOW_BELOW_MINUTES, None))

    def setup(self) -> None:
        from ..tasks.language_model import training_text
        from ..tokenizers import train_tokenizer

        s = self.s
        if s.context is not None and s.context < 2:  # it would train, then fail at its closing sample
            raise ValueError(f"--context {s.context} leaves no room to continue a text: a language model reads at "
                             "least 2 tokens at once; give --context 2 or more")
        if s.text and self.args.vocab_size is not None and s.tokenizer == "char":
            raise ValueError("--vocab-size sizes a BPE vocabulary; --tokenizer char takes every character of the "
                             "text")
        self.train_text, self.valid_text = training_text(s.text, s.valid_text, s.valid_fraction)
        previous = self.resumed()
        if previous is not None:
            self.tokenizer, self.cfg = previous.tokenizers["text"], previous.model.config
        else:
            lines = [self.train_text] if s.tokenizer == "char" else self.train_text.splitlines(keepends=True)
            self.tokenizer = train_tokenizer(s.tokenizer, lines, vocab_size=s.vocab_size, byte_level=True)
            self.cfg = model_config(s, self.tokenizer.vocab_size)

    def task(self):
        from .. import GPT
        from ..distributed import current
        from ..tasks.language_model import LanguageModelTask, encode_text

        s, tokenizer = self.s, self.tokenizer
        train_ids, valid_ids = encode_text(tokenizer, self.train_text), encode_text(tokenizer, self.valid_text)
        self.model = self.built(GPT, self.cfg, batch=(s.batch_size, self.cfg.max_seq_len),
                                what=f"; {len(train_ids):,} tokens for training, {len(valid_ids):,} for validation "
                                     f"({tokenizer.kind} tokenizer, vocabulary {tokenizer.vocab_size})")
        return LanguageModelTask(self.model, tokenizer, train_ids, valid_ids, context=self.cfg.max_seq_len,
                                 batch_size=s.batch_size, seed=s.seed, eval_windows=eval_windows(s, current().world),
                                 meta=self.meta())

    def finish(self) -> None:
        """A sample of what the model learnt, from the first character or word of the text."""
        from ..sampling import Sampling
        from ..tasks.language_model import complete

        prompt = self.train_text[:1] if self.tokenizer.kind == "char" else self.train_text.split()[0]
        sample = complete(self.model, self.tokenizer, [prompt], max_new_tokens=200,
                          sampling=Sampling(temperature=0.8), seed=self.s.seed)[0]
        print(f"sample (temperature 0.8):\n{prompt}{sample}")
