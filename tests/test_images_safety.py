"""Image files are read only as PNG or JPEG, whole, and within Pillow's decompression-bomb limit: whatever the
name says, another format never reaches its decoder (EPS would reach Ghostscript), and a bomb, a file shorter
than its header or bytes of another kind are each one line naming the file."""

import io
import struct
import warnings
import zlib

import numpy as np
import pytest
from PIL import EpsImagePlugin, Image, ImageFile

from qkv.data import DataError
from qkv.images import decode_image, image_from_bytes, load_fashion_mnist, load_image_folder, read_idx, read_image

EPS = b"""%!PS-Adobe-3.0 EPSF-3.0
%%BoundingBox: 0 0 8 8
newpath 0 0 moveto 8 8 lineto stroke
showpage
%%EOF
"""


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def _grey_png(width: int, height: int, rows: int, *, interlace: bool = False) -> bytes:
    """An 8-bit grey PNG whose header says ``width`` x ``height`` and whose pixel data ends after ``rows`` rows
    (without interlace) or holds every Adam7 pass (with it): a clean zlib stream either way."""
    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, int(interlace))
    if interlace:
        passes = ((0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2), (0, 1, 1, 2))
        sizes = [(-(-(height - y) // dy), -(-(width - x) // dx)) for x, y, dx, dy in passes]
        raw = b"".join((b"\0" + b"\x64" * w) * h for h, w in sizes if h and w)
    else:
        raw = (b"\0" + b"\x64" * width) * rows
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header) + _chunk(b"IDAT", zlib.compress(raw))
            + _chunk(b"IEND", b""))


@pytest.fixture
def ghostscript_calls(monkeypatch):
    """Every call Pillow makes to Ghostscript (none may happen), without running it."""
    calls = []

    def fake(*args, **kwargs):
        calls.append(args)
        raise OSError("Ghostscript must not run")

    monkeypatch.setattr(EpsImagePlugin, "Ghostscript", fake)
    return calls


def test_an_eps_file_named_png_never_reaches_ghostscript(tmp_path, ghostscript_calls):
    (tmp_path / "x.png").write_bytes(EPS)
    with pytest.raises(DataError, match=r"x.png: cannot read the image: it is not a PNG or JPEG file"):
        read_image(tmp_path / "x.png", channels=1)
    with pytest.raises(DataError, match="the upload: cannot read the image: it is not a PNG or JPEG file"):
        image_from_bytes(EPS, channels=1)
    for name in ("a", "b"):  # qkv train vit --data DIR
        (tmp_path / "data" / name).mkdir(parents=True)
        Image.new("L", (8, 8), 9).save(tmp_path / "data" / name / "ok.png")
    (tmp_path / "data" / "b" / "x.png").write_bytes(EPS)
    with pytest.raises(DataError, match=r"b/x.png: cannot read the image: it is not a PNG or JPEG file"):
        load_image_folder(tmp_path / "data", channels=1, size=(8, 8))
    assert ghostscript_calls == []


def test_a_png_shorter_than_its_header_is_refused(tmp_path):
    (tmp_path / "cut.png").write_bytes(_grey_png(3000, 3000, rows=3))
    with pytest.raises(DataError, match=r"cut.png: .*9,003 of the 9,003,000 bytes of pixels .* 3000x3000 pixels "
                                        r"\(it is cut short\)"):
        read_image(tmp_path / "cut.png", channels=1, size=(8, 8))
    whole = _grey_png(20, 20, rows=20)
    assert image_from_bytes(whole, channels=1).shape == (1, 20, 20)
    assert image_from_bytes(_grey_png(13, 11, rows=0, interlace=True), channels=1).shape == (1, 11, 13)


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_a_file_cut_short_is_refused_even_if_pillow_was_told_to_fill_it_in(monkeypatch, fmt):
    buffer = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 64), dtype=np.uint8)).save(buffer, fmt)
    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", True)  # someone else's setting in this process
    with pytest.raises(DataError, match="the upload: cannot read the image"):
        image_from_bytes(buffer.getvalue()[: len(buffer.getvalue()) // 2], channels=1)


@pytest.mark.parametrize("mode", ["1", "L", "LA", "P", "RGB", "RGBA", "I;16"])
def test_whole_pngs_of_every_mode_and_jpegs_are_read(mode):
    for fmt in ("PNG", "JPEG") if mode in ("L", "RGB") else ("PNG",):
        buffer = io.BytesIO()
        Image.new(mode, (7, 5)).save(buffer, fmt)
        assert decode_image(buffer.getvalue(), name="x").size == (7, 5)


@pytest.mark.parametrize("side", [40, 100])  # above the limit (Pillow warns), above twice the limit (it raises)
def test_a_decompression_bomb_is_one_line_and_no_warning(tmp_path, monkeypatch, side):
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)
    Image.new("L", (side, side)).save(tmp_path / "bomb.png")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a warning printed on stderr would fail here
        with pytest.raises(DataError, match=f"bomb.png: the image is too large to decode safely .*{side * side} "
                                            "pixels.*; shrink it first"):
            read_image(tmp_path / "bomb.png", channels=1, size=(8, 8))


def _idx(dims, values: bytes = b"", ndim: int | None = None) -> bytes:
    return bytes([0, 0, 8, len(dims) if ndim is None else ndim]) + struct.pack(f">{len(dims)}I", *dims) + values


@pytest.mark.parametrize("suffix", ["", ".gz"])
@pytest.mark.parametrize("content, message", [
    (_idx((), ndim=3), r"the header announces 3 dimensions but the file ends after 0; the file is cut short"),
    (_idx((5,), ndim=3), r"the header announces 3 dimensions but the file ends after 1"),
    (_idx((2**32 - 1,) * 3, b"\x01" * 10), r"\(4294967295, 4294967295, 4294967295\),? (which )?need"),
    (_idx((), ndim=0), r"the dimensions \(\) hold no values"),
    (_idx((0, 28, 28)), r"the dimensions \(0, 28, 28\) hold no values"),
    (_idx((2, 3), b"\x01" * 5), r"dimensions \(2, 3\)(, which)? need 6"),
    (_idx((2, 3), b"\x01" * 7), r"more values than the dimensions \(2, 3\) need \(6\); its header is wrong"),
], ids=["cut after the magic", "cut in the dimensions", "product overflows", "no dimensions",
        "a zero dimension", "too few values", "too many values"])
def test_an_idx_file_is_checked_against_its_header_before_it_is_read(tmp_path, suffix, content, message):
    import gzip

    path = tmp_path / f"x-idx{suffix}"
    path.write_bytes(gzip.compress(content) if suffix else content)
    with pytest.raises(DataError, match=f"{path.name}: .*{message}"):
        read_idx(path)
    (tmp_path / "ok").write_bytes(_idx((2, 3), bytes(range(6))))
    assert read_idx(tmp_path / "ok").tolist() == [[0, 1, 2], [3, 4, 5]]


def test_a_corrupt_gzip_idx_file_is_one_line(tmp_path):
    import gzip

    whole = gzip.compress(_idx((4,), b"\x01\x02\x03\x04") * 50)
    for name, content in (("garbage.gz", whole[:10] + b"\xff" * 40), ("cut.gz", whole[: len(whole) // 2]),
                          ("not-gzip.gz", b"plain bytes")):
        (tmp_path / name).write_bytes(content)
        with pytest.raises(DataError, match=f"{name}: cannot read it"):
            read_idx(tmp_path / name)


def _fashion_mnist(root, images, labels):
    import gzip

    (root / "t10k-images-idx3-ubyte.gz").write_bytes(gzip.compress(_idx(images.shape, images.tobytes())))
    (root / "t10k-labels-idx1-ubyte.gz").write_bytes(gzip.compress(_idx(labels.shape, labels.tobytes())))


def test_fashion_mnist_images_and_labels_must_agree(tmp_path):
    images = np.zeros((20, 28, 28), np.uint8)
    _fashion_mnist(tmp_path, images, np.arange(5, dtype=np.uint8))
    with pytest.raises(DataError, match=r"holds 20 images but .*t10k-labels-idx1-ubyte.gz 5 labels; they must agree"):
        load_fashion_mnist("test", tmp_path)
    _fashion_mnist(tmp_path, images, np.array([0, 9, 10] + [1] * 17, np.uint8))
    with pytest.raises(DataError, match="label 10 is not a class; Fashion-MNIST's labels are 0 to 9"):
        load_fashion_mnist("test", tmp_path)
    _fashion_mnist(tmp_path, images[0], np.arange(5, dtype=np.uint8))
    with pytest.raises(DataError, match=r"holds \(28, 28\) .*expected \(images, height, width\) and \(labels,\)"):
        load_fashion_mnist("test", tmp_path)
    _fashion_mnist(tmp_path, images, np.arange(20, dtype=np.uint8) % 10)
    assert load_fashion_mnist("test", tmp_path).pixels.shape == (20, 1, 28, 28)


def test_an_image_name_that_is_a_device_or_a_fifo_is_refused_before_it_is_opened(tmp_path):
    """``x.png -> /dev/zero`` would be read without end and a FIFO with no writer would block the open: both are
    refused from os.stat, in one line naming the file, as is a folder of class images that holds one."""
    import os

    (tmp_path / "zero.png").symlink_to("/dev/zero")
    os.mkfifo(tmp_path / "fifo.png")
    for name, kind in (("zero.png", "a device"), ("fifo.png", "a FIFO")):
        with pytest.raises(DataError, match=rf"{name}: it is {kind}.*not a regular file"):
            read_image(tmp_path / name, channels=1)
    for label in ("a", "b"):
        (tmp_path / "classes" / label).mkdir(parents=True)
        Image.new("L", (4, 4)).save(tmp_path / "classes" / label / "0.png")
    os.mkfifo(tmp_path / "classes" / "b" / "1.png")
    with pytest.raises(DataError, match=r"1.png: it is a FIFO"):
        load_image_folder(tmp_path / "classes", channels=1, size=(4, 4))


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_a_file_cut_inside_its_header_is_said_to_be_cut_not_to_be_of_another_kind(fmt):
    """A PNG cut after its signature is "not an image" to Pillow: the bytes begin as the format's do, so the
    line says the file is cut short or damaged, with its size, not that it is not a PNG or JPEG file."""
    buffer = io.BytesIO()
    Image.new("RGB", (16, 16), (1, 2, 3)).save(buffer, fmt)
    data = buffer.getvalue()
    for end in (8, 12, 30, 40) if fmt == "PNG" else (4, 20):
        with pytest.raises(DataError, match=rf"x: cannot read the image: a {fmt} file cut short or damaged "
                                            rf"\({end} bytes"):
            decode_image(data[:end], name="x")
    with pytest.raises(DataError, match="it is not a PNG or JPEG file"):
        decode_image(b"GIF89a" + data, name="x")
