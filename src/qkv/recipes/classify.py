"""``qkv train classify``: fine-tune a BERT (pretrained with ``--init``, or new) to label sentences, from a TSV of
text<TAB>label lines."""

from __future__ import annotations

from dataclasses import dataclass

from .encoder import EncoderRecipe, EncoderSettings


@dataclass
class ClassifySettings(EncoderSettings):
    data: str | None = None
    valid_data: str | None = None
    valid_fraction: float = 0.1
    pooling: str = "pooler"
    eval_every: int = 100


class ClassifyRecipe(EncoderRecipe):
    name, command, summary = "classify", "train classify", "a BERT sentence classifier (TSV: text<TAB>label)"
    Settings = ClassifySettings
    paths = ("data", "valid_data")
    scratch_lr = 1e-3

    def setup(self) -> None:
        from ..config import BERTClassifierConfig
        from ..tasks.classify import label_set, read_labelled, split_examples

        s = self.s
        if not s.data:
            raise ValueError("no training data: give --data FILE.tsv (text<TAB>label per line)")
        examples = read_labelled(s.data)
        if s.valid_data:
            self.train, self.valid = examples, read_labelled(s.valid_data)
        else:
            self.train, self.valid = split_examples(examples, s.valid_fraction, seed=s.seed)
        previous = self.resumed()
        if previous is not None:
            self.tokenizer, self.cfg = previous.tokenizers["text"], previous.model.config
            self.labels = previous.meta["labels"]
            return
        self.labels = label_set(self.train)
        self.tokenizer, base = self.encoder([text for text, _ in self.train])
        self.cfg = BERTClassifierConfig(**{**base.to_dict(), "pooler": base.pooler or s.pooling == "pooler",
                                           "n_labels": len(self.labels), "pooling": s.pooling})

    def task(self):
        from ..models import BERTClassifier
        from ..tasks.classify import ClassifyTask

        s = self.s
        model = self.built(BERTClassifier, self.cfg, batch=(s.batch_size, s.max_length),
                           what=f"; {len(self.train)} training and {len(self.valid)} validation examples, labels "
                                f"{self.labels}")
        self.copy_init(model)
        return ClassifyTask(model, self.tokenizer, self.labels, self.train, self.valid, batch_size=s.batch_size,
                            max_length=min(s.max_length, self.cfg.max_seq_len), seed=s.seed, meta=self.meta())
