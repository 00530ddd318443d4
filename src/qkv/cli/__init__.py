"""The ``qkv`` command: one subcommand per user task.

Library code raises ``ValueError``/``TypeError``/``OSError`` with a full sentence; here they become one line
on stderr and a non-zero exit, never a traceback.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

import torch

from . import bert, lm, translation

log = logging.getLogger("qkv")


def _tour(args: argparse.Namespace) -> None:
    """A short walk through the pieces: attention by hand, the three model families, two invariants,
    and a Transformer learning to copy."""
    import torch.nn.functional as F

    from .. import BERT, GPT, BERTConfig, GPTConfig, Transformer, TransformerConfig
    from ..nn import causal_mask, scaled_dot_product_attention

    torch.manual_seed(args.seed)
    print("1. Scaled dot-product attention, softmax(QKᵀ/√d_k)·V, on 4 tokens with a causal mask")
    q, k, v = torch.randn(4, 8), torch.randn(4, 8), torch.randn(4, 8)
    _, weights = scaled_dot_product_attention(q, k, v, causal_mask(4))
    for row in weights:
        print("   " + "  ".join(f"{w:.2f}" for w in row.tolist()))
    print("   each row sums to 1; zeros above the diagonal are the future a decoder may not see\n")

    print("2. The three halves of one architecture")
    models = {
        "Transformer (encoder-decoder)": Transformer(TransformerConfig.from_preset("small", src_vocab_size=8000,
                                                                                   tgt_vocab_size=8000)),
        "GPT (decoder-only, GPT-2 style)": GPT(GPTConfig(vocab_size=8000, d_model=256, n_heads=8, n_layers=4)),
        "GPT (decoder-only, LLaMA style)": GPT(GPTConfig.from_preset("llama", vocab_size=8000, d_model=256, n_heads=8,
                                                                      n_kv_heads=2, n_layers=4)),
        "BERT (encoder-only)": BERT(BERTConfig(vocab_size=8000, d_model=256, n_heads=8, n_layers=4)),
    }
    for name, model in models.items():
        total, body = model.num_parameters(), model.num_parameters(exclude_embeddings=True)
        print(f"   {name:34s} {total / 1e6:6.2f}M parameters ({body / 1e6:.2f}M without embeddings)")

    print("\n3. Invariants, checked live")
    gpt = models["GPT (decoder-only, LLaMA style)"].eval()
    ids = torch.randint(0, 8000, (2, 24))
    with torch.no_grad():
        full = gpt(ids)
        cache = gpt.new_cache()
        steps = [gpt(ids[:, :8], cache=cache)] + [gpt(ids[:, t : t + 1], cache=cache) for t in range(8, 24)]
        print(f"   KV-cached decoding vs full forward: max |Δlogit| = {(torch.cat(steps, 1) - full).abs().max():.1e}")
        explicit, att = gpt(ids, return_attention=True)  # weights requested: the written-out attention runs
        print(f"   causal: attention above the diagonal = {att[0].triu(1).abs().max():.1e}; "
              f"explicit vs fused attention: max |Δlogit| = {(explicit - full).abs().max():.1e}")

    print(f"\n4. A Transformer learns to copy random sequences ({args.steps} steps)")
    vocab, length, bos = 12, 10, 1
    model = Transformer(TransformerConfig(src_vocab_size=vocab, tgt_vocab_size=vocab, d_model=64, n_heads=4,
                                          n_layers=2, d_ff=128, dropout=0.0, max_seq_len=16))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    start = time.monotonic()
    for step in range(1, args.steps + 1):
        src = torch.randint(2, vocab, (64, length))
        tgt_in = torch.cat([torch.full((64, 1), bos), src[:, :-1]], 1)
        for group in opt.param_groups:
            group["lr"] = 3e-3 * min(1.0, step / 50)
        loss = F.cross_entropy(model(src, tgt_in).flatten(0, 1), src.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 50 == 0:
            print(f"   step {step:4d}  loss {loss.item():.4f}  ({time.monotonic() - start:.0f}s)")
    model.eval()
    src = torch.randint(2, vocab, (1, length))
    with torch.no_grad():
        memory, cache, ys = model.encode(src), model.new_cache(), torch.tensor([[bos]])
        for _ in range(length):  # greedy decoding with the KV cache
            ys = torch.cat([ys, model.decode(ys[:, -1:], memory, cache=cache)[:, -1:].argmax(-1)], 1)
    print(f"   source {src[0].tolist()}\n   copy   {ys[0, 1:].tolist()}")



# --- the parser ---------------------------------------------------------------------------------------------

class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        """One line, not a usage dump: what was wrong and where to look."""
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="qkv", description="A Transformer toolkit written from the building blocks up.")
    commands = ("demo", "train", "train lm", "train mlm", "train classify", "translate", "evaluate", "generate", "chat",
                "embed", "search", "similarity", "classify", "tour")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{" + ",".join(commands) + "}")

    demo = sub.add_parser("demo", help="train an English->Chinese date and number translator in ~3 minutes")
    demo.add_argument("--out", default="runs/demo", help="run directory (default runs/demo)")
    demo.add_argument("--minutes", type=float, default=2.5, help="training budget in minutes (default 2.5)")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--no-progress", action="store_true")
    demo.set_defaults(run=_demo)

    train = sub.add_parser("train", help="train a translation model on a parallel corpus "
                                         "(train lm: a language model; train mlm / train classify: BERT)")
    translation.add_train_arguments(train)
    train.set_defaults(run=translation.train)

    tr = sub.add_parser("translate", help="translate sentences with a trained model")
    tr.add_argument("text", nargs="*", help="sentences (else --input FILE, else stdin)")
    tr.add_argument("--model", required=True, help="a checkpoint directory, or a run directory (uses best/)")
    tr.add_argument("--input", help="file of sentences, one per line")
    tr.add_argument("--output", help="write translations here instead of stdout")
    tr.add_argument("--beam", type=int, default=1, help="beam size (1 = greedy, the default)")
    tr.add_argument("--alpha", type=float, default=0.6, help="beam length penalty α (default 0.6)")
    tr.add_argument("--attention", metavar="FILE.png", help="write the first sentence's cross-attention map")
    tr.add_argument("--layer", type=int, default=-1, help="decoder layer of the attention map (default: last)")
    tr.add_argument("--no-cache", action="store_true", help="decode without the KV cache (slower; same output)")
    tr.set_defaults(run=translation.translate)

    ev = sub.add_parser("evaluate", help="score translations with sacreBLEU and chrF")
    ev.add_argument("--ref", required=True, help="reference translations, one per line")
    ev.add_argument("--hyp", help="translations to score")
    ev.add_argument("--model", help="translate --src with this model, then score")
    ev.add_argument("--src", help="source sentences (with --model)")
    ev.add_argument("--output", help="with --model: also write the translations here")
    ev.add_argument("--beam", type=int, default=1)
    ev.add_argument("--alpha", type=float, default=0.6)
    ev.add_argument("--lang", help="target language code (zh: Chinese tokenization; detected automatically)")
    ev.add_argument("--tokenized-bleu", action="store_true",
                    help="also BLEU on lower-cased spaCy tokens, as older Multi30k results report")
    ev.set_defaults(run=translation.evaluate)

    lm.add_commands(sub)
    bert.add_commands(sub)

    tour = sub.add_parser("tour", help="a short tour of the building blocks and models")
    tour.add_argument("--steps", type=int, default=250, help="training steps of the copy task (default 250)")
    tour.add_argument("--seed", type=int, default=0)
    tour.set_defaults(run=_tour)
    return parser


def _demo(args: argparse.Namespace) -> None:
    from ..tasks.demo import run_demo

    run_demo(out=args.out, minutes=args.minutes, seed=args.seed, progress=not args.no_progress)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:2] == ["train", "lm"]:  # `qkv train lm`: the language-model trainer
        argv[:2] = ["train-lm"]
    elif argv[:2] in (["train", "mlm"], ["train", "classify"]):  # the encoder trainers
        argv[:2] = [f"train-{argv[1]}"]
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="qkv: %(message)s", stream=sys.stderr)
    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    try:
        args.run(args)
    except (ValueError, TypeError, OSError, FloatingPointError) as err:
        message = " ".join(str(err).split())  # one line, whatever the exception carried
        print(f"qkv {args.command}: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"qkv {args.command}: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
