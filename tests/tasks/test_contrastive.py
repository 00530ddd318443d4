"""CLIP training on captions made from labels: held-out templates and wordings stay out of training, the task's
loss is CLIP's, the temperature is clamped, and a tiny CLIP learns the digits zero-shot."""

import math

import pytest
import torch

from qkv.config import CLIPConfig
from qkv.images import channel_stats, load_digits, split_images
from qkv.models.clip import CLIP, contrastive_loss
from qkv.tasks.captions import CaptionSet
from qkv.tasks.contrastive import ContrastiveTask, caption_ids, retrieval, zero_shot_accuracy
from qkv.tokenizers import EOS_ID, BPETokenizer
from qkv.training import Trainer, TrainOptions


def test_held_out_templates_and_wordings_never_appear_in_training():
    captions = CaptionSet.fashion()
    text = " | ".join(captions.training_text())
    for template in captions.held_out_templates:
        prefix, _, suffix = template.partition("{}")
        assert not any(c.startswith(prefix) and c.endswith(suffix) for c in captions.training_text()), template
    for wording in captions.held_out_wordings:
        assert f" {wording}." not in text and f" {wording} " not in text, wording
    assert len(captions.names) == 10 and captions.names[7] == "sneaker"
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    labels = torch.tensor([7, 0, 9])
    assert captions.sample(labels, generator=g1) == captions.sample(labels, generator=g2)
    held = captions.sample(labels, generator=g1, held_out=True)
    assert all(any(c == t.format(w) for t in captions.held_out_templates for w in captions.train_wordings[y])
               for c, y in zip(held, labels.tolist(), strict=True))


def _digits_task(batch_size=64, **config):
    train, valid = split_images(load_digits("train"), 0.2, seed=0)
    captions = CaptionSet.from_names(train.classes)
    tokenizer = BPETokenizer.train(captions.training_text(), vocab_size=200, min_frequency=1)
    cfg = CLIPConfig.from_preset(
        "fashion", projection_dim=32,
        vision=dict(image_size=8, patch_size=2, d_model=32, n_heads=2, n_layers=2, init="xavier", **config),
        text=dict(vocab_size=tokenizer.vocab_size, eos_id=EOS_ID, d_model=32, n_heads=2, n_layers=1, init="xavier"))
    mean, std = channel_stats(train.pixels)
    torch.manual_seed(0)
    return ContrastiveTask(CLIP(cfg), tokenizer, captions, train, valid, batch_size=batch_size, pad=1, mean=mean,
                           std=std, seed=0)


def test_the_task_loss_is_clips_and_the_temperature_is_clamped_first():
    task = _digits_task()
    batch = task.batches(0)[0]
    assert (batch.ids.gather(1, batch.mask.sum(1, keepdim=True) - 1) == EOS_ID).all()  # end-of-text last
    with torch.no_grad():
        task.model.logit_scale.fill_(7.0)  # past ln 100
    total, n = task.loss(task.model, batch)
    assert task.model.logit_scale.item() == pytest.approx(math.log(100))
    torch.testing.assert_close(total / n, contrastive_loss(task.model(batch.pixels, batch.ids, batch.mask)))
    assert caption_ids(task.tokenizers["text"], "a photo of a 7. " * 20, 8)[-1] == EOS_ID


@pytest.mark.slow
def test_a_tiny_clip_learns_the_digits_zero_shot_with_held_out_templates(tmp_path):
    task = _digits_task(batch_size=128)
    opts = TrainOptions(out=str(tmp_path), max_steps=400, lr=3e-3, warmup=20, schedule="cosine", eval_every=400,
                        weight_decay=0.1, progress=False)
    result = Trainer(task, opts).run()
    test, stats = load_digits("test"), dict(mean=task.mean, std=task.std)
    accuracy = zero_shot_accuracy(task.model, task.tokenizers["text"], test, task.captions.names,
                                  task.captions.held_out_templates, **stats)
    # chance is 0.1; about 0.75 after these 400 steps
    assert result.last_eval["val_zero_shot"] >= 0.6 and accuracy >= 0.6, (result.last_eval, accuracy)
    recall = retrieval(task.model, task.tokenizers["text"], test, task.captions, **stats)
    assert recall["image_to_text@5"] >= recall["image_to_text@1"] >= 0.5, recall
