"""Translation: ``qkv translate``, ``qkv evaluate`` and the parser of ``qkv train translation``."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

from .common import (
    add_device_arguments,
    add_force_argument,
    add_ingredient_arguments,
    add_input_arguments,
    add_size_arguments,
    add_training_arguments,
    check_new_file,
    command,
    place,
    read_inputs,
    runtime,
    show_defaults,
)
from .numbers import COUNT, NON_NEGATIVE, PROBABILITY, integer, real

log = logging.getLogger("qkv")


# --- qkv train (the recipe: qkv.recipes.translation) -------------------------------------------------------

def add_train_arguments(p: argparse.ArgumentParser, settings) -> None:
    """Every option defaults to None here, so that --resume can tell what was typed from what was stored;
    ``--help`` shows the defaults of ``settings``, the recipe's dataclass."""
    from ..recipes.translation import LSTM_ATTENTION

    data = p.add_argument_group("data (two aligned files, plain or .gz, or one TSV of source<TAB>target)")
    data.add_argument("--src", help="training source file")
    data.add_argument("--tgt", help="training target file")
    data.add_argument("--tsv", help="training pairs as source<TAB>target lines")
    data.add_argument("--valid-src")
    data.add_argument("--valid-tgt")
    data.add_argument("--valid-tsv")
    data.add_argument("--valid-size", type=COUNT, help="without validation files, hold out this many pairs")
    data.add_argument("--test-size", type=COUNT, help="also hold out a test set, written to OUT/test.{src,ref}.txt")
    data.add_argument("--max-len", type=COUNT, help="skip pairs longer than this many tokens")
    data.add_argument("--target-lang", help="target language code; 'zh' picks sacreBLEU's Chinese tokenizer "
                                            "(detected automatically)")
    tok = p.add_argument_group("tokenizer")
    tok.add_argument("--tokenizer", choices=["bpe", "char"])
    tok.add_argument("--target-tokenizer", choices=["bpe", "char"], help="a different kind for the target side")
    tok.add_argument("--vocab-size", type=COUNT, help="BPE vocabulary size")
    tok.add_argument("--separate-vocab", action="store_true", default=None, help="one vocabulary per side")
    model = p.add_argument_group("model (an architecture and a preset, then any field overridden)")
    model.add_argument("--arch", choices=["transformer", *LSTM_ATTENTION],
                       help="transformer; lstm: LSTM encoder-decoder reading one context vector; "
                            "lstm-dot / lstm-additive: with dot-product / additive (Bahdanau) attention")
    model.add_argument("--preset", choices=["multi30k", "small", "base", "big"],
                       help="multi30k (the Transformer's default): small with FFN 1024, dropout on the residual "
                            "stream only. small: Transformer 3+3 layers d=256; LSTM 1 layer (the LSTMs' default), "
                            "embeddings 256, state 512. base: Transformer 6+6 d=512; LSTM 2 layers. big: "
                            "Transformer d=1024; LSTM 4x1000")
    add_size_arguments(model)
    model.add_argument("--n-encoder-layers", type=COUNT)
    model.add_argument("--n-decoder-layers", type=COUNT)
    model.add_argument("--attention-dropout", type=PROBABILITY)
    model.add_argument("--activation-dropout", type=PROBABILITY)
    model.add_argument("--post-norm", action="store_true", default=None, help="Post-Norm as in the paper")
    model.add_argument("--positional", choices=["sinusoidal", "learned", "rope"])
    add_ingredient_arguments(model, activations="the preset's: relu")
    model.add_argument("--embedding-dim", type=COUNT, help="LSTM: token embedding width")
    model.add_argument("--hidden-size", type=COUNT, help="LSTM: decoder state width (a bidirectional encoder runs "
                                                       "half of it each way)")
    model.add_argument("--bidirectional", action=argparse.BooleanOptionalAction, default=None,
                       help="LSTM: read the source both ways (default) or left to right only")
    model.add_argument("--attention-dim", type=COUNT, help="lstm-additive: width of the attention's tanh layer")
    train = add_training_arguments(p, batch=("--batch-tokens", "tokens per batch, padding included"),
                                   lr_help="peak learning rate (of AdamW, where Muon takes the matrices; "
                                           "default 1e-3, --recipe classic 7e-4)",
                                   warmup_help="warmup steps (default 200, --recipe classic 1000)")
    train.add_argument("--label-smoothing", type=PROBABILITY, help="of the target distribution")
    train.add_argument("--teacher-forcing", type=real(0, 1), metavar="RATIO",
                       help="LSTM: probability of feeding the true previous token while training; otherwise "
                            "the model's own prediction is fed (scheduled sampling)")
    train.add_argument("--bleu-samples", type=integer(0),
                       help="validation sentences translated for BLEU (0 = none: the best checkpoint is then the one "
                            "with the lowest validation loss)")
    show_defaults(p, settings)


# --- qkv translate / evaluate ---------------------------------------------------------------------------------

