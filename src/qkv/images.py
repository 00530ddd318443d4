"""Labelled images for the vision models: Fashion-MNIST, scikit-learn's 8×8 digits, or a folder of class
subfolders; images from PNG/JPEG files; augmentation.

A dataset here is uint8 pixels ``(N, C, H, W)``, integer labels ``(N,)`` and the class names. Models read
floats: :func:`normalize` maps a pixel *p* in 0..255 to ``(p / 255 - mean) / std`` with the training set's own
per-channel mean and spread, which are saved with the model so that an image is read the same way later.

Fashion-MNIST comes in IDX files, a format of its own: a 4-byte magic number (two zero bytes, a type code
``0x08`` for unsigned bytes, the number of dimensions), each dimension's size as a big-endian 32-bit integer,
then the values row by row. :func:`read_idx` reads it (gzipped or not) with the standard library alone.
"""

from __future__ import annotations

import gzip
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from .data import DataError

FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
FASHION_MNIST_CLASSES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag",
                         "Ankle boot")
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")


@dataclass
class ImageSet:
    pixels: Tensor  # (N, C, H, W) uint8
    labels: Tensor  # (N,) int64
    classes: list[str]

    def __len__(self) -> int:
        return len(self.labels)


def read_idx(path: str | Path) -> Tensor:
    """The array in an IDX file of unsigned bytes (``.gz`` or plain) as a uint8 tensor.

    Raises:
        DataError: a missing file, or one that is not an IDX file of unsigned bytes.
    """
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise DataError(f"{path}: no such file") from None
    except (OSError, EOFError) as err:
        raise DataError(f"{path}: cannot read it ({err})") from None
    if len(data) < 4 or data[:2] != b"\0\0" or data[2] != 0x08:
        raise DataError(f"{path}: not an IDX file of unsigned bytes (magic {data[:4].hex()}, expected 000008xx)")
    dims = struct.unpack(f">{data[3]}I", data[4 : 4 + 4 * data[3]])
    values = np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * len(dims))
    if values.size != int(np.prod(dims)):
        raise DataError(f"{path}: {values.size} values for the dimensions {dims}; the file is cut short")
    return torch.from_numpy(values.reshape(dims).copy())


def load_fashion_mnist(split: str, root: str | Path = FASHION_MNIST_DIR) -> ImageSet:
    """Fashion-MNIST's ``"train"`` (60,000) or ``"test"`` (10,000) images, 28×28 grey, 10 classes.

    Raises:
        DataError: the dataset is not installed (the message says how to install it).
    """
    prefix = {"train": "train", "test": "t10k"}[split]
    root = Path(root)
    images, labels = root / f"{prefix}-images-idx3-ubyte.gz", root / f"{prefix}-labels-idx1-ubyte.gz"
    if not images.exists():
        raise DataError(f"Fashion-MNIST is not installed ({images} is missing): sudo apt-get install "
                        "dataset-fashion-mnist")
    return ImageSet(read_idx(images)[:, None], read_idx(labels).long(), list(FASHION_MNIST_CLASSES))


def load_digits(split: str, *, test_fraction: float = 0.2, seed: int = 0) -> ImageSet:
    """scikit-learn's 1,797 8×8 handwritten digits (16 grey levels, scaled to 0..255), split at random."""
    from sklearn.datasets import load_digits as sklearn_digits

    data = sklearn_digits()
    pixels = torch.from_numpy((data.images * (255 / 16)).round().astype(np.uint8))[:, None]  # (N, 1, 8, 8)
    order = torch.randperm(len(pixels), generator=torch.Generator().manual_seed(seed))
    n_test = round(len(order) * test_fraction)
    rows = order[:n_test] if split == "test" else order[n_test:]
    return ImageSet(pixels[rows], torch.from_numpy(data.target).long()[rows], [str(d) for d in range(10)])


