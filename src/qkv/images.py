"""Labelled images for the vision models: Fashion-MNIST (Debian's copy or any folder of its IDX files),
scikit-learn's 8×8 digits, or a folder of class subfolders; images from PNG/JPEG files; augmentation.

A dataset here is uint8 pixels ``(N, C, H, W)``, integer labels ``(N,)`` and the class names. Models read
floats: :func:`normalize` maps a pixel *p* in 0..255 to ``(p / 255 - mean) / std`` with the training set's own
per-channel mean and spread, which are saved with the model so that an image is read the same way later.

Fashion-MNIST comes in IDX files, a format of its own: a 4-byte magic number (two zero bytes, a type code
``0x08`` for unsigned bytes, the number of dimensions), each dimension's size as a big-endian 32-bit integer,
then the values row by row. :func:`read_idx` reads it (gzipped or not) with the standard library alone.
"""

from __future__ import annotations

import gzip
import importlib.util
import math
import struct
import zlib
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
MAX_IMAGE_BYTES = 1 << 28  # 256 MiB: far beyond any photo's file, and read no further


@dataclass
class ImageSet:
    pixels: Tensor  # (N, C, H, W) uint8
    labels: Tensor  # (N,) int64
    classes: list[str]

    def __len__(self) -> int:
        return len(self.labels)


def read_idx(path: str | Path) -> Tensor:
    """The array in an IDX file of unsigned bytes (``.gz`` or plain) as a uint8 tensor.

    The header is checked before the values are read: the values are read only up to the size its dimensions
    announce, so a forged header cannot make qkv allocate more than the file holds.

    Raises:
        DataError: a missing file, one that is not an IDX file of unsigned bytes, a header cut short, dimensions
            with no values (none, or a zero), or values that do not fill the dimensions exactly; a gzip file that
            is corrupt.
    """
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            dims, need = _idx_header(path, f.read(4), f)
            values = _read_at_most(f, need + 1)  # one more than needed: extra values are an error too
    except FileNotFoundError:
        raise DataError(f"{path}: no such file") from None
    except (OSError, EOFError, zlib.error) as err:  # BadGzipFile is an OSError; a cut gzip stream an EOFError
        raise DataError(f"{path}: cannot read it ({err})") from None
    if len(values) < need:
        raise DataError(f"{path}: {len(values)} values for the dimensions {dims}, which need {need}; the file is "
                        "cut short")
    if len(values) > need:
        raise DataError(f"{path}: more values than the dimensions {dims} need ({need}); its header is wrong")
    return torch.frombuffer(values, dtype=torch.uint8).reshape(dims)


def _read_at_most(f, n: int) -> bytearray:
    """Up to ``n`` bytes of ``f``, read a piece at a time: ``f.read(n)`` would allocate ``n`` bytes at once, however
    few the file holds."""
    data = bytearray()
    while len(data) < n and (piece := f.read(min(1 << 24, n - len(data)))):
        data += piece
    return data


def _idx_header(path: Path, magic: bytes, f) -> tuple[tuple[int, ...], int]:
    """The dimensions in an IDX header whose magic number is ``magic`` (the rest read from ``f``), and the number
    of values they need."""
    if len(magic) < 4 or magic[:2] != b"\0\0" or magic[2] != 0x08:
        raise DataError(f"{path}: not an IDX file of unsigned bytes (magic {magic.hex()}, expected 000008xx)")
    header = f.read(4 * magic[3])
    if len(header) < 4 * magic[3]:
        raise DataError(f"{path}: the header announces {magic[3]} dimensions but the file ends after "
                        f"{len(header) // 4}; the file is cut short")
    dims = struct.unpack(f">{magic[3]}I", header)
    if not dims or 0 in dims:
        raise DataError(f"{path}: the dimensions {dims} hold no values; an IDX file of images or labels has some")
    size = path.stat().st_size if path.suffix != ".gz" else None
    need = math.prod(dims)  # a Python int: no overflow, however large the dimensions
    if size is not None and need > size - 4 - len(header):
        raise DataError(f"{path}: the dimensions {dims} need {need} values, but the file holds only "
                        f"{size - 4 - len(header)}; the file is cut short or its header is wrong")
    return dims, need


IDX_PREFIXES = {"train": "train", "test": "t10k"}
"""Fashion-MNIST's file names start with these: ``train-images-idx3-ubyte.gz``, ``t10k-labels-idx1-ubyte.gz``, ..."""


def _idx_file(root: Path, name: str) -> Path | None:
    """``root/name.gz`` or ``root/name``, whichever exists (the gzipped one first, as Zalando ships them)."""
    for path in (root / f"{name}.gz", root / name):
        if path.is_file():
            return path
    return None


def is_idx_folder(path: str | Path) -> bool:
    """Whether ``path`` is a folder holding Fashion-MNIST's images in IDX files (``train-images-idx3-ubyte`` or
    ``t10k-images-idx3-ubyte``, gzipped or not), as Zalando publishes them: such a folder is read as Fashion-MNIST
    by :func:`load_dataset`."""
    root = Path(path)
    return root.is_dir() and any(_idx_file(root, f"{prefix}-images-idx3-ubyte") for prefix in IDX_PREFIXES.values())


