"""``qkv export``: a trained model out of qkv, as a Hugging Face folder or a GGUF file (see
:mod:`qkv.interop.export` and :mod:`qkv.interop.gguf_export`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from .common import command


def export_cmd(args: argparse.Namespace) -> None:
    from ..checkpoint import load_checkpoint
    from ..files import read_text
    from ..interop.export import check_out
    from ..interop.gguf_export import TYPES

    if args.type is not None and args.format != "gguf":
        raise ValueError("--type sets how a GGUF file stores its matrices; give it with --format gguf")
    if args.type not in (None, *TYPES):
        raise ValueError(f"--type must be one of {', '.join(TYPES)}, got {args.type!r}")
    template = read_text(args.chat_template) if args.chat_template else None
    out = Path(args.out)
    check_out(out, "folder" if args.format == "hf" else "file")  # before the weights are read
    ckpt = load_checkpoint(args.model)
    translation = {"src", "tgt"} <= set(ckpt.tokenizers)
    if "text" not in ckpt.tokenizers and not (translation and args.format == "hf"):
        raise ValueError(f"{ckpt.path} is a {ckpt.arch} checkpoint; qkv exports language models (both formats), "
                         "BERTs and Marian-shaped translation models (--format hf)")
    if args.format == "hf":
        from ..interop.export import export_hf

        tokenizer = ckpt.tokenizers if translation else ckpt.tokenizers["text"]
        export_hf(ckpt.model, tokenizer, out, chat_template=template, labels=ckpt.meta.get("labels"))
    else:
        from ..interop.gguf_export import export_gguf

        export_gguf(ckpt.model, ckpt.tokenizers["text"], out, storage=args.type or "f16", chat_template=template)
    print(out)


def add_commands(sub) -> None:
    p = command(sub, "export", "write a trained language model as a Hugging Face folder (transformers loads it) or "
                               "a GGUF file (llama.cpp runs it); a BERT or its classifier, or a Post-Norm translation "
                               "model as a Marian folder")
    p.add_argument("--model", required=True, help="a qkv checkpoint or run directory (uses best/)")
    p.add_argument("--format", choices=("hf", "gguf"), default="hf", help="hf: a folder; gguf: one file (default hf)")
    p.add_argument("--out", required=True, help="the folder or file to write; it must not exist (or be an empty "
                                                "folder)")
    p.add_argument("--type", help="gguf: how the matrices are stored: f32, f16 (the default), q8_0 or q4_0 "
                                  "(llama.cpp's 8- and 4-bit blocks)")
    p.add_argument("--chat-template", metavar="FILE", help="a Jinja chat template to ship with the model")
    p.set_defaults(run=export_cmd)
