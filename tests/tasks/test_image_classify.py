"""Image classification: a small ViT learns the 8×8 digits; image files, IDX files, augmentation, errors."""

import gzip
import struct

import numpy as np
import pytest
import torch
from clitools import recipe_settings

from qkv.checkpoint import load_checkpoint
from qkv.config import ViTConfig
from qkv.data import DataError
from qkv.images import (
    ImageSet,
    augment,
    channel_stats,
    is_idx_folder,
    load_dataset,
    load_digits,
    load_fashion_mnist,
    load_image_folder,
    normalize,
    read_idx,
    read_image,
    split_images,
)
from qkv.models.vit import ViTClassifier
from qkv.tasks.image_classify import ImageClassifyTask, predict_images
from qkv.training import Trainer, TrainOptions


def test_a_small_vit_learns_the_digits(tmp_path):
    train, test = load_digits("train"), load_digits("test")
    torch.manual_seed(0)
    cfg = ViTConfig(image_size=8, patch_size=4, channels=1, d_model=64, n_heads=4, n_layers=2, d_ff=128,
                    n_classes=10, norm_eps=1e-6)
    mean, std = channel_stats(train.pixels)
    task = ImageClassifyTask(ViTClassifier(cfg), train, test, batch_size=64, mean=mean, std=std)
    opts = TrainOptions(out=str(tmp_path), max_steps=300, lr=3e-3, warmup=20, schedule="cosine", eval_every=300,
                        weight_decay=0.05, progress=False)
    after = Trainer(task, opts).run().last_eval
    assert after["val_accuracy"] >= 0.90, after
    probs = predict_images(task.model, test.pixels[:5], mean=mean, std=std)
    torch.testing.assert_close(probs.sum(-1), torch.ones(5))


@pytest.mark.parametrize("schedule", ["wsd", "cosine"])
def test_patch_dropout_stops_in_the_cool_down(tmp_path, schedule):
    """With wsd the trainer's last fifth of steps reads every patch (the task's cool_down); the patches left out
    before are patch dropout's; cosine has no cool-down. The saved config keeps the rate asked for."""
    digits = load_digits("test")
    cfg = ViTConfig(image_size=8, patch_size=2, channels=1, d_model=16, n_heads=2, n_layers=1, d_ff=32, n_classes=10,
                    patch_dropout=0.5)
    model = ViTClassifier(cfg)
    lengths = []
    model.backbone.encoder.register_forward_pre_hook(lambda m, args: lengths.append(args[0].size(1)) if m.training
                                                     else None)
    task = ImageClassifyTask(model, digits, digits, batch_size=8, mean=[0.5], std=[0.5])
    opts = TrainOptions(out=str(tmp_path), max_steps=10, warmup=0, schedule=schedule, eval_every=100, progress=False)
    Trainer(task, opts).run()
    assert lengths == ([1 + 8] * 8 + [1 + 16] * 2 if schedule == "wsd" else [1 + 8] * 10)  # [CLS] + 8 or 16 patches
    assert load_checkpoint(tmp_path / "last").model.config.patch_dropout == 0.5


def test_label_smoothing_mixes_the_label_with_every_class_and_validation_scores_the_plain_loss():
    """Training's loss with smoothing ε is (1 − ε)·(−log p_label) + ε·mean over the classes of (−log p_c), summed
    over the batch; validation's is the plain cross-entropy whatever ε is."""
    digits = load_digits("test")
    torch.manual_seed(0)
    cfg = ViTConfig(image_size=8, patch_size=4, channels=1, d_model=16, n_heads=2, n_layers=1, d_ff=32, n_classes=10)
    model = ViTClassifier(cfg).eval()
    smooth, plain = (ImageClassifyTask(model, digits, digits, batch_size=32, mean=[0.5], std=[0.5],
                                       label_smoothing=eps) for eps in (0.2, 0.0))
    batch = smooth.batch(digits, torch.arange(32))
    log_p = model(batch.pixels).log_softmax(-1)
    expected = (0.8 * -log_p.gather(1, batch.labels[:, None]).squeeze(1) + 0.2 * -log_p.mean(-1)).sum()
    loss, n = smooth.loss(model, batch)
    torch.testing.assert_close(loss, expected)
    assert n == 32 and loss > plain.loss(model, batch)[0]
    assert smooth.evaluate(model) == plain.evaluate(model)


def test_the_digits_are_scikit_learns():
    datasets = pytest.importorskip("sklearn.datasets")
    reference = datasets.load_digits()
    test, train = load_digits("test"), load_digits("train")
    assert len(test) + len(train) == len(reference.target) == 1797
    pixels = torch.cat([test.pixels, train.pixels]).flatten(1).double() * 16 / 255
    labels = torch.cat([test.labels, train.labels])
    order = torch.randperm(1797, generator=torch.Generator().manual_seed(0))  # the split's own order
    torch.testing.assert_close(pixels.round(), torch.from_numpy(reference.data)[order])
    assert labels.tolist() == reference.target[order.numpy()].tolist()


