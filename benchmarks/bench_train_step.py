"""Training-step throughput on a CPU: qkv's GPT against a nanoGPT-shaped reference at nanoGPT's CPU recipe, and
the translation Transformer in fp32, bf16 autocast and without dropout.

    python benchmarks/bench_train_step.py [--part nanogpt|translation|all] [--repeats 40] [--eager] [--json F]
    python benchmarks/bench_train_step.py --processes [--rounds 6] [--repeats 60]

One process, contenders alternated step by step, medians reported as ms/step, tokens/s and a ratio.

``--processes``: the eager reference and qkv's GPT (with biases), each in its own process as each runs for real,
alternating, ``--rounds`` of each; every process's median step over ``--repeats`` steps after a warm-up, and the
median of those. qkv's process sets up its C allocator as ``qkv train`` does (:func:`qkv.footprint.reuse_freed_memory`:
the memory a step frees is kept for the next), which one process shared with the reference cannot show.

* nanogpt: the configuration of nanoGPT's CPU recipe (4 layers, 128 wide, 4 heads, context 64, batch 12, a
  65-character vocabulary, no dropout, gradient clipping at 1). The reference is nanoGPT's model as its
  README and paper-style description lay it out, written here: one fused Q/K/V projection, PyTorch's
  ``scaled_dot_product_attention`` with ``is_causal``, exact GELU, no biases, tied embeddings, AdamW with the
  for-each implementation that nanoGPT uses off CUDA. qkv runs what ``qkv train lm --preset tiny`` runs:
  its ``GPT`` (GPT-2 style, biases, the tiny preset's exact GELU, the table padded to 128 rows), its language-model
  loss and its optimizer (fused AdamW); and the same without biases, nanoGPT's own configuration. Both eager, then both
  compiled (``torch.compile``; compiling is not timed), then qkv compiled in bf16 autocast (``--precision bf16``:
  faster only on a CPU with AVX512-BF16 or AMX).
* translation: the Multi30k configuration of the README (3+3 layers, d=256, 8 heads, FFN 1024, shared 8k
  vocabulary), 2,000 padded tokens a side.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qkv import GPT, GPTConfig, Transformer, TransformerConfig
from qkv.optimizers import build_optimizer
from qkv.tasks.language_model import LanguageModelTask, WindowBatch
from qkv.tokenizers import CharTokenizer

VOCAB, CONTEXT, BATCH, WIDTH, HEADS, LAYERS = 65, 64, 12, 128, 4, 4


class ReferenceBlock(nn.Module):
    """A pre-norm GPT-2 block as nanoGPT lays it out: one Linear makes Q, K and V; no biases."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(d, bias=False), nn.LayerNorm(d, bias=False)
        self.c_attn, self.c_proj = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d, bias=False)
        self.c_fc, self.mlp_proj = nn.Linear(d, 4 * d, bias=False), nn.Linear(4 * d, d, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2)
                   for z in self.c_attn(self.ln_1(x)).split(d, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.c_proj(y)
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))


class ReferenceGPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, WIDTH), nn.Embedding(CONTEXT, WIDTH)
        self.blocks = nn.ModuleList(ReferenceBlock(WIDTH, HEADS) for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(WIDTH, bias=False)
        self.lm_head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, ids: Tensor, targets: Tensor) -> Tensor:
        x = self.wte(ids) + self.wpe(torch.arange(ids.size(1)))
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.lm_head(self.ln_f(x)).flatten(0, 1), targets.flatten())


def reference_optimizer(model: nn.Module) -> torch.optim.AdamW:
    """nanoGPT's AdamW: lr 1e-3, β₂ 0.99, weight decay 0.1 on the matrices only, the for-each implementation."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                             lr=1e-3, betas=(0.9, 0.99), foreach=True)


def reference_update(model: nn.Module, opt: torch.optim.Optimizer, stream: Tensor, g: torch.Generator | None = None,
                     ) -> None:
    """One step of nanoGPT's loop: a batch of random windows of ``stream``, the loss, clipping at 1, the update."""
    starts = torch.randint(0, len(stream) - CONTEXT - 1, (BATCH,), generator=g)
    chunk = stream[starts[:, None] + torch.arange(CONTEXT + 1)]
    loss = model(chunk[:, :-1], chunk[:, 1:])
    loss.backward()
    nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    loss.item()  # a training loop reads its loss back


def reference_step(stream: Tensor, compiled: bool) -> Callable[[], None]:
    torch.manual_seed(0)
    model = ReferenceGPT()
    if compiled:
        model.compile()
    opt = reference_optimizer(model)
    g = torch.Generator().manual_seed(0)
    return lambda: reference_update(model, opt, stream, g)


def qkv_step(stream: Tensor, compiled: bool, bf16: bool = False, bias: bool = True) -> Callable[[], None]:
    """What qkv's Trainer does per step for ``qkv train lm --preset tiny --batch-size 12 --dropout 0``
    (``--compile``, ``--precision bf16``); without ``bias``, the same at nanoGPT's own configuration, whose layers
    have no biases (``bias = False`` in its train.py)."""
    torch.manual_seed(0)
    tokenizer = CharTokenizer.train(["".join(chr(33 + i) for i in range(VOCAB))])
    cfg = GPTConfig.from_preset("tiny", vocab_size=tokenizer.vocab_size, dropout=0.0, pad_id=None, vocab_multiple=64,
                                bias=bias)
    model = GPT(cfg)
    if compiled:
        model.compile()
    task = LanguageModelTask(model, tokenizer, stream, stream[:1000], context=CONTEXT, batch_size=BATCH)
    opt = build_optimizer(model, lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95))
    g = torch.Generator().manual_seed(0)

    def step() -> None:
        offsets = torch.randint(0, len(stream) - CONTEXT, (BATCH,), generator=g)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss, n = task.loss(model, WindowBatch(offsets, BATCH * CONTEXT))
        (loss / n).backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()

    return step


