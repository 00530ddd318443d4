"""``qkv train`` (translation), ``qkv translate`` and ``qkv evaluate``."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from functools import partial
from pathlib import Path

from ..files import write_atomically
from .common import (
    VOCAB_MULTIPLE,
    add_device_arguments,
    add_input_arguments,
    add_size_arguments,
    add_training_arguments,
    command,
    place,
    read_inputs,
    report,
    runtime,
    train_options,
    training_run,
)
from .numbers import COUNT, NON_NEGATIVE, PROBABILITY, integer, real

log = logging.getLogger("qkv")


# --- qkv train (translation) ----------------------------------------------------------------------------------

TRAIN_DEFAULTS = dict(
    arch="transformer", teacher_forcing=1.0, embedding_dim=None, hidden_size=None, bidirectional=None,
    attention_dim=None, tokenizer="bpe", target_tokenizer=None, vocab_size=8000, separate_vocab=False,
    preset="small", d_model=None, n_heads=None, n_layers=None, n_encoder_layers=None, n_decoder_layers=None,
    d_ff=None, dropout=None, attention_dropout=None, activation_dropout=None, post_norm=False, positional=None,
    max_len=128, batch_tokens=4000, accum=1, lr=7e-4, warmup=1000, schedule="inverse_sqrt", min_lr_ratio=0.0,
    eval_at_minutes=None, label_smoothing=0.1,
    clip=1.0, weight_decay=0.01, max_steps=None, epochs=None, max_minutes=None, eval_every=500, bleu_samples=500,
    seed=0, valid_size=1000, test_size=None, target_lang=None, src=None, tgt=None, tsv=None,
    valid_src=None, valid_tgt=None, valid_tsv=None,
)
MODEL_FIELDS = ("d_model", "n_heads", "n_layers", "n_encoder_layers", "n_decoder_layers", "d_ff", "dropout",
                "attention_dropout", "activation_dropout", "positional")
PATHS = ("src", "tgt", "tsv", "valid_src", "valid_tgt", "valid_tsv")  # stored absolute, for --resume
# --arch -> the LSTM's attention; one model family (checkpoint architecture "lstm"), three ways to read the source
LSTM_ATTENTION = {"lstm": "none", "lstm-dot": "dot", "lstm-additive": "additive"}
RNN_FIELDS = ("embedding_dim", "hidden_size", "n_layers", "bidirectional", "attention_dim", "dropout")
TRANSFORMER_ONLY = ("d_model", "n_heads", "n_encoder_layers", "n_decoder_layers", "d_ff", "attention_dropout",
                    "activation_dropout", "positional", "post_norm")
LSTM_ONLY = ("embedding_dim", "hidden_size", "bidirectional", "attention_dim")
# What suits the LSTMs better than the Transformer's defaults: a higher learning rate and a short warmup (Adam
# with clipping needs little warmup for an LSTM; a long one costs a large part of an hour's run on a CPU).
LSTM_TRAIN_DEFAULTS = dict(lr=1e-3, warmup=200)


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    """Every option defaults to None here, so that --resume can tell what was typed from what was stored."""
    data = p.add_argument_group("data (two aligned files, plain or .gz, or one TSV of source<TAB>target)")
    data.add_argument("--src", help="training source file")
    data.add_argument("--tgt", help="training target file")
    data.add_argument("--tsv", help="training pairs as source<TAB>target lines")
    data.add_argument("--valid-src")
    data.add_argument("--valid-tgt")
    data.add_argument("--valid-tsv")
    data.add_argument("--valid-size", type=COUNT, help="without validation files, hold out this many pairs (1000)")
    data.add_argument("--test-size", type=COUNT, help="also hold out a test set, written to OUT/test.{src,ref}.txt")
    data.add_argument("--max-len", type=COUNT, help="skip pairs longer than this many tokens (128)")
    data.add_argument("--target-lang", help="target language code; 'zh' picks sacreBLEU's Chinese tokenizer "
                                            "(detected automatically)")
    tok = p.add_argument_group("tokenizer")
    tok.add_argument("--tokenizer", choices=["bpe", "char"])
    tok.add_argument("--target-tokenizer", choices=["bpe", "char"], help="a different kind for the target side")
    tok.add_argument("--vocab-size", type=COUNT, help="BPE vocabulary size (8000)")
    tok.add_argument("--separate-vocab", action="store_true", default=None, help="one vocabulary per side")
    model = p.add_argument_group("model (an architecture and a preset, then any field overridden)")
    model.add_argument("--arch", choices=["transformer", *LSTM_ATTENTION],
                       help="transformer (default); lstm: LSTM encoder-decoder reading one context vector; "
                            "lstm-dot / lstm-additive: with dot-product / additive (Bahdanau) attention")
    model.add_argument("--preset", choices=["small", "base", "big"],
                       help="small (default): Transformer 3+3 layers d=256; LSTM 1 layer, embeddings 256, state 512. "
                            "base: Transformer 6+6 d=512; LSTM 2 layers. big: Transformer d=1024; LSTM 4x1000")
    add_size_arguments(model)
    model.add_argument("--n-encoder-layers", type=COUNT)
    model.add_argument("--n-decoder-layers", type=COUNT)
    model.add_argument("--attention-dropout", type=PROBABILITY)
    model.add_argument("--activation-dropout", type=PROBABILITY)
    model.add_argument("--post-norm", action="store_true", default=None, help="Post-Norm as in the paper")
    model.add_argument("--positional", choices=["sinusoidal", "learned", "rope"])
    model.add_argument("--embedding-dim", type=COUNT, help="LSTM: token embedding width")
    model.add_argument("--hidden-size", type=COUNT, help="LSTM: decoder state width (a bidirectional encoder runs "
                                                       "half of it each way)")
    model.add_argument("--bidirectional", action=argparse.BooleanOptionalAction, default=None,
                       help="LSTM: read the source both ways (default) or left to right only")
    model.add_argument("--attention-dim", type=COUNT, help="lstm-additive: width of the attention's tanh layer")
    train = add_training_arguments(p, TRAIN_DEFAULTS, batch=("--batch-tokens", "tokens per batch, padding included"),
                                   lr_help="peak learning rate (7e-4; LSTM 1e-3)",
                                   warmup_help="warmup steps (1000; LSTM 200)")
    train.add_argument("--label-smoothing", type=PROBABILITY, help="(0.1)")
    train.add_argument("--teacher-forcing", type=real(0, 1), metavar="RATIO",
                       help="LSTM: probability of feeding the true previous token while training (1.0); otherwise "
                            "the model's own prediction is fed (scheduled sampling)")
    train.add_argument("--bleu-samples", type=integer(0),
                       help="validation sentences translated for BLEU (500; 0 = none: the best checkpoint is then the "
                            "one with the lowest validation loss)")


def _read_pairs(settings: dict) -> tuple[list, list, list | None]:
    from ..data import DataError, read_parallel
    from ..tasks.translation import split_off

    if settings["tsv"]:
        if settings["src"] or settings["tgt"]:
            raise DataError("give either --tsv or --src/--tgt, not both")
        train = read_parallel(settings["tsv"])
    elif settings["src"] and settings["tgt"]:
        train = read_parallel(settings["src"], settings["tgt"])
    else:
        raise DataError("no training data: give --src FILE --tgt FILE, or --tsv FILE")
    test = None
    if settings["test_size"]:
        train, test = split_off(train, settings["test_size"], settings["seed"] + 1)
    if settings["valid_tsv"]:
        valid = read_parallel(settings["valid_tsv"])
    elif settings["valid_src"] and settings["valid_tgt"]:
        valid = read_parallel(settings["valid_src"], settings["valid_tgt"])
    elif settings["valid_src"] or settings["valid_tgt"]:
        raise DataError("give both --valid-src and --valid-tgt (or --valid-tsv)")
    else:
        train, valid = split_off(train, settings["valid_size"], settings["seed"])
    return train, valid, test


def _check_arch_options(s: dict, args: argparse.Namespace) -> None:
    """Options that do not apply are a mistake, not something to ignore silently."""
    lstm = s["arch"] != "transformer"
    wrong = [k for k in (TRANSFORMER_ONLY if lstm else LSTM_ONLY) if s[k] != TRAIN_DEFAULTS[k]]
    if wrong:
        options = ", ".join("--" + k.replace("_", "-") for k in wrong)
        raise ValueError(f"{options}: {'Transformer' if lstm else 'LSTM'} option(s), not for --arch {s['arch']}")
    if s["attention_dim"] is not None and s["arch"] != "lstm-additive":
        raise ValueError(f"--attention-dim sizes additive attention (--arch lstm-additive), not --arch {s['arch']}")
    if not lstm and s["teacher_forcing"] != 1.0:
        raise ValueError(f"--teacher-forcing {s['teacher_forcing']} needs an LSTM (--arch lstm, lstm-dot or "
                         "lstm-additive); the Transformer is trained with full teacher forcing")
    if args.vocab_size is not None and s["tokenizer"] == "char" and s["target_tokenizer"] in (None, "char"):
        raise ValueError("--vocab-size sizes a BPE vocabulary; --tokenizer char takes every character of the text")


def _model_config(s: dict, tokenizers: dict):
    """A new model's config: the preset of its architecture, then the fields given on the command line."""
    from ..config import RNNConfig, TransformerConfig

    shared = tokenizers["src"] is tokenizers["tgt"]
    vocab = dict(src_vocab_size=tokenizers["src"].vocab_size, tgt_vocab_size=tokenizers["tgt"].vocab_size,
                 share_embeddings=shared)
    if s["arch"] in LSTM_ATTENTION:
        overrides = {k: s[k] for k in RNN_FIELDS if s[k] is not None}
        return RNNConfig.from_preset(s["preset"], attention=LSTM_ATTENTION[s["arch"]], **vocab, **overrides)
    overrides = {k: s[k] for k in MODEL_FIELDS if s[k] is not None}
    return TransformerConfig.from_preset(
        s["preset"], **vocab, max_seq_len=max(s["max_len"] + 2, 64), vocab_multiple=VOCAB_MULTIPLE,
        **({"norm_first": False} if s["post_norm"] else {"norm_first": True}), **overrides,
    )


