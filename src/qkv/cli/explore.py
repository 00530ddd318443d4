"""``qkv explore``: every layer and head of a model's attention in the browser (see :mod:`qkv.explore`).

    qkv explore --pretrained minilm                       # a server on http://127.0.0.1:8000/
    qkv explore --model runs/de-en --port 0               # any free port
    qkv explore --model runs/lm --export lm.html --text "ROMEO:"   # one self-contained file, no server
    qkv explore --model runs/vit --export vit.html --image shoe.png
"""

from __future__ import annotations

import argparse
import logging
import os
from functools import partial
from pathlib import Path

from ..options import DEVICES, NEW_TOKENS, PRECISIONS
from ..tokenizers import utf8_checked
from .common import command, runtime
from .numbers import integer

log = logging.getLogger("qkv")

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")


def _explorer(args: argparse.Namespace, device):
    """``(run(text) -> result, info)`` for --model or --pretrained, the model loaded once, on ``device``."""
    from ..explore import encoder_result, lm_result, translation_result
    from ..explore.results import MAX_TOKENS
    from ..interop.sentence import MINILM_NAMES, encoder_from_checkpoint, load_sentence_encoder

    if bool(args.model) == bool(args.pretrained):
        raise ValueError("give one model: --model DIR (a qkv run) or --pretrained smollm2|minilm|FILE.gguf|HF_DIR "
                         "(a Marian folder among them)")
    new_tokens = args.new_tokens
    if new_tokens > MAX_TOKENS - 8:
        raise ValueError(f"--new-tokens {new_tokens} leaves no room for a prompt: the explorer shows at most "
                         f"{MAX_TOKENS} tokens in all; give at most {MAX_TOKENS - 8}")
    if args.pretrained and args.pretrained.lower() in MINILM_NAMES:
        enc = load_sentence_encoder(args.pretrained)
        return (partial(encoder_result, enc.model.to(device), enc.tokenizer, name=enc.name),
                _info(enc.name, "encoder", "The cat sat on the mat because it was tired."))
    if args.pretrained and (Path(args.pretrained) / "source.spm").is_file():  # a Marian (opus-mt) folder
        from ..interop.hf_marian import load_marian_folder

        marian = load_marian_folder(args.pretrained)
        run = partial(translation_result, marian.model.to(device), marian.tokenizers, name=marian.name)
        return run, _info(marian.name, "translation", "The robot picked up the red ball.", "Source sentence")
    if args.pretrained:
        from ..interop import load_pretrained

        pre = load_pretrained(args.pretrained)
        run = partial(lm_result, pre.model.to(device), pre.tokenizer, name=pre.name, new_tokens=new_tokens,
                      stop_ids=frozenset(pre.tokenizer.stop_ids))
        return run, _info(pre.name, "lm", "The capital of France is")
    from ..trained import load_trained

    ckpt = load_trained(args.model)
    name = ckpt.name
    if ckpt.arch == "gpt":
        run = partial(lm_result, ckpt.model.to(device), ckpt.tokenizers["text"], name=name, new_tokens=new_tokens)
        return run, _info(name, "lm", "ROMEO:")
    if ckpt.arch == "transformer":
        run = partial(translation_result, ckpt.model.to(device), ckpt.tokenizers, name=name)
        return run, _info(name, "translation", ckpt.meta.get("example", "Ein Mann fährt Fahrrad."), "Source sentence")
    if ckpt.arch.startswith("bert"):
        enc = encoder_from_checkpoint(ckpt)
        return (partial(encoder_result, enc.model.to(device), enc.tokenizer, name=name),
                _info(name, "encoder", "The cat sat on the mat."))
    if ckpt.arch in ("vit-classifier", "clip"):
        return _image_explorer(ckpt, name, device)
    if ckpt.arch.startswith("swin"):
        raise ValueError(f"{ckpt.path} is a Swin: it attends within windows of patches, not over the image; the "
                         "explorer shows ViT and CLIP models")
    raise ValueError(f"{ckpt.path} is a {ckpt.arch}: the explorer shows Transformer attention, which an LSTM has "
                     "not (for its attention: qkv translate --attention FILE.png)")