def _load_translator(args: argparse.Namespace, device):
    """The model of --model (a qkv checkpoint) or --pretrained (a Marian folder), with the LoRA adapter of
    --adapter, on ``device``, with its tokenizers; --beam and --alpha filled in from the model's own defaults
    where not given (qkv's: greedy, α 0.6; a Marian folder's: its generation_config.json)."""
    if bool(args.model) == bool(args.pretrained):
        raise ValueError("give one model: --model DIR (trained with qkv) or --pretrained DIR (a Marian folder)")
    if args.pretrained:
        from ..interop.hf_marian import load_marian_folder

        loaded = load_marian_folder(args.pretrained)
        defaults = (loaded.beam_size, loaded.length_penalty)
        args.length_cap = loaded.max_new_tokens  # where transformers stops, qkv stops
    else:
        from ..checkpoint import load_checkpoint

        loaded, defaults, args.length_cap = load_checkpoint(args.model), (1, 0.6), None
        if loaded.arch not in ("transformer", "lstm") or not {"src", "tgt"} <= set(loaded.tokenizers):
            raise ValueError(f"{loaded.path} is a {loaded.arch} checkpoint, not a translation model")
    args.beam = defaults[0] if args.beam is None else args.beam
    args.alpha = defaults[1] if args.alpha is None else args.alpha
    if args.adapter:  # before --quantize: the adapters stay float32 on the quantized layers
        from ..adapters import load_peft_adapter

        load_peft_adapter(loaded.model, args.adapter)
    place(loaded.model, device, args)
    return loaded


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

    check_new_file(args.output, "--output", args.force)
    check_new_file(args.attention, "--attention", args.force)
    device, _, amp = runtime(args)
    sources = read_inputs(args.text, args.input, "translate", keep_blank=True)
    if args.attention and not sources[0].strip():
        raise ValueError("--attention draws the first sentence, and it is empty; put a sentence first")
    ckpt = _load_translator(args, device)
    if args.attention:
        _check_attention_map(args, ckpt.model)
    with amp:
        hyps = translate(ckpt.model, ckpt.tokenizers, [s.strip() for s in sources], beam_size=args.beam,
                         alpha=args.alpha, use_cache=not args.no_cache, length_cap=args.length_cap)
    if args.output:
        _write_lines(args.output, hyps)
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


def _write_lines(path: str, lines: list[str]) -> None:
    """``lines`` into the file ``path``, whole (never through a link, never half-written)."""
    from ..files import write_atomically

    write_atomically(Path(path), lambda tmp: tmp.write_text("".join(line + "\n" for line in lines), encoding="utf-8"))


def evaluate(args: argparse.Namespace) -> None:
    from ..data import read_lines
    from ..metrics import bleu, check_tokenized_bleu, chrf, tokenized_bleu
    from ..tasks.translation import looks_chinese, translate

    check_new_file(args.output, "--output", args.force)
    device, _, amp = runtime(args)
    if args.tokenized_bleu:
        check_tokenized_bleu()  # spaCy is an extra: say so before translating, not after
    if not (args.model or args.pretrained) and not args.hyp:
        raise ValueError("give --hyp FILE (translations to score) or --model DIR --src FILE")
    if (args.model or args.pretrained) and not args.src:
        raise ValueError("with a model, give the source sentences with --src FILE")
    refs = read_lines(args.ref)
    if args.model or args.pretrained:
        sources = read_lines(args.src)
        if len(sources) != len(refs):
            raise ValueError(f"{args.src} has {len(sources)} lines but {args.ref} has {len(refs)}")
        ckpt = _load_translator(args, device)
        start = time.monotonic()
        with amp:
            hyps = translate(ckpt.model, ckpt.tokenizers, [s.strip() for s in sources], beam_size=args.beam,
                             alpha=args.alpha, length_cap=args.length_cap)
        print(f"translated {len(hyps)} sentences in {time.monotonic() - start:.1f}s (beam {args.beam})")
        if args.output:
            _write_lines(args.output, hyps)
    else:
        hyps = read_lines(args.hyp)
    language = args.lang or ("zh" if looks_chinese(refs) else None)
    print(bleu(hyps, refs, language=language))
    print(chrf(hyps, refs))
    if args.tokenized_bleu:
        print(tokenized_bleu(hyps, refs, language=args.lang or "en"))


# --- the parsers ----------------------------------------------------------------------------------------------

def _add_decoding_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pretrained", metavar="DIR", help="a Hugging Face Marian folder (opus-mt: config.json, weights, "
                                                        "source.spm, target.spm, vocab.json) instead of --model")
    p.add_argument("--adapter", metavar="DIR", help="a LoRA adapter in PEFT's format (adapter_config.json, "
                                                    "adapter_model.safetensors) to run on the model")
    p.add_argument("--beam", type=COUNT, help="beam size (1 = greedy; default 1, a Marian folder's own num_beams)")
    p.add_argument("--alpha", type=NON_NEGATIVE,
                   help="beam length penalty α (default 0.6, GNMT's; a Marian folder's own length_penalty, "
                        "transformers' score / length^α)")


def add_commands(sub) -> None:
    tr = command(sub, "translate", "translate sentences with a trained model")
    add_input_arguments(tr, blank=" (a blank line translates to a blank line)")
    tr.add_argument("--model", help="a checkpoint directory, or a run directory (uses best/)")
    tr.add_argument("--output", help="write translations here instead of stdout")
    _add_decoding_arguments(tr)
    tr.add_argument("--attention", metavar="FILE.png", help="write the first sentence's cross-attention map")
    add_force_argument(tr, "--output or --attention")
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
    add_force_argument(ev, "--output")
    _add_decoding_arguments(ev)
    ev.add_argument("--lang", help="target language code (zh: Chinese tokenization; detected automatically)")
    ev.add_argument("--tokenized-bleu", action="store_true",
                    help="also BLEU on lower-cased spaCy tokens, as older Multi30k results report "
                         "(needs spaCy: pip install 'qkv[bleu]')")
    add_device_arguments(ev)
    ev.set_defaults(run=evaluate)
