"""``qkv train vit|swin|clip``, ``qkv classify-image`` and ``qkv zero-shot`` end to end in subprocesses, on
scikit-learn's 8×8 digits, on small folders of PNG files and on a folder of Fashion-MNIST-format IDX files; and the
mistakes users make, each one line."""

import gzip
import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
from clitools import PNG_MAGIC, last_line_error, ok, one_line_error, qkv

from qkv.images import load_digits

pytestmark = pytest.mark.slow

SMALL = ["--d-model", "32", "--n-heads", "2", "--batch-size", "64", "--eval-every", "5", "--warmup", "2",
         "--no-progress"]


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """Digits as PNG files (8×8 grey), one 16×16 and one colour image, and a folder of two classes."""
    from PIL import Image

    root = tmp_path_factory.mktemp("vision")
    test = load_digits("test")
    for k in range(3):
        Image.fromarray(test.pixels[k, 0].numpy(), mode="L").save(root / f"digit{k}.png")
    Image.fromarray(test.pixels[0, 0].numpy(), mode="L").resize((16, 16)).save(root / "big.png")
    Image.new("RGB", (8, 8), (200, 10, 10)).save(root / "colour.png")
    (root / "notes.txt").write_text("not an image")
    for name, value in (("dark", 40), ("light", 220)):
        for split in ("shapes", "shapes-test"):
            (root / split / name).mkdir(parents=True)
            for k in range(6):
                Image.new("RGB", (20, 20), (value + k, value, value - k)).save(root / split / name / f"{k}.png")
    return root


@pytest.fixture(scope="module")
def vit_run(work) -> Path:
    proc = ok(qkv("train", "vit", "--data", "digits", "--out", "vit", "--max-steps", "10", "--patch-size", "2",
                  "--n-layers", "1", "--d-ff", "64", *SMALL, cwd=work))
    assert "test accuracy: " in proc.stdout and "on 359 digits test images" in proc.stdout
    assert "10 classes; augmented: no\n" in proc.stderr  # digits are not mirrored, and the recipe does not shift
    return work / "vit"


def test_train_vit_writes_a_classifier_that_knows_its_data(vit_run):
    config = json.loads((vit_run / "best" / "config.json").read_text())
    assert config["arch"] == "vit-classifier" and config["model"]["image_size"] == 8
    assert config["model"]["n_classes"] == 10 and config["model"]["patch_size"] == 2
    meta = config  # what the task records sits beside the model's config
    assert meta["labels"] == [str(d) for d in range(10)] and meta["image_shape"] == [1, 8, 8]
    assert len(meta["mean"]) == 1 and meta["command"] == "train vit"
    assert (vit_run / "loss.png").read_bytes()[:8] == PNG_MAGIC
    args = meta["args"]  # the default recipe: the small ViT with Muon and warmup-stable-decay, images unshifted
    assert (args["recipe"], args["preset"], args["optimizer"], args["muon_lr"], args["schedule"], args["pad"]) == (
        "speedrun", "fashion-small", "muon", 0.01, "wsd", 0)
    assert config["model"]["patch_dropout"] == 0.5  # trained on half of each image's patches


def test_train_vit_resumes_to_the_new_budget(here, work, vit_run, tmp_path):
    run = tmp_path / "vit"
    shutil.copytree(vit_run, run)
    proc = ok(here("train", "vit", "--out", run, "--resume", "--max-steps", "12", "--no-progress", cwd=work))
    assert "after 12 steps" in proc.stdout and "test accuracy" in proc.stdout
    last_line_error(here("train", "vit", "--out", run, "--resume", "--patch-size", "4", "--max-steps", "14", cwd=work),
                    "--patch-size 4 differs")


def test_classify_image_files_a_test_set_and_picked_test_images(here, work, vit_run):
    lines = ok(here("classify-image", "--model", vit_run, "digit0.png", "digit1.png", cwd=work)).stdout.splitlines()
    assert len(lines) == 2 and lines[1].endswith("\tdigit1.png")
    label, prob, _ = lines[0].split("\t")
    assert label in [str(d) for d in range(10)] and 0 < float(prob) <= 1
    summary = ok(here("classify-image", "--model", vit_run, "--data", "digits", cwd=work)).stdout
    assert summary.startswith("accuracy: ") and "on 359 digits test images" in summary
    picked = ok(here("classify-image", "--model", vit_run, "--data", "digits", "--index", "0", "1", cwd=work))
    assert picked.stdout.splitlines()[0] == lines[0].replace("digit0.png", "digits[0]")  # the file is that image


