"""What fine-tuning buys, on the notes' own task and on Shakespeare: the data, and the scores before and after.

    python benchmarks/finetune_quality.py prepare --out runs/ft          # the files below, from ../shared/data
    qkv finetune --pretrained smollm2 --data runs/ft/zh.train.jsonl --valid-data runs/ft/zh.valid.jsonl ...
    python benchmarks/finetune_quality.py chrf --model smollm2 --model runs/ft-zh --data runs/ft [--limit N]
    python benchmarks/finetune_quality.py perplexity --model smollm2 --model runs/ft-shakespeare --data runs/ft
    qkv finetune --objective dpo --pretrained smollm2 --data runs/ft/zh.pairs.train.jsonl ...
    python benchmarks/finetune_quality.py prefers --model smollm2 --model runs/ft-dpo --data runs/ft

``prepare`` cuts ``tatoeba-en-zh/cmn.txt`` exactly as ``qkv train --tsv cmn.txt --test-size 1000 --valid-size
500`` does (qkv's from-scratch en→zh Transformer, ``docs/translation-results.md``), so the 1,000 test pairs are
the ones that model was scored on: ``zh.test.{src,ref}.txt``; the training and validation pairs become chat
examples, "Translate to Chinese: …" answered by the Chinese (``zh.train.jsonl``, ``zh.valid.jsonl``). Tiny
Shakespeare is cut at 90%: ``shakespeare.train.txt`` and ``shakespeare.valid.txt``. The same training and
validation pairs also become preference pairs, the prompt "Translate to Chinese: …", the chosen answer its own
translation and the rejected one the next pair's (``zh.pairs.train.jsonl``, ``zh.pairs.valid.jsonl``).
``--tatoeba`` and ``--shakespeare`` name other copies of the two files.

``chrf`` asks each model (``--model``: ``smollm2`` and other sources ``--pretrained`` reads, in float32 or with
``--weights auto`` as stored, or a ``qkv finetune`` run, its adapters on its base) for the test sentences
through its chat template, greedy, and scores the answers (sacreBLEU's chrF, and BLEU with ``tok:zh``).
``perplexity`` is the validation loss a ``qkv finetune`` run reports, of each model, on ``shakespeare.valid.txt``
in rows of ``--context`` tokens. ``prefers`` is how often each model finds the right translation of a held-out
pair (``zh.pairs.valid.jsonl``) more likely than the wrong one, the answers' log-probabilities summed over their
tokens, and its cross-entropy per token of the right ones.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"
PROMPT = "Translate to Chinese: {}"


def prepare(out: Path, tatoeba: Path, shakespeare: Path) -> None:
    from qkv.data import read_parallel
    from qkv.tasks.translation import split_off

    for path, what in ((tatoeba, "--tatoeba"), (shakespeare, "--shakespeare")):
        if not path.is_file():
            raise SystemExit(f"prepare: {path} is not a file: give {what} FILE, your copy of it (where to get it: "
                             "docs/training.md#data-sets-and-where-to-get-them)")
    out.mkdir(parents=True, exist_ok=True)
    pairs = read_parallel(tatoeba)
    train, test = split_off(pairs, 1000, 1)  # qkv train's --test-size 1000 (seed 0 + 1)
    train, valid = split_off(train, 500, 0)  # --valid-size 500
    for name, part in (("train", train), ("valid", valid)):
        lines = [json.dumps({"messages": [{"role": "user", "content": PROMPT.format(en)},
                                          {"role": "assistant", "content": zh}]}, ensure_ascii=False)
                 for en, zh in part]
        (out / f"zh.{name}.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
        wrong = [zh for _, zh in part[1:] + part[:1]]  # the next pair's translation
        lines = [json.dumps({"prompt": [{"role": "user", "content": PROMPT.format(en)}],
                             "chosen": [{"role": "assistant", "content": zh}],
                             "rejected": [{"role": "assistant", "content": other}]}, ensure_ascii=False)
                 for (en, zh), other in zip(part, wrong, strict=True) if zh != other]
        (out / f"zh.pairs.{name}.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (out / "zh.test.src.txt").write_text("\n".join(en for en, _ in test) + "\n", encoding="utf-8")
    (out / "zh.test.ref.txt").write_text("\n".join(zh for _, zh in test) + "\n", encoding="utf-8")
    text = shakespeare.read_text(encoding="utf-8")
    cut = text.rindex("\n\n", 0, int(len(text) * 0.9)) + 2
    (out / "shakespeare.train.txt").write_text(text[:cut], encoding="utf-8")
    (out / "shakespeare.valid.txt").write_text(text[cut:], encoding="utf-8")
    print(f"{out}: {len(train):,} training, {len(valid):,} validation and {len(test):,} test pairs; Shakespeare "
          f"{cut:,} + {len(text) - cut:,} characters")


def load(source: str, weights: str = "none"):
    """(model, tokenizer, chat template) of a qkv run, or of a pretrained source held as ``weights`` says (float32,
    or ``auto``: a GGUF file's own formats)."""
    from qkv.checkpoint import load_checkpoint
    from qkv.interop import load_pretrained

    if Path(source, "best").is_dir() or (Path(source, "config.json").is_file() and Path(source, "adapter").is_dir()):
        ckpt = load_checkpoint(source)
        return ckpt.model.eval(), ckpt.tokenizers["text"], ckpt.meta.get("chat_template")
    pre = load_pretrained(source, weights=weights)
    return pre.model.eval(), pre.tokenizer, pre.chat_template


def translations(source: str, sentences: list[str], batch: int, max_new_tokens: int, weights: str) -> list[str]:
    import torch
    from tqdm import tqdm

    from qkv.chat import render_chat, template_tokens
    from qkv.tasks.language_model import complete

    model, tokenizer, template = load(source, weights)
    names = template_tokens(tokenizer)
    prompts = [render_chat(template, [{"role": "user", "content": PROMPT.format(s)}], **names) for s in sentences]
    out: list[str] = []
    with torch.inference_mode(), tqdm(total=len(prompts), unit=" sentences", desc=source) as bar:  # rate, ETA
        for i in range(0, len(prompts), batch):
            out += complete(model, tokenizer, prompts[i : i + batch], max_new_tokens=max_new_tokens,
                            stop_ids=set(tokenizer.stop_ids))
            bar.update(len(prompts[i : i + batch]))
    return [t.strip().splitlines()[0] if t.strip() else "" for t in out]


def chrf(args: argparse.Namespace) -> dict:
    from qkv.metrics import bleu
    from qkv.metrics import chrf as chrf_score

    data = Path(args.data)
    src = (data / "zh.test.src.txt").read_text(encoding="utf-8").splitlines()[: args.limit]
    ref = (data / "zh.test.ref.txt").read_text(encoding="utf-8").splitlines()[: args.limit]
    results = {}
    for source in args.model:
        hyp = translations(source, src, args.batch, args.max_new_tokens, args.weights)
        results[source] = {"chrF": round(chrf_score(hyp, ref).score, 2),
                           "BLEU": round(bleu(hyp, ref, language="zh").score, 2),
                           "examples": [[s, h, r] for s, h, r in list(zip(src, hyp, ref, strict=True))[:5]]}
        print(f"{source}: chrF {results[source]['chrF']}, BLEU (tok:zh) {results[source]['BLEU']} on {len(src):,} "
              "test pairs")
    return results


def perplexity(args: argparse.Namespace) -> dict:
    import torch

    from qkv.tasks.finetune import FineTuneTask, read_examples, split_text

    results = {}
    for source in args.model:
        model, tokenizer, _ = load(source, args.weights)
        valid = split_text(read_examples(Path(args.data) / "shakespeare.valid.txt", tokenizer, None), args.context)
        task = FineTuneTask(model, tokenizer, valid[:1], valid, context=args.context, batch_size=4)
        with torch.inference_mode():
            loss = task.evaluate(model)["val_loss"]
        results[source] = {"val_loss": round(loss, 4), "perplexity": round(math.exp(loss), 2)}
        print(f"{source}: loss {loss:.4f}, perplexity {math.exp(loss):.2f} on shakespeare.valid.txt")
    return results


def prefers(args: argparse.Namespace) -> dict:
    import torch

    from qkv.tasks.preference import answer_logps, collate_pairs, read_pairs

    results = {}
    for source in args.model:
        model, tokenizer, template = load(source, args.weights)
        pairs = read_pairs(Path(args.data) / "zh.pairs.valid.jsonl", tokenizer, template, context=args.context)
        right, nll, tokens = 0, 0.0, 0
        with torch.inference_mode():
            for i in range(0, len(pairs), args.batch):
                part = list(enumerate(pairs[i : i + args.batch]))
                answers, chosen_nll = answer_logps(model, collate_pairs([[item] for item in part], 0))
                right += int((answers.chosen > answers.rejected).sum())
                nll, tokens = nll + float(chosen_nll), tokens + int(answers.chosen_tokens.sum())
        results[source] = {"prefers_right": round(right / len(pairs), 4), "chosen_loss": round(nll / tokens, 4)}
        print(f"{source}: prefers the right translation in {100 * right / len(pairs):.1f}% of {len(pairs):,} held-out "
              f"pairs; cross-entropy of the right ones {nll / tokens:.4f} a token")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("--out", required=True)
    p.add_argument("--tatoeba", type=Path, default=SHARED / "tatoeba-en-zh" / "cmn.txt", help="Tatoeba's cmn.txt")
    p.add_argument("--shakespeare", type=Path, default=SHARED / "tinyshakespeare" / "input.txt",
                   help="Tiny Shakespeare's input.txt")
    for name in ("chrf", "perplexity", "prefers"):
        p = sub.add_parser(name)
        p.add_argument("--model", action="append", required=True, help="smollm2, a pretrained source or a run")
        p.add_argument("--data", required=True, help="the folder prepare wrote")
        p.add_argument("--json", help="write the results here")
        p.add_argument("--limit", type=int, default=None, help="the first N test pairs only")
        p.add_argument("--batch", type=int, default=50)
        p.add_argument("--max-new-tokens", type=int, default=64)
        p.add_argument("--context", type=int, default=512)
        p.add_argument("--weights", default="none", help="a pretrained source's weights: none (float32) or auto "
                       "(a GGUF file's own formats, as qkv generate holds them)")
    args = parser.parse_args()
    if args.what == "prepare":
        prepare(Path(args.out), args.tatoeba, args.shakespeare)
        return
    results = {"chrf": chrf, "perplexity": perplexity, "prefers": prefers}[args.what](args)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