def _image_explorer(ckpt, name: str, device):
    """``(run(image file bytes) -> result, info)`` for a ViT classifier (with its classes) or a CLIP's image
    tower; any PNG or JPEG is converted to the model's channels and size."""
    import torch

    from ..data import DataError
    from ..explore import image_result
    from ..explore.results import InputError, png_data_url
    from ..images import image_from_bytes, normalize

    model = ckpt.model.to(device).eval()
    vit = model.vit if ckpt.arch == "vit-classifier" else model.vision
    cfg, meta = vit.config, ckpt.meta
    size, mean, std = (cfg.image_size, cfg.image_size), meta["mean"], meta["std"]
    labels = meta["labels"] if ckpt.arch == "vit-classifier" else meta["class_names"]
    probabilities = _zero_shot(model, ckpt.tokenizers["text"], meta) if ckpt.arch == "clip" else \
        (lambda pixels: model(normalize(pixels[None].to(device), mean, std))[0].softmax(-1))

    @torch.no_grad()
    def run(data: bytes):
        try:
            pixels = image_from_bytes(data, channels=cfg.channels, size=size)
        except DataError as err:
            raise InputError(str(err)) from None
        return image_result(vit, pixels, mean=mean, std=std, name=name, labels=labels, probs=probabilities(pixels))

    example = png_data_url(torch.full((cfg.channels, *size), 128, dtype=torch.uint8))
    return run, _info(name, "image", example, f"Image ({cfg.image_size}×{cfg.image_size}, any PNG or JPEG is resized)")


def _zero_shot(clip, tokenizer, meta: dict):
    """A CLIP's zero-shot probabilities of its training's class names (under its held-out templates) for one
    image, ``pixels (C, H, W) -> (n_classes,)``."""
    import torch

    from ..models.clip import MAX_LOGIT_SCALE
    from ..tasks.contrastive import embed_images, text_classifier

    with torch.no_grad():
        classifier = text_classifier(clip, tokenizer, meta["class_names"], meta["templates"])
    scale = clip.logit_scale.exp().clamp(max=MAX_LOGIT_SCALE).item()

    def probabilities(pixels):
        image = embed_images(clip, pixels[None], mean=meta["mean"], std=meta["std"]).cpu()
        return (image @ classifier.T * scale)[0].softmax(-1)

    return probabilities


def _info(model: str, kind: str, example: str, input_label: str = "Text") -> dict:
    return {"model": model, "kind": kind, "example": example, "input_label": input_label}


def explore_cmd(args: argparse.Namespace) -> None:
    if args.export and not (args.text or args.image):
        raise ValueError("--export needs --text (or --image for an image model): the input the file shows")
    if (args.text or args.image) and not args.export:
        raise ValueError("--text and --image go with --export FILE.html; without it, give the input in the page")
    if args.export:
        _check_export(Path(args.export))
    elif args.host not in LOCAL_HOSTS:
        log.warning("listening on %s: anyone who can reach this machine can run the model", args.host)
    device, _, amp = runtime(args)
    run, info = _explorer(args, device)
    if args.export:
        _export(Path(args.export), run, info, _export_input(args, info), amp)
        return
    from ..explore.server import Explorer, make_server

    def run_with(text: str):
        with amp:
            return run(text)

    server = make_server(Explorer(run_with, info), args.host, args.port)
    host, port = server.server_address[:2]
    print(f"qkv explore: {info['model']} ({info['kind']}) at http://{host}:{port}/  (Ctrl-C stops)", flush=True)
    try:
        server.serve_forever()
    finally:
        server.server_close()