def load_fashion_mnist(split: str, root: str | Path = FASHION_MNIST_DIR) -> ImageSet:
    """Fashion-MNIST's ``"train"`` (60,000) or ``"test"`` (10,000) images, 28×28 grey, 10 classes, from the IDX
    files in ``root`` (gzipped or not): by default where Debian's ``dataset-fashion-mnist`` puts them.

    Raises:
        DataError: the files are not there (the message says where to get them); an IDX file is damaged (see
            :func:`read_idx`); the images and labels files do not agree (shapes, counts) or a label is not one of
            the 10 classes.
    """
    prefix = IDX_PREFIXES[split]
    root = Path(root)
    images = _idx_file(root, f"{prefix}-images-idx3-ubyte")
    if images is None:
        if root == FASHION_MNIST_DIR:
            raise DataError(f"Fashion-MNIST is not installed ({root}/{prefix}-images-idx3-ubyte.gz is missing): sudo "
                            "apt-get install dataset-fashion-mnist, or give --data the folder of its IDX files")
        raise DataError(f"{root}: no {prefix}-images-idx3-ubyte(.gz), the {split} images of Fashion-MNIST's IDX "
                        "files (Zalando's, or sudo apt-get install dataset-fashion-mnist)")
    labels = _idx_file(root, f"{prefix}-labels-idx1-ubyte")
    if labels is None:
        raise DataError(f"{root}: {images.name} has no {prefix}-labels-idx1-ubyte(.gz) beside it; the {split} labels "
                        "are needed too")
    pixels, targets = read_idx(images), read_idx(labels)
    if pixels.dim() != 3 or targets.dim() != 1:
        raise DataError(f"{images} holds {tuple(pixels.shape)} and {labels} {tuple(targets.shape)}; expected "
                        "(images, height, width) and (labels,)")
    if len(pixels) != len(targets):
        raise DataError(f"{images} holds {len(pixels)} images but {labels} {len(targets)} labels; they must agree")
    if int(targets.max()) >= len(FASHION_MNIST_CLASSES):
        raise DataError(f"{labels}: label {int(targets.max())} is not a class; Fashion-MNIST's labels are 0 to "
                        f"{len(FASHION_MNIST_CLASSES) - 1}")
    return ImageSet(pixels[:, None], targets.long(), list(FASHION_MNIST_CLASSES))


def load_digits(split: str, *, test_fraction: float = 0.2, seed: int = 0) -> ImageSet:
    """scikit-learn's 1,797 8×8 handwritten digits (16 grey levels, scaled to 0..255), split at random. Read from
    the CSV file scikit-learn ships (64 grey levels and the label per row), without importing scikit-learn."""
    table = np.loadtxt(_sklearn_file("datasets/data/digits.csv.gz"), delimiter=",", dtype=np.float64)
    images, targets = table[:, :64].reshape(-1, 8, 8), table[:, 64].astype(np.int64)
    pixels = torch.from_numpy((images * (255 / 16)).round().astype(np.uint8))[:, None]  # (N, 1, 8, 8)
    order = torch.randperm(len(pixels), generator=torch.Generator().manual_seed(seed))
    n_test = round(len(order) * test_fraction)
    rows = order[:n_test] if split == "test" else order[n_test:]
    return ImageSet(pixels[rows], torch.from_numpy(targets)[rows], [str(d) for d in range(10)])


def _sklearn_file(name: str) -> Path:
    """A data file inside the installed scikit-learn package, found without running its import."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise DataError("the digits come with scikit-learn: pip install scikit-learn")
    path = Path(spec.submodule_search_locations[0]) / name
    if not path.is_file():
        raise DataError(f"scikit-learn at {path.parents[2]} has no {name}: reinstall it (pip install scikit-learn)")
    return path


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
        DataError: a missing file, one that is not a regular file (a device, a FIFO, a link to one) or is larger
            than :data:`MAX_IMAGE_BYTES`, an unsupported type, a file that is not a whole PNG or JPEG image (see
            :func:`decode_image`), or (``convert=False``) one of another size or channel count.
    """
    from .files import read_bounded

    path = Path(path)
    if path.suffix.lower() not in IMAGE_SUFFIXES:
        raise DataError(f"{path}: not a PNG or JPEG file (expected {', '.join(IMAGE_SUFFIXES)})")
    try:  # a regular file, checked before it is opened: never a device (/dev/zero) or a FIFO that never ends
        data = read_bounded(path, max_bytes=MAX_IMAGE_BYTES, max_line=MAX_IMAGE_BYTES)
    except ValueError as err:
        raise DataError(str(err)) from None
    image = decode_image(data, name=str(path))
    if not convert:
        _check_image(path, image, channels, size)
    return _pixels(image, channels, size)


def image_from_bytes(data: bytes, *, channels: int, size: tuple[int, int] | None = None) -> Tensor:
    """The bytes of a PNG or JPEG file (an upload) as uint8 ``(C, H, W)``, converted to ``channels`` and resized
    to ``size`` as :func:`read_image` does.

    Raises:
        DataError: bytes that are not a whole PNG or JPEG image (see :func:`decode_image`).
    """
    return _pixels(decode_image(data, name="the upload"), channels, size)


