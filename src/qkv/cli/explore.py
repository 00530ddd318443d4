"""``qkv explore``: every layer and head of a model's attention in the browser (see :mod:`qkv.explore`).

    qkv explore --pretrained minilm                       # a server on http://127.0.0.1:8000/
    qkv explore --model runs/de-en --port 0               # any free port
    qkv explore --model runs/lm --export lm.html --text "ROMEO:"   # one self-contained file, no server
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile
from functools import partial
from pathlib import Path

from .common import command, runtime
from .numbers import integer

log = logging.getLogger("qkv")

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")
IMAGE_ARCHS = ("vit", "vit-classifier", "swin", "swin-classifier", "clip")


def _explorer(args: argparse.Namespace, device):
    """``(run(text) -> result, info)`` for --model or --pretrained, the model loaded once, on ``device``."""
    from ..explore import encoder_result, lm_result, translation_result
    from ..explore.results import MAX_TOKENS
    from ..interop.sentence import MINILM_NAMES, load_sentence_encoder

    if bool(args.model) == bool(args.pretrained):
        raise ValueError("give one model: --model DIR (a qkv run) or --pretrained smollm2|minilm|FILE.gguf|HF_DIR")
    new_tokens = min(args.new_tokens, MAX_TOKENS - 8)
    if args.pretrained and args.pretrained.lower() in MINILM_NAMES:
        enc = load_sentence_encoder(args.pretrained)
        return (partial(encoder_result, enc.model.to(device), enc.tokenizer, name=enc.name),
                _info(enc.name, "encoder", "The cat sat on the mat because it was tired."))
    if args.pretrained:
        from ..interop import load_pretrained

        pre = load_pretrained(args.pretrained)
        run = partial(lm_result, pre.model.to(device), pre.tokenizer, name=pre.name, new_tokens=new_tokens,
                      stop_ids=frozenset(pre.tokenizer.stop_ids))
        return run, _info(pre.name, "lm", "The capital of France is")
    from ..checkpoint import load_checkpoint

    ckpt = load_checkpoint(args.model)
    name = ckpt.path.parent.name if ckpt.path.name in ("best", "last") else ckpt.path.name
    if ckpt.arch == "gpt":
        run = partial(lm_result, ckpt.model.to(device), ckpt.tokenizers["text"], name=name, new_tokens=new_tokens)
        return run, _info(name, "lm", "ROMEO:")
    if ckpt.arch == "transformer":
        run = partial(translation_result, ckpt.model.to(device), ckpt.tokenizers, name=name)
        return run, _info(name, "translation", ckpt.meta.get("example", "Ein Mann fährt Fahrrad."), "Source sentence")
    if ckpt.arch.startswith("bert"):
        enc = load_sentence_encoder(args.model)
        return (partial(encoder_result, enc.model.to(device), enc.tokenizer, name=name),
                _info(name, "encoder", "The cat sat on the mat."))
    if ckpt.arch in IMAGE_ARCHS:
        raise ValueError(f"{ckpt.path} is a {ckpt.arch}: the explorer shows text models so far (for an image's "
                         "attention: qkv classify-image --attention FILE.png)")
    raise ValueError(f"{ckpt.path} is a {ckpt.arch}: the explorer shows Transformer attention, which an LSTM has "
                     "not (for its attention: qkv translate --attention FILE.png)")


def _info(model: str, kind: str, example: str, input_label: str = "Text") -> dict:
    return {"model": model, "kind": kind, "example": example, "input_label": input_label}


def explore_cmd(args: argparse.Namespace) -> None:
    if args.export and not args.text:
        raise ValueError("--export needs --text: the input whose attention the file shows")
    if args.text and not args.export:
        raise ValueError("--text goes with --export FILE.html; without it, type the text in the page")
    if args.host not in LOCAL_HOSTS:
        log.warning("listening on %s: anyone who can reach this machine can run the model", args.host)
    device, _, amp = runtime(args)
    run, info = _explorer(args, device)
    if args.export:
        _export(Path(args.export), run, info, args.text, amp)
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


def _export(path: Path, run, info: dict, text: str, amp) -> None:
    """The page with the result of ``text`` in it, written atomically to ``path``."""
    from ..explore import page

    if path.suffix.lower() not in (".html", ".htm"):
        raise ValueError(f"--export writes an HTML page: name it FILE.html, not {path.name}")
    if not path.parent.is_dir():
        raise ValueError(f"cannot write {path}: the folder {path.parent} does not exist")
    with amp:
        result = run(text.strip())
    html = page(result, f"qkv explore: {info['model']}: {text.strip()[:60]}")
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(html)
        os.chmod(tmp, 0o644)  # mkstemp makes it private; a page is for reading
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    print(f"wrote {path} ({len(html.encode('utf-8')) / 1e6:.1f} MB): open it in a browser, no server needed")


def add_commands(sub) -> None:
    p = command(sub, "explore", "every layer and head of a model's attention in the browser, offline")
    model = p.add_argument_group("model")
    model.add_argument("--model", metavar="DIR", help="a qkv run or checkpoint: translation, language model, BERT")
    model.add_argument("--pretrained", metavar="NAME",
                       help="smollm2, minilm, a GGUF file or a Hugging Face folder (see qkv generate)")
    model.add_argument("--new-tokens", type=integer(1), default=16,
                       help="language models: how many tokens to continue the text (16)")
    serve = p.add_argument_group("server (the default)")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1: this machine only)")
    serve.add_argument("--port", type=integer(0), default=8000, help="port (8000; 0: any free one)")
    export = p.add_argument_group("export (instead of a server)")
    export.add_argument("--export", metavar="FILE.html", help="write one self-contained page for --text and exit")
    export.add_argument("--text", help="the input the exported page shows")
    from ..device import DEVICES, PRECISIONS

    device = p.add_argument_group("device")
    device.add_argument("--device", default="auto", help=f"{DEVICES} (default auto: a CUDA GPU when there is one)")
    device.add_argument("--precision", default="auto", choices=PRECISIONS,
                        help="matrix products in fp32, bf16 or fp16 autocast (default auto: bf16 on a GPU that has "
                             "it, fp32 on a CPU)")
    p.set_defaults(run=explore_cmd)
