"""GPT-2 124M training throughput on a GPU: qkv's GPT against Hugging Face ``GPT2LMHeadModel`` (SDPA attention),
as tokens/s and as model-FLOP utilisation (MFU) of the bf16 matrix-multiply peak measured in the same run.

    python benchmarks/bench_gpu_train.py [--batch 16] [--context 1024] [--steps 30] [--compile both]
    python benchmarks/bench_gpu_train.py --device cpu --size tiny --batch 4 --context 64 --steps 3   # a smoke test

Both models get the same random ids, the same fused AdamW, bf16 autocast (fp32 on a CPU) and the same compile
setting; they are timed one after the other in one process, each after warm-up steps (compiling is not timed),
with the device synchronised around the timed steps. The vocabulary is 50,304 (GPT-2's 50,257 padded to a
multiple of 64, as qkv pads a model trained from scratch; Hugging Face gets the same size).

MFU = achieved model FLOP/s ÷ the peak: the peak is the best of several large bf16 matrix products
(8192 × 8192 × 8192) timed at the start of the run; a training token costs 6 FLOPs per weight of the matrix
products (forward 2, backward 4) plus 12 · layers · width · context for attention's two products.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from qkv import GPT, GPTConfig
from qkv.device import autocast, resolve_device, resolve_precision

VOCAB = 50304
SIZES = {"gpt2": dict(d_model=768, n_heads=12, n_layers=12), "tiny": dict(d_model=64, n_heads=2, n_layers=2)}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_peak(device: torch.device, dtype: torch.dtype, n: int, repeats: int = 10) -> float:
    """The best FLOP/s of an n x n x n product in ``dtype`` on ``device``."""
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    best = float("inf")
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        a @ b
        sync(device)
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


def flops_per_token(n_layers: int, d_model: int, context: int) -> float:
    weights = 12 * n_layers * d_model**2 + VOCAB * d_model  # attention 4d², MLP 8d², the output layer
    return 6 * weights + 12 * n_layers * d_model * context


def qkv_model(size: str, context: int) -> torch.nn.Module:
    return GPT(GPTConfig(vocab_size=VOCAB, max_seq_len=context, dropout=0.0, **SIZES[size]))


def hf_model(size: str, context: int) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    s = SIZES[size]
    cfg = GPT2Config(vocab_size=VOCAB, n_positions=context, n_embd=s["d_model"], n_head=s["n_heads"],
                     n_layer=s["n_layers"], resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    cfg._attn_implementation = "sdpa"
    return GPT2LMHeadModel(cfg)


def tokens_per_s(model, logits_of, args, device, amp) -> float:
    torch.manual_seed(0)
    model.to(device).train()
    if args.compiled:
        model.compile()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
    ids = torch.randint(0, VOCAB, (args.batch, args.context + 1), device=device)

    def step() -> None:
        with amp:
            logits = logits_of(model, ids[:, :-1])
        F.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(args.warmup):
        step()
    sync(device)
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    sync(device)
    return args.steps * args.batch * args.context / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--size", choices=sorted(SIZES), default="gpt2")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--compile", choices=["no", "yes", "both"], default="both")
    parser.add_argument("--peak-size", type=int, default=8192)
    parser.add_argument("--json")
    args = parser.parse_args()
    device = resolve_device(args.device)
    precision = resolve_precision("auto", device)
    dtype = precision.dtype or torch.float32
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        name = torch.cuda.get_device_name(device)
    else:
        name = "CPU"
    peak = matmul_peak(device, dtype, args.peak_size if device.type == "cuda" else min(args.peak_size, 1024))
    per_token = flops_per_token(SIZES[args.size]["n_layers"], SIZES[args.size]["d_model"], args.context)
    print(f"torch {torch.__version__}, {name}, {precision.name}; measured {str(dtype)[6:]} matmul peak "
          f"{peak / 1e12:.1f} TFLOP/s; {args.size}, batch {args.batch} x {args.context} tokens")
    contenders = {"qkv GPT": (qkv_model, lambda m, x: m(x)),
                  "HF GPT2LMHeadModel (sdpa)": (hf_model, lambda m, x: m(input_ids=x).logits)}
    results: dict[str, dict] = {}
    for compiled in {"no": [False], "yes": [True], "both": [False, True]}[args.compile]:
        args.compiled = compiled
        for name, (make, logits_of) in contenders.items():
            key = f"{name}, {'compiled' if compiled else 'eager'}"
            rate = tokens_per_s(make(args.size, args.context), logits_of, args, device, autocast(device, precision))
            results[key] = {"tokens_per_s": rate, "mfu": rate * per_token / peak}
            print(f"  {key:42s} {rate:12,.0f} tokens/s  MFU {100 * rate * per_token / peak:5.1f}%")
            if device.type == "cuda":
                torch.cuda.empty_cache()
        mode = "compiled" if compiled else "eager"
        ratio = results[f"qkv GPT, {mode}"]["tokens_per_s"] / results[f"HF GPT2LMHeadModel (sdpa), {mode}"][
            "tokens_per_s"]
        print(f"  qkv / Hugging Face, {mode}: {ratio:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": name, "peak_flops": peak, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