def test_attention_draws_the_cls_attention_and_rollout(here, work, vit_run, tmp_path):
    proc = ok(here("classify-image", "--model", vit_run, "digit0.png", "digit2.png", "--attention",
                   tmp_path / "att.png", "--image", "1", cwd=work))
    assert (tmp_path / "att.png").read_bytes()[:8] == PNG_MAGIC and "attention of digit2.png" in proc.stderr
    drawn = (tmp_path / "att.png").read_bytes()
    again = ["classify-image", "--model", vit_run, "digit0.png", "--attention", tmp_path / "att.png"]
    one_line_error(here(*again, cwd=work), "att.png' exists; pass --force to replace it")
    assert (tmp_path / "att.png").read_bytes() == drawn
    ok(here(*again, "--force", cwd=work))
    assert (tmp_path / "att.png").read_bytes()[:8] == PNG_MAGIC and (tmp_path / "att.png").read_bytes() != drawn


def test_wrong_images_are_one_clear_line(here, work, vit_run):
    one_line_error(here("classify-image", "--model", vit_run, "big.png", cwd=work), "16x16 pixels", "reads 8x8",
                   "--resize")
    one_line_error(here("classify-image", "--model", vit_run, "colour.png", cwd=work), "a colour image",
                   "reads grey images")
    one_line_error(here("classify-image", "--model", vit_run, "notes.txt", cwd=work), "not a PNG or JPEG")
    one_line_error(here("classify-image", "--model", vit_run, "missing.png", cwd=work), "no such file")
    one_line_error(here("classify-image", "--model", vit_run, cwd=work), "no images")
    one_line_error(here("classify-image", "--model", vit_run, "--data", "digits", "--index", "400", cwd=work),
                   "past the last of the 359")
    one_line_error(here("classify-image", "--model", vit_run, "digit0.png", "--attention", "a.png", "--image", "3",
                        cwd=work), "--image 3 is past the last")
    resized = ok(here("classify-image", "--model", vit_run, "big.png", "colour.png", "--resize", cwd=work))
    assert len(resized.stdout.splitlines()) == 2


def test_train_swin_on_a_folder_with_a_test_folder(here, work, tmp_path):
    proc = ok(here("train", "swin", "--data", "shapes", "--test-data", "shapes-test", "--image-size", "16",
                   "--out", tmp_path / "swin", "--max-steps", "4", "--d-model", "12", "--depths", "2",
                   "--stage-heads", "2", "--window-size", "4", "--patch-size", "2", "--batch-size", "8",
                   "--valid-fraction", "0.25", "--eval-every", "2", "--label-smoothing", "0.1", "--no-progress",
                   cwd=work))
    assert "on 12 shapes-test test images" in proc.stdout
    config = json.loads((tmp_path / "swin" / "best" / "config.json").read_text())
    assert config["arch"] == "swin-classifier" and config["model"]["channels"] == 3
    assert config["args"]["label_smoothing"] == 0.1
    assert config["labels"] == ["dark", "light"]
    lines = ok(here("classify-image", "--model", tmp_path / "swin", "shapes/light/0.png", "--resize",
                    cwd=work)).stdout
    assert lines.split("\t")[0] in ("dark", "light")
    one_line_error(here("classify-image", "--model", tmp_path / "swin", "shapes/light/0.png", "--resize",
                        "--attention", tmp_path / "a.png", cwd=work), "is a Swin", "has none")


def test_train_clip_then_zero_shot_by_names(here, work, tmp_path):
    proc = ok(here("train", "clip", "--data", "digits", "--out", tmp_path / "clip", "--max-steps", "6",
                   "--patch-size", "2", "--n-layers", "1", "--text-layers", "1", "--projection-dim", "16",
                   "--vocab-size", "200", *SMALL, cwd=work))
    assert "zero-shot test accuracy: " in proc.stdout and "held-out templates" in proc.stdout
    assert "image to text@5" in proc.stdout
    run = tmp_path / "clip"
    config = json.loads((run / "best" / "config.json").read_text())
    assert config["arch"] == "clip" and config["class_names"] == [str(d) for d in range(10)]
    lines = ok(here("zero-shot", "--model", run, "--labels", "0, 1, 2", "digit0.png", "digit1.png",
                    "--attention", tmp_path / "att.png", cwd=work)).stdout.splitlines()
    assert len(lines) == 2 and lines[0].split("\t")[0] in ("0", "1", "2")
    assert (tmp_path / "att.png").read_bytes()[:8] == PNG_MAGIC
    summary = ok(here("zero-shot", "--model", run, "--data", "digits", "--template", "a photo of a {}.",
                      cwd=work)).stdout
    assert summary.startswith("zero-shot accuracy: ") and "1 templates" in summary
    one_line_error(here("zero-shot", "--model", run, "--labels", "0,,2", "digit0.png", cwd=work), "empty label")
    one_line_error(here("zero-shot", "--model", run, "--labels", " , ", "digit0.png", cwd=work), "empty label")
    one_line_error(here("zero-shot", "--model", run, "digit0.png", cwd=work), "no labels")
    one_line_error(here("zero-shot", "--model", run, "--labels", "a,b", "--template", "a photo", "digit0.png",
                        cwd=work), "has no {}")
    one_line_error(here("classify-image", "--model", run, "digit0.png", cwd=work), "not an image classifier")


