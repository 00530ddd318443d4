"""``qkv export``: a trained model out of qkv, as a Hugging Face folder or a GGUF file (see
:mod:`qkv.interop.export` and :mod:`qkv.interop.gguf_export`)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .common import command


def export_cmd(args: argparse.Namespace) -> None:
    from ..files import check_out, read_text
    from ..interop.gguf_export import TYPES
    from ..lora import merge_lora
    from ..trained import load_trained

    if bool(args.model) == bool(args.pretrained):
        raise ValueError("give one model: --model DIR (a qkv run or checkpoint) or --pretrained "
                         "smollm2|FILE.gguf|HF_DIR")
    if args.type is not None and args.format != "gguf":
        raise ValueError("--type sets how a GGUF file stores its matrices; give it with --format gguf")
    if args.type not in (None, *TYPES):
        raise ValueError(f"--type must be one of {', '.join(TYPES)}, got {args.type!r}")
    if args.pretrained and (args.merge or args.format not in ("hf", "gguf")):
        raise ValueError("--pretrained exports a whole model, as --format hf or gguf; --format peft, gguf-lora and "
                         "--merge are for a LoRA run (--model)")
    template = None
    if args.chat_template:
        from ..chat import MAX_TEMPLATE_BYTES, check_template

        template = read_text(args.chat_template, max_bytes=MAX_TEMPLATE_BYTES)
        check_template(template)  # shipped, it would fail only at the user's first qkv chat
    out = Path(args.out)
    check_out(out, "folder" if args.format in ("hf", "peft") else "file")  # before the weights are read
    if args.model:
        _adapters(args)  # the format and --merge fit what the run holds
    if args.format == "peft":
        _export_peft(args.model, out)
        print(out)
        return
    if args.pretrained:
        ckpt = _pretrained(args.pretrained)
    else:  # a LoRA run merged: its base in float32 (a quantized base read as float), its adapters merged in
        ckpt = load_trained(args.model, weights="none" if args.merge else None)
        ckpt.model = merge_lora(ckpt.model).eval() if args.merge else ckpt.model
    if not args.merge and args.format == "gguf-lora":
        from ..interop.gguf_lora import export_gguf_lora

        export_gguf_lora(ckpt.model, out)
        print(out)
        return
    # --chat-template replaces the model's own (a run's, a pretrained model's), which is kept otherwise
    template = template or ckpt.meta.get("chat_template")
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


def _pretrained(source: str):
    """A pretrained language model (a name, a GGUF file, a Hugging Face folder) in float32, as a checkpoint
    whose record holds its chat template."""
    from ..checkpoint import Checkpoint
    from ..interop import load_pretrained

    pre = load_pretrained(source, weights="none")
    return Checkpoint(pre.model, "gpt", {"chat_template": pre.chat_template}, {"text": pre.tokenizer}, Path(source))


def _export_peft(run: str, out: Path) -> None:
    """A LoRA run's adapter folder as peft reads it: its files checked as loading checks them (their checksum,
    finite weights of the dtypes and shapes the config says; no link), the base named as peft resolves it."""
    from .. import checkpoint
    from ..adapters import CONFIG, WEIGHTS, peft_base_name, read_peft_adapter
    from ..files import write_atomically
    from ..trained import adapter_folder

    folder = adapter_folder(run)
    recorded = checkpoint.read_config(folder.parent / checkpoint.CONFIG)[4]
    checkpoint.check_digest(folder / WEIGHTS, recorded.get(checkpoint.CHECKSUM))
    read_peft_adapter(folder)
    config = json.loads((folder / CONFIG).read_text(encoding="utf-8"))  # read, checked, by read_peft_adapter
    config["base_model_name_or_path"] = peft_base_name(str(config.get("base_model_name_or_path")))
    weights = (folder / WEIGHTS).read_bytes()

    def write(tmp: Path) -> None:
        (tmp / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        (tmp / WEIGHTS).write_bytes(weights)

    write_atomically(out, write, folder=True)


def _adapters(args: argparse.Namespace) -> Path | None:
    """The adapter folder of a LoRA run (None for a whole model), checked against the format and --merge asked."""
    from ..checkpoint import ADAPTER, resolve

    folder = resolve(args.model) / ADAPTER
    adapters = folder if folder.exists() or folder.is_symlink() else None
    if args.format in ("peft", "gguf-lora") and adapters is None:
        raise ValueError(f"{args.model} holds a whole model, not LoRA adapters (qkv finetune --method lora|qlora "
                         f"makes them); export it with --format hf or gguf")
    if args.merge and (adapters is None or args.format not in ("hf", "gguf")):
        raise ValueError("--merge writes a LoRA run's base model with its adapters merged in, as --format hf or gguf")
    if adapters is not None and args.format in ("hf", "gguf") and not args.merge:
        raise ValueError(f"{args.model} holds LoRA adapters: --format peft or gguf-lora writes them, --merge writes "
                         "the base model with them merged in")
    return adapters


def add_commands(sub) -> None:
    p = command(sub, "export", "write a trained language model as a Hugging Face folder (transformers loads it) or "
                               "a GGUF file (llama.cpp runs it); a BERT or its classifier, or a Post-Norm translation "
                               "model as a Marian folder")
    p.add_argument("--model", help="a qkv checkpoint or run directory (uses best/)")
    p.add_argument("--pretrained", metavar="SRC", help="a pretrained language model instead: smollm2, a GGUF file or a "
                                                       "Hugging Face folder (its chat template goes with it)")
    p.add_argument("--format", choices=("hf", "gguf", "peft", "gguf-lora"), default="hf",
                   help="hf: a folder; gguf: one file (default hf); a LoRA run's adapters alone: peft (a folder "
                        "peft.PeftModel reads) or gguf-lora (a file llama.cpp reads with --lora)")
    p.add_argument("--merge", action="store_true", help="a LoRA run as the whole model: its base in float32 with the "
                                                        "adapters merged in (then --format hf or gguf)")
    p.add_argument("--out", required=True, help="the folder or file to write; it must not exist (or be an empty "
                                                "folder)")
    p.add_argument("--type", help="gguf: how the matrices are stored: f32, f16 (the default), q8_0 or q4_0 "
                                  "(llama.cpp's 8- and 4-bit blocks)")
    p.add_argument("--chat-template", metavar="FILE", help="a Jinja chat template to ship with the model, in place "
                                                          "of its own (a fine-tuned or pretrained model's is kept)")
    p.set_defaults(run=export_cmd)
