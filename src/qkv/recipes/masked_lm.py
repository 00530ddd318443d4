"""``qkv train mlm``: pretrain a BERT (or go on pretraining one) by masked-language modelling on text."""

from __future__ import annotations

from dataclasses import dataclass

from .encoder import EncoderRecipe, EncoderSettings


@dataclass
class MLMSettings(EncoderSettings):
    text: list[str] | None = None
    valid_text: list[str] | None = None
    valid_fraction: float = 0.05
    mask_prob: float = 0.15


class MaskedLMRecipe(EncoderRecipe):
    name, command, summary = "mlm", "train mlm", "a BERT by masked-language modelling on text"
    Settings = MLMSettings
    paths = ("text", "valid_text")
    scratch_lr = 5e-4

    def setup(self) -> None:
        from ..tasks.language_model import training_text

        s = self.s
        self.train_text, self.valid_text = training_text(s.text, s.valid_text, s.valid_fraction, sep="\n")
        previous = self.resumed()
        if previous is not None:
            self.tokenizer, self.cfg = previous.tokenizers["text"], previous.model.config
        else:
            self.tokenizer, self.cfg = self.encoder(self.train_text.splitlines())

    def task(self):
        from ..models import BERTForMaskedLM
        from ..tasks.masked_lm import MaskedLMTask, encode_for_mlm

        s, tokenizer = self.s, self.tokenizer
        max_length = min(s.max_length, self.cfg.max_seq_len)
        train_ids = encode_for_mlm(tokenizer, self.train_text.splitlines(), max_length)
        valid_ids = encode_for_mlm(tokenizer, self.valid_text.splitlines(), max_length)
        model = self.built(BERTForMaskedLM, self.cfg, batch=(s.batch_size, max_length),
                           what=f"; {len(train_ids)} training and {len(valid_ids)} validation sequences of up to "
                                f"{max_length} tokens (WordPiece, vocabulary {tokenizer.vocab_size})")
        self.copy_init(model)
        return MaskedLMTask(model, tokenizer, train_ids, valid_ids, batch_size=s.batch_size,
                            probability=s.mask_prob, seed=s.seed, meta=self.meta())

    def finish(self) -> None:
        """What the model learnt: the best checkpoint's guesses for a held-out word."""
        from ..checkpoint import load_checkpoint
        from ..tasks.masked_lm import fill_mask

        sample = next((line.split() for line in self.valid_text.splitlines() if len(line.split()) >= 4), None)
        if sample is None:
            return
        mask, middle = self.tokenizer.specials["mask"], len(sample) // 2
        prompt = " ".join([*sample[:middle], mask, *sample[middle + 1 :]])
        guesses = fill_mask(load_checkpoint(self.out / "best").model, self.tokenizer, prompt)[0]
        print(f"fill-mask: {prompt}  (was {sample[middle]!r}): "
              + ", ".join(f"{token!r} {p:.2f}" for token, p in guesses))