def translation_step(precision: str, dropout: float, batch: int = 100, length: int = 20, vocab: int = 8000):
    torch.manual_seed(0)
    cfg = TransformerConfig.from_preset("small", src_vocab_size=vocab, tgt_vocab_size=vocab, share_embeddings=True,
                                        d_ff=1024, dropout=dropout, attention_dropout=0.0, activation_dropout=0.0)
    model = Transformer(cfg).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    src = torch.randint(4, vocab, (batch, length))
    tgt_in, tgt_out = torch.randint(4, vocab, (batch, length)), torch.randint(4, vocab, (batch, length))

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            logits = model(src, tgt_in)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tgt_out.flatten(), label_smoothing=0.1)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def race(steps: dict[str, Callable[[], None]], repeats: int, warmup: int = 3) -> dict[str, float]:
    """Median seconds per step of each contender, the contenders alternated step by step."""
    for step in steps.values():
        for _ in range(warmup):  # compiles a compiled model
            step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def report(title: str, medians: dict[str, float], tokens: int, base: str, results: dict) -> None:
    print(f"\n{title}")
    for name, s in medians.items():
        results[name] = {"ms_per_step": s * 1e3, "tokens_per_s": tokens / s, f"speed_vs[{base}]": medians[base] / s}
        print(f"  {name:36s} {s * 1e3:7.1f} ms/step  {tokens / s:8,.0f} tokens/s  {medians[base] / s:5.2f}x")


def one_process(who: str, repeats: int) -> None:
    """A contender alone in this process (``--processes``'s child): prints its median ms/step."""
    from qkv.footprint import reuse_freed_memory

    stream = torch.randint(4, 4 + VOCAB, (200_000,))
    if who == "qkv":
        reuse_freed_memory()  # as qkv.training.Trainer sets it up
        step = qkv_step(stream, False)
    else:
        step = reference_step(stream - 4, False)
    print(race({who: step}, repeats, warmup=10)[who] * 1e3)


def processes(rounds: int, repeats: int) -> None:
    import subprocess
    import sys

    times: dict[str, list[float]] = {"reference": [], "qkv": []}
    for r in range(rounds):
        for who in ("reference", "qkv") if r % 2 == 0 else ("qkv", "reference"):
            done = subprocess.run([sys.executable, __file__, "--child", who, "--repeats", str(repeats)],
                                  capture_output=True, text=True, check=True)
            times[who].append(float(done.stdout.split()[-1]))
            print(f"  round {r + 1}: {who:9s} {times[who][-1]:6.2f} ms/step", flush=True)
    ref, ours = statistics.median(times["reference"]), statistics.median(times["qkv"])
    print(f"nanoGPT's CPU recipe, each in its own process, medians of {rounds}: reference {ref:.2f} ms/step, qkv GPT "
          f"(biases) {ours:.2f} ms/step: {ref / ours:.2f}x the reference's speed")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--processes", action="store_true", help="reference and qkv each in its own process")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--child", choices=["reference", "qkv"], help=argparse.SUPPRESS)
    parser.add_argument("--part", choices=["nanogpt", "translation", "all"], default="all")
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--eager", action="store_true", help="the eager steps only (nothing compiled)")
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.child:
        one_process(args.child, args.repeats)
        return
    if args.processes:
        processes(args.rounds, args.repeats)
        return
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    results: dict[str, dict] = {}
    if args.part in ("nanogpt", "all"):
        stream = torch.randint(4, 4 + VOCAB, (200_000,))  # qkv's ids of 65 characters
        chars = stream - 4  # the same text without qkv's four special ids
        steps = {"nanoGPT-shaped reference, eager": reference_step(chars, False),
                 "qkv GPT, eager": qkv_step(stream, False),
                 "qkv GPT without biases, eager": qkv_step(stream, False, bias=False)}
        if not args.eager:
            steps |= {"nanoGPT-shaped reference, compiled": reference_step(chars, True),
                      "qkv GPT, compiled": qkv_step(stream, True),
                      "qkv GPT, compiled, bf16 autocast": qkv_step(stream, True, bf16=True)}
        report("nanoGPT's CPU recipe: 4 x 128, context 64, batch 12 (768 tokens a step)",
               race(steps, args.repeats), BATCH * CONTEXT, "nanoGPT-shaped reference, eager", results)
    if args.part in ("translation", "all"):
        steps = {"transformer fp32, dropout 0.1": translation_step("fp32", 0.1),
                 "transformer fp32, no dropout": translation_step("fp32", 0.0),
                 "transformer bf16 autocast, dropout 0.1": translation_step("bf16", 0.1)}
        report("translation Transformer, 2 x 2,000 tokens a step", race(steps, max(5, args.repeats // 8)), 4000,
               "transformer fp32, dropout 0.1", results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