def train(args: argparse.Namespace) -> int:
    # A resumed run's stored options cover every default, so only a new run's --arch picks the defaults.
    defaults = {**TRAIN_DEFAULTS, **LSTM_TRAIN_DEFAULTS} if args.arch in LSTM_ATTENTION else TRAIN_DEFAULTS
    with training_run(args, defaults, command="train", paths=PATHS) as s:
        return _train(args, s)


def _train(args: argparse.Namespace, s: dict) -> int:
    from ..checkpoint import ARCHITECTURES, load_checkpoint
    from ..distributed import current
    from ..footprint import build_model
    from ..tasks.translation import ParallelData, TranslationTask, build_tokenizers, looks_chinese
    from ..training import Trainer

    out = Path(args.out)
    _check_arch_options(s, args)
    opts = train_options(s, args)
    train_pairs, valid_pairs, test_pairs = _read_pairs(s)
    if args.resume:
        previous = load_checkpoint(out / "last")
        tokenizers, cfg, model_cls = previous.tokenizers, previous.model.config, type(previous.model)
    else:
        tokenizers = build_tokenizers(train_pairs, kind=s["tokenizer"], vocab_size=s["vocab_size"],
                                      shared=not s["separate_vocab"] and not s["target_tokenizer"],
                                      target_kind=s["target_tokenizer"])
        cfg = _model_config(s, tokenizers)
        model_cls = ARCHITECTURES["lstm" if s["arch"] in LSTM_ATTENTION else "transformer"][0]
    train = ParallelData.encode(train_pairs, tokenizers, max_len=s["max_len"], name="train")
    valid = ParallelData.encode(valid_pairs, tokenizers, max_len=s["max_len"], name="valid")
    if test_pairs is not None and current().main:
        for column, name in enumerate(("test.src.txt", "test.ref.txt")):
            text = "".join(p[column].strip() + "\n" for p in test_pairs)
            write_atomically(out / name, partial(Path.write_text, data=text, encoding="utf-8"))
    target_lang = s["target_lang"] or ("zh" if looks_chinese(valid.tgt_text) else None)
    model = build_model(model_cls, cfg, training=True)
    log.info("model: %.2fM parameters (%.2fM without embeddings); %d training pairs, %d validation pairs",
             model.num_parameters() / 1e6, model.num_parameters(exclude_embeddings=True) / 1e6, len(train), len(valid))
    stored_args = {k: s[k] for k in TRAIN_DEFAULTS}
    task = TranslationTask(model, tokenizers, train, valid, batch_tokens=s["batch_tokens"], seed=s["seed"],
                           label_smoothing=s["label_smoothing"], bleu_samples=s["bleu_samples"],
                           target_language=target_lang, teacher_forcing=s["teacher_forcing"],
                           meta={"command": "train", "args": stored_args, "target_lang": target_lang,
                                 "title": out.name, "data_files": s["data_files"]})
    return report(Trainer(task, opts, runtime=s["runtime"]).run(), out)


