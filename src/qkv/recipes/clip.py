"""``qkv train clip``: a CLIP trained from scratch on labelled images with captions made from their labels,
scored zero-shot and by retrieval on the test images when training ends."""

from __future__ import annotations

from dataclasses import dataclass

from .images import ImageRecipe, ImageSettings, image_fields


@dataclass
class CLIPSettings(ImageSettings):
    text_layers: int | None = None
    projection_dim: int | None = None
    vocab_size: int = 1000
    batch_size: int = 256
    lr: float | None = 2e-3
    warmup: int = 200
    weight_decay: float = 0.1
    eval_every: int = 250


class CLIPRecipe(ImageRecipe):
    name, command, summary = "clip", "train clip", "a CLIP on images and captions made from their labels"
    Settings = CLIPSettings
    betas = (0.9, 0.98)

    def setup(self) -> None:
        from ..tasks.captions import CaptionSet
        from ..tokenizers import BPETokenizer

        self.datasets()
        self.captions = (CaptionSet.fashion() if self.s.data == "fashion-mnist" else
                         CaptionSet.from_names(self.train.classes))
        previous = self.resumed()
        self.statistics(previous)
        if previous is not None:
            self.tokenizer, self.cfg = previous.tokenizers["text"], previous.model.config
            return
        self.tokenizer = BPETokenizer.train(self.captions.training_text(), vocab_size=self.s.vocab_size,
                                            min_frequency=1)
        self.cfg = self._config(self.tokenizer.vocab_size)

    def task(self):
        from ..footprint import padded_images
        from ..models import CLIP
        from ..tasks.contrastive import ContrastiveTask

        s, captions = self.s, self.captions
        model = self.built(CLIP, self.cfg, batch=(s.batch_size, None),
                           inputs=padded_images(s.batch_size, self.cfg.vision, self.pad),
                           what=f"; {len(captions.training_text())} training captions "
                                f"({len(captions.train_templates)} templates), {len(captions.held_out_templates)} "
                                f"held-out templates, BPE vocabulary {self.tokenizer.vocab_size}")
        return ContrastiveTask(model, self.tokenizer, captions, self.train, self.valid, batch_size=s.batch_size,
                               pad=self.pad, flip=self.flip, mean=self.mean, std=self.std, seed=s.seed,
                               meta=self.meta(held_out_wordings=list(captions.held_out_wordings)))

    def finish(self) -> None:
        """The best checkpoint's zero-shot accuracy and retrieval on the test images, with held-out captions."""
        from ..checkpoint import load_checkpoint
        from ..tasks.contrastive import retrieval, zero_shot_accuracy

        if self.test is None:
            return
        ckpt, test, captions = load_checkpoint(self.out / "best"), self.test, self.captions
        model, tokenizer, stats = ckpt.model, ckpt.tokenizers["text"], dict(mean=ckpt.meta["mean"],
                                                                             std=ckpt.meta["std"])
        held = zero_shot_accuracy(model, tokenizer, test, captions.names, captions.held_out_templates, **stats)
        seen = zero_shot_accuracy(model, tokenizer, test, captions.names, captions.train_templates, **stats)
        words = zero_shot_accuracy(model, tokenizer, test, captions.held_out_wordings, captions.held_out_templates,
                                   **stats)
        print(f"zero-shot test accuracy: {held:.2%} with the held-out templates, {seen:.2%} with the training ones, "
              f"{words:.2%} with held-out wordings and templates ({len(test):,} images)")
        recall = retrieval(model, tokenizer, test, captions, **stats)
        print("retrieval on test images with held-out captions (a hit is the right class): "
              + ", ".join(f"{k.replace('_', ' ')} {v:.2%}" for k, v in recall.items()))

    def _config(self, vocab_size: int):
        """A new CLIP's config: the fashion preset, then the fields given on the command line."""
        from ..config import CLIPConfig
        from ..tokenizers import EOS_ID

        s = self.s
        shared = {k: getattr(s, k) for k in ("d_model", "n_heads") if getattr(s, k) is not None}
        vision = {**shared, **image_fields(self.train), "n_classes": None, "init": "xavier"}
        vision.update({k: getattr(s, k) for k in ("patch_size", "n_layers") if getattr(s, k) is not None})
        text = {**shared, "vocab_size": vocab_size, "eos_id": EOS_ID, "max_seq_len": 32, "init": "xavier"}
        if s.text_layers is not None:
            text["n_layers"] = s.text_layers
        overrides = {"projection_dim": s.projection_dim} if s.projection_dim is not None else {}
        return CLIPConfig.from_preset("fashion", vision=vision, text=text, **overrides)