def test_batches_are_the_same_when_read_again():
    digits = load_digits("test")
    task = ImageClassifyTask(torch.nn.Identity(), digits, digits, batch_size=16, pad=2, flip=True,
                             mean=[0.5], std=[0.5], seed=3)
    first, again = task.batches(1)[4], task.batches(1)[4]  # what a resumed run reads
    torch.testing.assert_close(first.pixels, again.pixels)
    assert len(task.batches(1)) == -(-len(digits) // 16)
    assert not torch.equal(task.batches(2)[4].pixels, first.pixels)


def test_augment_shifts_and_mirrors_without_changing_the_pixels_seen():
    image = torch.arange(16, dtype=torch.uint8).view(1, 1, 4, 4).expand(64, 1, 4, 4)
    shifted = augment(image, pad=1, flip=False, generator=torch.Generator().manual_seed(0))
    assert shifted.shape == image.shape and shifted.dtype == torch.uint8
    # every output is the image moved by at most one pixel (zeros come in at the border)
    moved = {(dy, dx) for dy in (-1, 0, 1) for dx in (-1, 0, 1)}
    for out in shifted:
        assert any(torch.equal(out[0], _shift(image[0, 0], dy, dx)) for dy, dx in moved)
    mirrored = augment(image, pad=0, flip=True, generator=torch.Generator().manual_seed(0))
    kinds = {torch.equal(m, image[0]) for m in mirrored} | {torch.equal(m, image[0].flip(-1)) for m in mirrored}
    assert kinds == {True, False}  # some mirrored, some not
    assert all(torch.equal(m, image[0]) or torch.equal(m, image[0].flip(-1)) for m in mirrored)


def _shift(x, dy, dx):
    out = torch.zeros_like(x)
    h, w = x.shape
    out[max(dy, 0) : h + min(dy, 0), max(dx, 0) : w + min(dx, 0)] = x[max(-dy, 0) : h - max(dy, 0),
                                                                        max(-dx, 0) : w - max(dx, 0)]
    return out


def test_normalize_uses_the_training_statistics():
    pixels = torch.randint(0, 256, (10, 3, 4, 4), dtype=torch.uint8)
    mean, std = channel_stats(pixels)
    x = normalize(pixels, mean, std)
    torch.testing.assert_close(x.mean(dim=(0, 2, 3)), torch.zeros(3), atol=1e-5, rtol=0)
    torch.testing.assert_close(x.std(dim=(0, 2, 3)), torch.ones(3), atol=1e-4, rtol=0)


def _write_idx(path, array):
    header = bytes([0, 0, 8, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    with gzip.open(path, "wb") as f:
        f.write(header + array.astype(np.uint8).tobytes())


def test_idx_files_and_a_fashion_mnist_folder(tmp_path):
    images = np.random.default_rng(0).integers(0, 256, (5, 28, 28))
    _write_idx(tmp_path / "t10k-images-idx3-ubyte.gz", images)
    _write_idx(tmp_path / "t10k-labels-idx1-ubyte.gz", np.array([0, 9, 3, 3, 1]))
    torch.testing.assert_close(read_idx(tmp_path / "t10k-images-idx3-ubyte.gz"), torch.from_numpy(images).byte())
    test = load_fashion_mnist("test", tmp_path)
    assert test.pixels.shape == (5, 1, 28, 28) and test.labels.tolist() == [0, 9, 3, 3, 1]
    assert test.classes[9] == "Ankle boot"


def test_a_folder_of_idx_files_is_read_as_fashion_mnist(tmp_path):
    """Gzipped (as Zalando ships them) or plain (after gunzip); load_dataset reads such a folder by its path, and a
    folder without the split's files, or with a damaged one, is one line saying which file."""
    images = np.random.default_rng(1).integers(0, 256, (4, 28, 28))
    _write_idx(tmp_path / "train-images-idx3-ubyte.gz", images)
    _write_idx(tmp_path / "train-labels-idx1-ubyte.gz", np.array([1, 2, 3, 4]))
    for name, array in (("t10k-images-idx3-ubyte", images[:2]), ("t10k-labels-idx1-ubyte", np.array([5, 6]))):
        (tmp_path / name).write_bytes(bytes([0, 0, 8, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
                                      + array.astype(np.uint8).tobytes())
    assert is_idx_folder(tmp_path) and not is_idx_folder(tmp_path / "train-images-idx3-ubyte.gz")
    train, test = load_dataset(str(tmp_path), "train"), load_dataset(str(tmp_path), "test")
    assert train.pixels.shape == (4, 1, 28, 28) and train.labels.tolist() == [1, 2, 3, 4]
    assert torch.equal(test.pixels[:, 0], torch.from_numpy(images[:2]).byte()) and test.labels.tolist() == [5, 6]
    assert train.classes == test.classes and train.classes[0] == "T-shirt/top"
    (tmp_path / "t10k-labels-idx1-ubyte").unlink()
    with pytest.raises(DataError, match=r"no t10k-labels-idx1-ubyte\(\.gz\) beside it"):
        load_dataset(str(tmp_path), "test")
    (tmp_path / "t10k-labels-idx1-ubyte").write_bytes(b"\0\0\x08\x01\0\0\0\x02\x05")  # one label of two
    with pytest.raises(DataError, match=r"t10k-labels-idx1-ubyte: .* holds only 1; the file is cut short"):
        load_dataset(str(tmp_path), "test")
    (tmp_path / "train-labels-idx1-ubyte.gz").unlink()
    (tmp_path / "t10k-images-idx3-ubyte").unlink()
    with pytest.raises(DataError, match="no t10k-images-idx3-ubyte"):
        load_fashion_mnist("test", tmp_path)


def test_missing_or_broken_data_is_one_clear_error(tmp_path):
    with pytest.raises(DataError, match="apt-get install dataset-fashion-mnist"):
        load_fashion_mnist("train", tmp_path)
    (tmp_path / "bad.gz").write_bytes(gzip.compress(b"\x12\x34\x56\x78"))
    with pytest.raises(DataError, match="not an IDX file"):
        read_idx(tmp_path / "bad.gz")
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(DataError, match="not a PNG or JPEG"):
        read_image(tmp_path / "notes.txt", channels=1)
    (tmp_path / "fake.png").write_text("not an image")
    with pytest.raises(DataError, match="cannot read the image"):
        read_image(tmp_path / "fake.png", channels=1)
    with pytest.raises(DataError, match="no such folder"):
        load_image_folder(tmp_path / "nowhere", channels=1, size=(8, 8))


def test_an_image_folder_reads_classes_from_subfolders(tmp_path):
    from PIL import Image

    for name, value in (("cats", 30), ("dogs", 200)):
        (tmp_path / name).mkdir()
        for k in range(2):
            Image.new("RGB", (12, 10), (value, value, value)).save(tmp_path / name / f"{k}.png")
    images = load_image_folder(tmp_path, channels=1, size=(8, 8))
    assert isinstance(images, ImageSet) and images.classes == ["cats", "dogs"]
    assert images.pixels.shape == (4, 1, 8, 8) and images.labels.tolist() == [0, 0, 1, 1]
    assert images.pixels[0].float().mean() == pytest.approx(30, abs=1)


def test_a_strict_read_names_the_size_or_channels_that_differ(tmp_path):
    from PIL import Image

    Image.new("L", (12, 10), 80).save(tmp_path / "grey.png")
    Image.new("RGB", (8, 8), (10, 20, 30)).save(tmp_path / "colour.png")
    with pytest.raises(DataError, match=r"10x12 pixels .* reads 8x8; resize it, or pass --resize"):
        read_image(tmp_path / "grey.png", channels=1, size=(8, 8), convert=False)
    with pytest.raises(DataError, match=r"a colour image \(3 channels\), but the model reads grey images \(1\)"):
        read_image(tmp_path / "colour.png", channels=1, size=(8, 8), convert=False)
    assert read_image(tmp_path / "grey.png", channels=1, size=(8, 8)).shape == (1, 8, 8)  # converted
    assert read_image(tmp_path / "colour.png", channels=3, size=(8, 8), convert=False).tolist()[2][0][0] == 30


def test_split_images_holds_out_a_random_fraction_once():
    digits = load_digits("test")
    kept, held = split_images(digits, 0.25, seed=1)
    assert len(held) == round(0.25 * len(digits)) and len(kept) + len(held) == len(digits)
    both = torch.cat([kept.pixels, held.pixels]).flatten(1).float().sum(1).sort().values
    torch.testing.assert_close(both, digits.pixels.flatten(1).float().sum(1).sort().values)
    assert torch.equal(split_images(digits, 0.25, seed=1)[1].pixels, held.pixels)  # the same split on --resume


def test_the_speedrun_swin_is_the_small_one_and_the_classic_keeps_its_own():
    from qkv.recipes.image_classifier import SwinRecipe

    for recipe, preset in ((None, "fashion-small"), ("classic", "fashion")):
        assert recipe_settings(SwinRecipe, "train swin", recipe=recipe, preset=None)["preset"] == preset


@pytest.mark.parametrize("typed, expected", [(None, 0.01), (0.02, 0.02)])
def test_the_image_speedrun_recipes_run_muon_at_half_the_language_models_rate(typed, expected):
    """0.01 for the ViT and the Swin (the LM's recipe has 0.04, the trainer 0.02); a typed --muon-lr wins."""
    from qkv.recipes.image_classifier import SwinRecipe, ViTRecipe

    for recipe_cls, command in ((ViTRecipe, "train vit"), (SwinRecipe, "train swin")):
        settings = recipe_settings(recipe_cls, command, recipe=None, max_minutes=None, muon_lr=typed)
        assert settings["muon_lr"] == expected