# --- qkv translate / evaluate ---------------------------------------------------------------------------------

def _load_translator(args: argparse.Namespace, device):
    from ..checkpoint import load_checkpoint

    ckpt = load_checkpoint(args.model)
    if ckpt.arch not in ("transformer", "lstm") or not {"src", "tgt"} <= set(ckpt.tokenizers):
        raise ValueError(f"{ckpt.path} is a {ckpt.arch} checkpoint, not a translation model")
    place(ckpt.model, device, args)
    return ckpt


def _check_attention_map(args: argparse.Namespace, model) -> None:
    """--attention and --layer against the model, before anything is translated."""
    lstm_attention = getattr(model.config, "attention", None)  # None: a Transformer
    if lstm_attention == "none":
        raise ValueError("--attention: this LSTM has no attention to draw (it reads one context vector); "
                         "train with --arch lstm-dot or lstm-additive for attention maps")
    layers = 1 if lstm_attention else model.config.n_decoder_layers
    if not -layers <= args.layer < layers:
        raise ValueError(f"--layer {args.layer} does not exist: the decoder has {layers} attention layer(s), "
                         f"0 to {layers - 1} (or -1 for the last)")


def translate(args: argparse.Namespace) -> None:
    from ..tasks.translation import cross_attention, translate
    from ..viz import attention_heatmap

    device, _, amp = runtime(args)
    sources = read_inputs(args.text, args.input, "translate", keep_blank=True)
    if args.attention and not sources[0].strip():
        raise ValueError("--attention draws the first sentence, and it is empty; put a sentence first")
    ckpt = _load_translator(args, device)
    if args.attention:
        _check_attention_map(args, ckpt.model)
    with amp:
        hyps = translate(ckpt.model, ckpt.tokenizers, [s.strip() for s in sources], beam_size=args.beam,
                         alpha=args.alpha, use_cache=not args.no_cache)
    if args.output:
        Path(args.output).write_text("".join(h + "\n" for h in hyps), encoding="utf-8")
    else:
        for h in hyps:
            print(h)
    if args.attention:
        first = sources[0].strip()
        with amp:
            weights, tgt_labels, src_labels = cross_attention(ckpt.model, ckpt.tokenizers, first,
                                                              ckpt.tokenizers["tgt"].encode(hyps[0]), layer=args.layer)
        lstm_attention = getattr(ckpt.model.config, "attention", None)
        if lstm_attention:
            title = f"LSTM {lstm_attention} attention"
        else:
            title = f"cross-attention, {'last layer' if args.layer == -1 else f'layer {args.layer}'}, mean over heads"
        path = attention_heatmap(weights, tgt_labels, src_labels, args.attention, title=title)
        print(f"attention map of the first sentence: {path}", file=sys.stderr)


