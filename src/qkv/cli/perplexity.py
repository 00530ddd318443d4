"""``qkv perplexity``: a language model's perplexity on a text, as llama.cpp's ``llama-perplexity`` measures it
(:mod:`qkv.perplexity`): a base model, a fine-tuned run, or a base with a LoRA adapter, on the user's own text."""

from __future__ import annotations

import argparse
import logging
import time

from .common import add_device_arguments, command, integer, runtime
from .lm import add_model_arguments, load_lm

log = logging.getLogger("qkv")


def perplexity_cmd(args: argparse.Namespace) -> None:
    from pathlib import Path

    from tqdm import tqdm

    from ..perplexity import perplexity
    from ..tokenizers import encode_prompt

    text_path = Path(args.text)
    if not text_path.is_file():
        raise ValueError(f"--text {args.text}: no such file")
    text = text_path.read_text(encoding="utf-8", errors="strict")
    device, precision, amp = runtime(args)
    model, tokenizer, _, _ = load_lm(args, device, precision)
    if args.context > model.config.max_seq_len:
        raise ValueError(f"--context {args.context} is more than the model's {model.config.max_seq_len} positions; "
                         "give a smaller --context")
    ids = encode_prompt(tokenizer, text)  # the BOS first where the tokenizer puts one, as llama.cpp tokenizes
    bos = tokenizer.bos_id if getattr(tokenizer, "add_bos", False) else None
    chunks = len(ids) // args.context
    bar = tqdm(total=chunks, unit="chunk", disable=args.no_progress, dynamic_ncols=True, desc="perplexity")
    running: list[str] = []

    def on_chunk(number: int, value: float) -> None:
        running.append(f"[{number}]{value:.4f}")
        bar.update(1)
        bar.set_postfix_str(f"ppl {value:.4f}", refresh=False)

    def logits_of(chunk):
        with amp:
            return model(chunk.to(device))

    start = time.perf_counter()
    result = perplexity(logits_of, ids, args.context, bos=bos, on_chunk=on_chunk)
    seconds = time.perf_counter() - start
    bar.close()
    print(",".join(running))
    print(f"perplexity: {result.value:.4f} +/- {result.error:.5f}  ({result.chunks} chunks of {result.n_ctx} tokens, "
          f"{result.scored:,} scored)")
    log.info("%d tokens read at %.1f tokens/s", result.chunks * result.n_ctx, result.chunks * result.n_ctx / seconds)


def add_commands(sub) -> None:
    p = command(sub, "perplexity", "a language model's perplexity on a text, measured as llama-perplexity does")
    p.add_argument("--text", required=True, help="the text, UTF-8 (at least two chunks of --context tokens)")
    p.add_argument("--context", type=integer(4), default=512,
                   help="tokens a chunk: each read alone, the predictions of its second half scored (default 512, "
                        "as llama-perplexity's -c)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_model_arguments(p)
    add_device_arguments(p, quantize=True)
    p.set_defaults(run=perplexity_cmd)
