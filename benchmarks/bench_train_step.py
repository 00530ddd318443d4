"""Training-step throughput of the translation Transformer: fp32 vs bf16 autocast, and the cost of dropout.

    python benchmarks/bench_train_step.py [--json results.json]

One process, contenders alternated, medians of several repetitions; reported as tokens/s (source + target) and
as a ratio to the fp32 baseline. The model is the Multi30k configuration of the README (3+3 layers, d=256,
8 heads, FFN 1024, shared 8k vocabulary); the batch is 2,000 padded tokens a side.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from qkv import Transformer, TransformerConfig


def make_step(precision: str, dropout: float, batch: int = 100, length: int = 20, vocab: int = 8000):
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

    return step, 2 * batch * length


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    contenders = {"fp32, dropout 0.1": ("fp32", 0.1), "fp32, no dropout": ("fp32", 0.0),
                  "bf16 autocast, dropout 0.1": ("bf16", 0.1)}
    steps = {name: make_step(*spec) for name, spec in contenders.items()}
    for step, _ in steps.values():
        step()  # warm up
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(args.repeats):
        for name, (step, _) in steps.items():
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    base = statistics.median(times["fp32, dropout 0.1"])
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; one training step, 2 x 2,000 tokens")
    results = {}
    for name, samples in times.items():
        median = statistics.median(samples)
        tokens = steps[name][1]
        results[name] = {"s_per_step": median, "tokens_per_s": tokens / median, "speed_vs_fp32": base / median}
        print(f"  {name:28s} {median * 1e3:7.0f} ms/step  {tokens / median:7.0f} tokens/s  {base / median:5.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