def evaluate(args: argparse.Namespace) -> None:
    from ..data import read_lines
    from ..metrics import bleu, check_tokenized_bleu, chrf, tokenized_bleu
    from ..tasks.translation import looks_chinese, translate

    device, _, amp = runtime(args)
    if args.tokenized_bleu:
        check_tokenized_bleu()  # spaCy is an extra: say so before translating, not after
    if not args.model and not args.hyp:
        raise ValueError("give --hyp FILE (translations to score) or --model DIR --src FILE")
    if args.model and not args.src:
        raise ValueError("with --model, give the source sentences with --src FILE")
    refs = read_lines(args.ref)
    if args.model:
        sources = read_lines(args.src)
        if len(sources) != len(refs):
            raise ValueError(f"{args.src} has {len(sources)} lines but {args.ref} has {len(refs)}")
        ckpt = _load_translator(args, device)
        start = time.monotonic()
        with amp:
            hyps = translate(ckpt.model, ckpt.tokenizers, [s.strip() for s in sources], beam_size=args.beam,
                             alpha=args.alpha)
        print(f"translated {len(hyps)} sentences in {time.monotonic() - start:.1f}s (beam {args.beam})")
        if args.output:
            Path(args.output).write_text("".join(h + "\n" for h in hyps), encoding="utf-8")
    else:
        hyps = read_lines(args.hyp)
    language = args.lang or ("zh" if looks_chinese(refs) else None)
    print(bleu(hyps, refs, language=language))
    print(chrf(hyps, refs))
    if args.tokenized_bleu:
        print(tokenized_bleu(hyps, refs, language=args.lang or "en"))