def _channels_of(mode: str) -> int:
    """Colour channels of a Pillow image mode, an alpha channel not counted: 1 for grey, 3 for colour."""
    return 1 if mode in ("1", "L", "LA", "I", "I;16", "F") else 3


def read_image(path: str | Path, *, channels: int, size: tuple[int, int] | None = None,
               convert: bool = True) -> Tensor:
    """One PNG or JPEG file as uint8 ``(C, H, W)``.

    Args:
        channels: 1 (grey) or 3 (RGB).
        size: ``(H, W)`` the image must have (None: any).
        convert: convert colour to grey (or grey to RGB) and resize to ``size`` where the file differs;
            without it, a file with another channel count or size is an error.

    Raises:
        DataError: a missing file, an unsupported type, a file Pillow cannot read, or (``convert=False``) one
            of another size or channel count.
    """
    from PIL import Image, UnidentifiedImageError

    path = Path(path)
    if path.suffix.lower() not in IMAGE_SUFFIXES:
        raise DataError(f"{path}: not a PNG or JPEG file (expected {', '.join(IMAGE_SUFFIXES)})")
    try:
        with Image.open(path) as image:
            if not convert:
                _check_image(path, image, channels, size)
            return _pixels(image, channels, size)
    except FileNotFoundError:
        raise DataError(f"{path}: no such file") from None
    except (UnidentifiedImageError, OSError) as err:
        raise DataError(f"{path}: cannot read the image ({err})") from None


def image_from_bytes(data: bytes, *, channels: int, size: tuple[int, int] | None = None) -> Tensor:
    """The bytes of a PNG or JPEG file (an upload) as uint8 ``(C, H, W)``, converted to ``channels`` and resized
    to ``size`` as :func:`read_image` does.

    Raises:
        DataError: bytes Pillow cannot read as an image.
    """
    import io

    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as image:
            if image.format not in ("PNG", "JPEG"):
                raise DataError(f"the image is a {image.format} file; send a PNG or JPEG")
            return _pixels(image, channels, size)
    except (UnidentifiedImageError, OSError) as err:
        raise DataError(f"cannot read the image ({err}); send a PNG or JPEG") from None


def _pixels(image, channels: int, size: tuple[int, int] | None) -> Tensor:
    """A Pillow image as uint8 ``(C, H, W)``, converted to ``channels`` and resized to ``size`` (H, W)."""
    from PIL import Image

    image = image.convert("L" if channels == 1 else "RGB")
    if size is not None and image.size != (size[1], size[0]):
        image = image.resize((size[1], size[0]), Image.Resampling.BILINEAR)
    array = np.asarray(image, dtype=np.uint8)
    return torch.from_numpy(array.copy()).reshape(array.shape[0], array.shape[1], -1).permute(2, 0, 1)


def _check_image(path: Path, image, channels: int, size: tuple[int, int] | None) -> None:
    have = _channels_of(image.mode)
    kinds = {1: "grey", 3: "colour"}
    if have != channels:
        raise DataError(f"{path}: a {kinds[have]} image ({have} channel{'s' * (have > 1)}), but the model reads "
                        f"{kinds[channels]} images ({channels}); convert it, or pass --resize to let qkv do it")
    if size is not None and image.size != (size[1], size[0]):
        raise DataError(f"{path}: {image.size[1]}x{image.size[0]} pixels (height x width), but the model reads "
                        f"{size[0]}x{size[1]}; resize it, or pass --resize to let qkv do it")