def decode_image(data: bytes, *, name: str):
    """The bytes of a PNG or JPEG file as a Pillow image, decoded whole: the one place where qkv opens an image.

    Pillow is asked for those two formats alone, so that no other decoder ever sees the bytes (Pillow hands EPS
    files to Ghostscript); its decompression-bomb limit (``Image.MAX_IMAGE_PIXELS``) is an error, not a warning;
    and a file that holds fewer pixels than its header announces is refused rather than padded with black.

    Raises:
        DataError: one line naming ``name``, for any of these, or bytes Pillow cannot decode.
    """
    import io
    import warnings

    from PIL import Image, ImageFile, UnidentifiedImageError

    ImageFile.LOAD_TRUNCATED_IMAGES = False  # process-wide; qkv never wants a cut image filled in
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=["PNG", "JPEG"])
            image.load()
    except (Image.DecompressionBombWarning, Image.DecompressionBombError) as err:
        raise DataError(f"{name}: the image is too large to decode safely ({err}); shrink it first") from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, EOFError, struct.error) as err:
        raise _undecodable(data, name, err) from None
    if image.format == "PNG":
        _check_png_complete(data, name)
    return image


_SIGNATURES = {"PNG": b"\x89PNG\r\n\x1a\n", "JPEG": b"\xff\xd8\xff"}  # how each format's files begin


def _undecodable(data: bytes, name: str, err: Exception) -> DataError:
    """Why Pillow could not decode ``data``: bytes that begin as a PNG or JPEG file does are one cut short or
    damaged (Pillow calls a PNG cut inside its header "not an image"); anything else is not such a file."""
    from PIL import UnidentifiedImageError

    kind = next((kind for kind, magic in _SIGNATURES.items() if data.startswith(magic)), None)
    if kind is None:
        return DataError(f"{name}: cannot read the image: it is not a PNG or JPEG file (qkv reads only those)")
    # Pillow's own words, but for "cannot identify image file <_io.BytesIO object at 0x...>", which says nothing
    said = "" if isinstance(err, UnidentifiedImageError) else f": {str(err) or type(err).__name__}"
    return DataError(f"{name}: cannot read the image: a {kind} file cut short or damaged ({len(data):,} bytes"
                     f"{said}); copy or export it again")


# (x0, y0, dx, dy) of Adam7's seven passes: an interlaced PNG stores each as its own small image.
_ADAM7 = ((0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2), (0, 1, 1, 2))
_PNG_CHANNELS = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}  # colour type -> samples per pixel


def _check_png_complete(data: bytes, name: str) -> None:
    """Refuse a PNG whose compressed pixels end before its header's height: Pillow fills the rest with zeros
    without a word (a zlib stream that ends cleanly is not "truncated" to it).

    Counts the decompressed bytes chunk by chunk, never holding more than a megabyte of them."""
    width, height, depth, colour, _, _, interlace = struct.unpack(">IIBBBBB", data[16:29])
    bits = depth * _PNG_CHANNELS.get(colour, 4)
    rows = [(height, width)] if not interlace else [
        (-(-(height - y0) // dy), -(-(width - x0) // dx)) for x0, y0, dx, dy in _ADAM7]
    expected = sum(h * (1 + -(-w * bits // 8)) for h, w in rows if h and w)  # a filter byte leads each row
    inflate, got, at = zlib.decompressobj(), 0, 8
    while at + 8 <= len(data) and got < expected:
        length, kind = struct.unpack(">I4s", data[at : at + 8])
        if kind == b"IDAT":
            pending = data[at + 8 : at + 8 + length]
            while pending and got < expected and not inflate.eof:
                try:
                    got += len(inflate.decompress(pending, 1 << 20))
                except zlib.error as err:
                    raise DataError(f"{name}: cannot read the image ({err})") from None
                pending = inflate.unconsumed_tail
        at += 12 + length
    if got < expected:
        raise DataError(f"{name}: cannot read the image: the file holds {got:,} of the {expected:,} bytes of pixels "
                        f"its header announces for {width}x{height} pixels (it is cut short)")


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
        raise DataError(f"{root}: no such folder; give a folder with one subfolder of images per class, a folder of "
                        "Fashion-MNIST's IDX files, or fashion-mnist / digits")
    classes = sorted(p.name for p in root.iterdir() if p.is_dir())
    if len(classes) < 2:
        raise DataError(f"{root}: found {len(classes)} class subfolder(s); a classifier needs at least 2 (or "
                        "Fashion-MNIST's IDX files: train-images-idx3-ubyte.gz and the rest)")
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
    """``"fashion-mnist"`` (Debian's copy), ``"digits"``, or a folder holding Fashion-MNIST's IDX files (their
    ``"train"`` or ``"test"`` split each); else a folder of class subfolders (read whole, at ``channels`` and
    ``size``)."""
    if name == "fashion-mnist":
        return load_fashion_mnist(split)
    if name == "digits":
        return load_digits(split)
    if is_idx_folder(name):
        return load_fashion_mnist(split, name)
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