def _export_input(args: argparse.Namespace, info: dict) -> tuple[str | bytes, str]:
    """(what the model runs on, what the title calls it): --text, or --image's bytes for an image model."""
    if info["kind"] == "image":
        if not args.image:
            raise ValueError(f"{info['model']} is an image model: export with --image FILE.png, not --text")
        path = Path(args.image)
        if not path.exists():  # not is_file(): a pipe (--image <(curl ...)) is read as well
            raise ValueError(f"--image {path}: no such file")
        return path.read_bytes(), path.name
    if not args.text:
        raise ValueError(f"{info['model']} reads text: export with --text \"...\", not --image")
    text = utf8_checked(args.text.strip(), "--text")
    return text, text[:60]


def _check_export(path: Path) -> None:
    """--export names a new HTML file in a folder that exists and can be written (checked before the model is
    loaded): an export never overwrites, as ``qkv export`` does not."""
    if path.is_dir():
        raise ValueError(_is_folder(path))
    if path.suffix.lower() not in (".html", ".htm"):
        raise ValueError(f"--export writes an HTML page: name it FILE.html, not {path.name}")
    if not path.parent.is_dir():
        raise ValueError(f"cannot write {path}: the folder {path.parent} does not exist")
    if not os.access(path.parent, os.W_OK | os.X_OK):
        raise ValueError(f"cannot write {path}: no permission to write in {path.parent}; choose another folder")
    if path.exists() or path.is_symlink():
        raise ValueError(f"{path} exists; give --export a new file (an export never overwrites)")


def _is_folder(path: Path) -> str:
    return f"--export {path} is a directory; name a new file in it, e.g. --export {path / 'page.html'}"


def _export(path: Path, run, info: dict, source: tuple[str | bytes, str], amp) -> None:
    """The page with the result of the input in it, written atomically to ``path``."""
    from ..explore import page
    from ..files import write_atomically

    value, what = source
    with amp:
        result = run(value)
    html = page(result, f"qkv explore: {info['model']}: {what}")
    try:
        write_atomically(path, lambda tmp: tmp.write_text(html, encoding="utf-8"))
    except OSError as err:  # the folder changed while the model ran: name the user's path, not the scratch file's
        raise ValueError(_is_folder(path) if path.is_dir() else
                         f"cannot write {path}: {err.strerror or err}; choose another --export") from None
    print(f"wrote {path} ({len(html.encode('utf-8')) / 1e6:.1f} MB): open it in a browser, no server needed")


def add_commands(sub) -> None:
    p = command(sub, "explore", "every layer and head of a model's attention in the browser, offline")
    model = p.add_argument_group("model")
    model.add_argument("--model", metavar="DIR",
                       help="a qkv run or checkpoint: translation, language model, BERT, ViT classifier, CLIP")
    model.add_argument("--pretrained", metavar="NAME",
                       help="smollm2, minilm, a GGUF file or a Hugging Face folder (see qkv generate; a Marian "
                            "folder: see qkv translate)")
    model.add_argument("--new-tokens", type=integer(1), default=NEW_TOKENS,
                       help=f"language models: how many tokens to continue the text ({NEW_TOKENS})")
    serve = p.add_argument_group("server (the default)")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1: this machine only)")
    serve.add_argument("--port", type=integer(0, 65535), default=8000, help="port (8000; 0: any free one)")
    export = p.add_argument_group("export (instead of a server)")
    export.add_argument("--export", metavar="FILE.html", help="write one self-contained page for --text and exit")
    export.add_argument("--text", help="the input the exported page shows")
    export.add_argument("--image", metavar="FILE", help="an image model's input the exported page shows (PNG, JPEG)")
    device = p.add_argument_group("device")
    device.add_argument("--device", default="auto", help=f"{DEVICES} (default auto: a CUDA GPU when there is one)")
    device.add_argument("--precision", default="auto", choices=PRECISIONS,
                        help="matrix products in fp32, bf16 or fp16 autocast (default auto: bf16 on a GPU that has "
                             "it, fp32 on a CPU)")
    p.set_defaults(run=explore_cmd)