def load_image_folder(root: str | Path, *, channels: int, size: tuple[int, int]) -> ImageSet:
    """Images from ``root/<class>/*.png|jpg``, one subfolder per class (sorted by name), all resized to
    ``size``.

    Raises:
        DataError: no such folder, fewer than two class folders, or a class without images.
    """
    root = Path(root)
    if not root.is_dir():
        raise DataError(f"{root}: no such folder; give a folder with one subfolder of images per class, or "
                        "fashion-mnist / digits")
    classes = sorted(p.name for p in root.iterdir() if p.is_dir())
    if len(classes) < 2:
        raise DataError(f"{root}: found {len(classes)} class subfolder(s); a classifier needs at least 2")
    pixels, labels = [], []
    for label, name in enumerate(classes):
        files = sorted(p for p in (root / name).iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
        if not files:
            raise DataError(f"{root / name}: no PNG or JPEG images")
        pixels += [read_image(f, channels=channels, size=size) for f in files]
        labels += [label] * len(files)
    return ImageSet(torch.stack(pixels), torch.tensor(labels), classes)


def split_images(images: ImageSet, fraction: float, *, seed: int = 0) -> tuple[ImageSet, ImageSet]:
    """A random ``fraction`` of ``images`` held out (at least one image each side): ``(kept, held_out)``.

    Raises:
        DataError: too few images to split.
    """
    n_out = min(max(1, round(len(images) * fraction)), len(images) - 1)
    if n_out < 1:
        raise DataError(f"{len(images)} image(s) cannot be split into training and validation images")
    order = torch.randperm(len(images), generator=torch.Generator().manual_seed(seed))
    take = lambda rows: ImageSet(images.pixels[rows], images.labels[rows], images.classes)  # noqa: E731
    return take(order[n_out:]), take(order[:n_out])


def load_dataset(name: str, split: str, *, channels: int = 3, size: tuple[int, int] = (32, 32)) -> ImageSet:
    """``"fashion-mnist"``, ``"digits"`` (their ``"train"`` or ``"test"`` split), or a folder of class
    subfolders (read whole, at ``channels`` and ``size``)."""
    if name == "fashion-mnist":
        return load_fashion_mnist(split)
    if name == "digits":
        return load_digits(split)
    return load_image_folder(name, channels=channels, size=size)


def channel_stats(pixels: Tensor) -> tuple[list[float], list[float]]:
    """Per-channel mean and standard deviation of uint8 images ``(N, C, H, W)``, on the 0..1 scale."""
    x = pixels.float().div(255).transpose(0, 1).flatten(1)  # (C, N·H·W)
    return x.mean(1).tolist(), x.std(1).clamp(min=1e-3).tolist()


def normalize(pixels: Tensor, mean: list[float], std: list[float]) -> Tensor:
    """uint8 ``(N, C, H, W)`` -> float ``(p / 255 - mean) / std`` per channel."""
    m = torch.tensor(mean, device=pixels.device)[:, None, None]
    s = torch.tensor(std, device=pixels.device)[:, None, None]
    return (pixels.float() / 255 - m) / s


def augment(pixels: Tensor, *, pad: int, flip: bool, generator: torch.Generator) -> Tensor:
    """Random crops after zero padding by ``pad`` pixels each side (a shift of up to ``pad`` pixels), and
    horizontal flips of half the images when ``flip`` (only where a mirror image keeps its label: clothes, not
    digits). ``(N, C, H, W)`` -> same, same dtype."""
    n, _, h, w = pixels.shape
    if pad:
        padded = F.pad(pixels, (pad, pad, pad, pad))
        dy = torch.randint(0, 2 * pad + 1, (n,), generator=generator)
        dx = torch.randint(0, 2 * pad + 1, (n,), generator=generator)
        rows = (dy[:, None] + torch.arange(h))[:, None, :, None]  # (N, 1, H, 1)
        cols = (dx[:, None] + torch.arange(w))[:, None, None, :]  # (N, 1, 1, W)
        pixels = padded[torch.arange(n)[:, None, None, None], torch.arange(pixels.size(1))[None, :, None, None],
                        rows, cols]
    if flip:
        mirrored = torch.rand(n, generator=generator) < 0.5
        pixels = torch.where(mirrored[:, None, None, None], pixels.flip(-1), pixels)
    return pixels
