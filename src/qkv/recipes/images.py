"""What the image recipes (``qkv train vit``, ``swin``, ``clip``) share: a dataset by name or a folder of class
subfolders, split into training and validation images, augmented by shifts and mirrors."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from .base import Recipe
from .settings import TrainingSettings

log = logging.getLogger("qkv")

DATASETS = ("fashion-mnist", "digits")


@dataclass
class ImageSettings(TrainingSettings):
    data: str = "fashion-mnist"
    test_data: str | None = None
    valid_fraction: float = 0.1
    image_size: int = 32
    channels: int = 3
    pad: int | None = None
    flip: bool | None = None
    preset: str = "fashion"
    patch_size: int | None = None
    d_model: int | None = None
    n_heads: int | None = None
    n_layers: int | None = None
    d_ff: int | None = None
    dropout: float | None = None
    batch_size: int = 128
    lr: float | None = 1e-3
    warmup: int = 300
    weight_decay: float = 0.05


def _own_test_split(data: str) -> bool:
    """A named dataset, or a folder of Fashion-MNIST's IDX files (train and t10k), brings its own test split."""
    from ..images import is_idx_folder

    return data in DATASETS or is_idx_folder(data)


class ImageRecipe(Recipe):
    """An image recipe: :meth:`datasets` reads and splits the images and picks the augmentation."""

    def prepare(self) -> None:
        """A named dataset brings its own test split; a --data folder is stored absolute, for --resume."""
        args = self.args
        data = args.data if args.data is not None else ImageSettings.data
        if args.test_data is not None and _own_test_split(data) and not args.resume:  # a resumed run was checked before
            raise ValueError(f"--test-data {args.test_data}: --data {data} has its own test split, which is what is "
                             "scored; drop --test-data, or give --data a folder of class subfolders")
        for key in ("data", "test_data"):
            value = getattr(args, key, None)
            if value is not None and value not in DATASETS:
                setattr(args, key, str(Path(value).resolve()))

    def datasets(self) -> None:
        """Sets train, valid, test (None for a folder without --test-data), flip and pad."""
        from ..images import is_idx_folder, load_dataset, split_images

        s = self.s
        size = (s.image_size, s.image_size)
        images = load_dataset(s.data, "train", channels=s.channels, size=size)
        self.train, self.valid = split_images(images, s.valid_fraction, seed=s.seed)
        self.test = None
        if _own_test_split(s.data):
            self.test = load_dataset(s.data, "test")
        elif s.test_data:
            self.test = load_dataset(s.test_data, "test", channels=s.channels, size=size)
            if self.test.classes != self.train.classes:
                raise ValueError(f"--test-data has the classes {self.test.classes}, --data {self.train.classes}; "
                                 "they must match")
        side = self.train.pixels.size(-1)
        self.flip = s.flip if s.flip is not None else s.data == "fashion-mnist" or is_idx_folder(s.data)
        self.pad = s.pad if s.pad is not None else max(1, round(side / 14))
        test = f", {len(self.test)} test" if self.test is not None else ""
        augmented = [f"shifts of up to {self.pad} px"] * bool(self.pad) + ["mirrored"] * self.flip
        log.info("data: %d training, %d validation%s images of %s, %d classes; augmented: %s",
                 len(self.train), len(self.valid), test, "x".join(map(str, self.train.pixels.shape[1:])),
                 len(self.train.classes), ", ".join(augmented) or "no")

    def statistics(self, previous) -> None:
        """Sets mean and std: the channel statistics of the training images, or the resumed run's."""
        from ..images import channel_stats

        if previous is not None:
            self.mean, self.std = previous.meta["mean"], previous.meta["std"]
        else:
            self.mean, self.std = channel_stats(self.train.pixels)

    def test_name(self) -> str:
        return Path(self.s.test_data or self.s.data).name


def image_fields(train) -> dict:
    """The config fields the data decides: image size, channels, classes."""
    channels, height, width = train.pixels.shape[1:]
    if height != width:
        raise ValueError(f"the images are {height}x{width}; qkv's vision models read square images (--image-size)")
    return dict(image_size=height, channels=channels, n_classes=len(train.classes))