# --- the parsers ----------------------------------------------------------------------------------------------

def _add_decoding_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--beam", type=COUNT, default=1, help="beam size (1 = greedy, the default)")
    p.add_argument("--alpha", type=NON_NEGATIVE, default=0.6, help="beam length penalty α (default 0.6)")


def add_commands(sub) -> None:
    train_parser = command(sub, "train", "train a translation model (qkv train lm, mlm, classify, vit, swin, "
                                         "clip: the other models)")
    add_train_arguments(train_parser)
    train_parser.set_defaults(run=train)

    tr = command(sub, "translate", "translate sentences with a trained model")
    add_input_arguments(tr, blank=" (a blank line translates to a blank line)")
    tr.add_argument("--model", required=True, help="a checkpoint directory, or a run directory (uses best/)")
    tr.add_argument("--output", help="write translations here instead of stdout")
    _add_decoding_arguments(tr)
    tr.add_argument("--attention", metavar="FILE.png", help="write the first sentence's cross-attention map")
    tr.add_argument("--layer", type=integer(), default=-1, help="decoder layer of the attention map (default: last)")
    tr.add_argument("--no-cache", action="store_true", help="decode without the KV cache (slower; same output)")
    add_device_arguments(tr, quantize=True)
    tr.set_defaults(run=translate)

    ev = command(sub, "evaluate", "score translations with sacreBLEU and chrF")
    ev.add_argument("--ref", required=True, help="reference translations, one per line")
    ev.add_argument("--hyp", help="translations to score")
    ev.add_argument("--model", help="translate --src with this model, then score")
    ev.add_argument("--src", help="source sentences (with --model)")
    ev.add_argument("--output", help="with --model: also write the translations here")
    _add_decoding_arguments(ev)
    ev.add_argument("--lang", help="target language code (zh: Chinese tokenization; detected automatically)")
    ev.add_argument("--tokenized-bleu", action="store_true",
                    help="also BLEU on lower-cased spaCy tokens, as older Multi30k results report "
                         "(needs spaCy: pip install 'qkv[bleu]')")
    add_device_arguments(ev)
    ev.set_defaults(run=evaluate)