def test_bad_training_data_is_one_clear_line(here, work, tmp_path):
    last_line_error(here("train", "vit", "--data", "nowhere", "--out", tmp_path / "a", "--max-steps", "1", cwd=work),
                    "no such folder", "fashion-mnist / digits")
    (work / "one" / "only").mkdir(parents=True, exist_ok=True)
    last_line_error(here("train", "swin", "--data", "one", "--out", tmp_path / "b", "--max-steps", "1", cwd=work),
                    "at least 2")
    last_line_error(here("train", "vit", "--data", "digits", "--patch-size", "3", "--out", tmp_path / "c",
                         "--max-steps", "1", cwd=work), "divisible by patch_size=3")


def _write_idx(path: Path, values, *, compress: bool) -> None:
    """An IDX file of unsigned bytes: magic 0x0000080N (N dimensions), each dimension big-endian, then the bytes."""
    data = struct.pack(">4B", 0, 0, 8, values.dim()) + struct.pack(f">{values.dim()}I", *values.shape)
    data += values.to(torch.uint8).numpy().tobytes()
    path.write_bytes(gzip.compress(data) if compress else data)


@pytest.fixture(scope="module")
def idx_folder(tmp_path_factory) -> Path:
    """Fashion-MNIST's four files in a folder of the user's own: 40 training and 10 test images of 28×28, the
    training files gzipped as Zalando ships them, the test files plain (as after gunzip)."""
    root = tmp_path_factory.mktemp("idx") / "my-fashion"
    root.mkdir()
    g = torch.Generator().manual_seed(0)
    for prefix, n, compress in (("train", 40, True), ("t10k", 10, False)):
        suffix = ".gz" if compress else ""
        labels = torch.arange(n) % 10
        images = torch.randint(0, 256, (n, 28, 28), generator=g)
        _write_idx(root / f"{prefix}-images-idx3-ubyte{suffix}", images, compress=compress)
        _write_idx(root / f"{prefix}-labels-idx1-ubyte{suffix}", labels, compress=compress)
    return root


def test_train_vit_on_a_folder_of_fashion_mnist_idx_files(work, idx_folder, tmp_path):
    """--data DIR of IDX files is read as Fashion-MNIST (28×28 grey, its ten classes, its t10k files the test
    split, mirrored); classify-image --data DIR scores its t10k files."""
    run = tmp_path / "vit-idx"
    proc = ok(qkv("train", "vit", "--data", idx_folder, "--out", run, "--max-steps", "2",
                  "--patch-size", "7", "--n-layers", "1", "--d-ff", "64", *SMALL, cwd=work))
    # its own test split and mirror images, as --data fashion-mnist
    assert "36 training, 4 validation, 10 test images of 1x28x28, 10 classes; augmented: mirrored" in proc.stderr
    assert "on 10 my-fashion test images" in proc.stdout
    config = json.loads((run / "best" / "config.json").read_text())
    assert config["labels"][9] == "Ankle boot" and config["image_shape"] == [1, 28, 28]
    summary = ok(qkv("classify-image", "--model", run, "--data", idx_folder, cwd=work)).stdout
    assert summary.startswith("accuracy: ") and f"on 10 {idx_folder} test images" in summary


def test_a_damaged_idx_file_is_one_clear_line(here, work, vit_run, idx_folder, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(idx_folder, broken)
    images = broken / "train-images-idx3-ubyte.gz"
    images.write_bytes(images.read_bytes()[: len(images.read_bytes()) // 2])  # a download cut short
    last_line_error(here("train", "vit", "--data", broken, "--out", tmp_path / "a", "--max-steps", "1", cwd=work),
                    "train-images-idx3-ubyte.gz", "cannot read it")
    (broken / "t10k-labels-idx1-ubyte").unlink()
    one_line_error(here("classify-image", "--model", vit_run, "--data", broken, cwd=work),
                   "no t10k-labels-idx1-ubyte(.gz) beside it")
