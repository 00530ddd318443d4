"""``qkv finetune`` end to end on a tiny LLaMA chat model: LoRA, QLoRA and full runs, the adapter a run writes
running on its base (`--adapter`), an exact `--resume`, preference objectives (`--objective dpo`, ...), and bad input
as one line with nothing saved lost."""

import csv
import json
import math
import re
import shutil

import pytest
from clitools import last_line_error, ok, qkv
from finetune_model import chat_folder, preference_data, workspace

pytest.importorskip("transformers")

SMALL = ["--context", "64", "--batch-size", "4", "--lr", "1e-2", "--no-progress", "--device", "cpu",
         "--precision", "fp32"]


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return workspace(tmp_path_factory.mktemp("finetune"), 24)


@pytest.fixture(scope="module")
def lora_run(work):
    done = ok(qkv("finetune", "--pretrained", "base", "--data", "train.jsonl", "--out", "lora", "--max-steps", "4",
                  "--eval-every", "2", "--rank", "4", *SMALL, cwd=work))
    (work / "lora.stderr").write_text(done.stderr, encoding="utf-8")
    return work / "lora"


def _train_losses(run):
    with open(run / "log.csv", encoding="utf-8") as f:
        return [(row["step"], row["train_loss"]) for row in csv.DictReader(f) if row["train_loss"]]


def test_a_lora_run_keeps_its_adapters_alone_and_they_run_on_the_base(work, lora_run):
    adapter = lora_run / "best" / "adapter"
    assert sorted(p.name for p in adapter.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert not (lora_run / "best" / "model.safetensors").exists()
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["base_model_name_or_path"]) == ("LORA", 4, str(work / "base"))
    meta = json.loads((lora_run / "best" / "config.json").read_text())
    assert meta["base"]["weights"] == "none" and len(meta["base"]["fingerprint"]) == 64
    prompt = ["--prompt", "Translate to French: the sun", "--max-new-tokens", "6", "--no-stream"]
    from_run = ok(qkv("generate", "--model", "lora", *prompt, cwd=work)).stdout
    on_base = ok(qkv("generate", "--pretrained", "base", "--adapter", "lora/best/adapter", *prompt, cwd=work)).stdout
    assert from_run == on_base


def test_the_chats_share_their_template_s_beginning_and_the_log_says_how_much(lora_run):
    log = (lora_run.parent / "lora.stderr").read_text()
    said = re.search(r"([\d,]+) of an epoch's ([\d,]+) tokens are computed", log)
    assert said, "no line on shared tokens"
    computed, real = (int(n.replace(",", "")) for n in said.groups())
    assert 0 < computed < real


def test_the_run_loads_as_its_base_with_the_adapters_learnt(work, lora_run):
    import torch

    from qkv.interop import load_pretrained
    from qkv.trained import load_trained

    adapted, base = load_trained(lora_run).model, load_pretrained(work / "base").model
    ids = torch.tensor([[1, 5, 9, 30, 31, 200]])
    with torch.no_grad():
        change = (adapted(ids) - base(ids)).abs().max()
    assert 1e-3 < change < 10  # learnt, and from where the base was


def test_resume_continues_as_if_never_stopped(work):
    common = ["--pretrained", "base", "--data", "train.jsonl", "--schedule", "constant", "--warmup", "0",
              "--eval-every", "3", *SMALL]
    ok(qkv("finetune", *common, "--out", "whole", "--max-steps", "6", cwd=work))
    ok(qkv("finetune", *common, "--out", "halves", "--max-steps", "3", cwd=work))
    ok(qkv("finetune", "--out", "halves", "--resume", "--max-steps", "6", "--no-progress", "--device", "cpu",
           "--precision", "fp32", cwd=work))
    whole, halves = _train_losses(work / "whole"), _train_losses(work / "halves")
    assert len(whole) == 6 and halves == whole


def test_qlora_trains_adapters_on_the_quantized_base(work):
    ok(qkv("finetune", "--pretrained", "base", "--data", "train.jsonl", "--out", "qlora", "--method", "qlora",
           "--max-steps", "6", "--eval-every", "3", "--warmup", "0", "--schedule", "constant", "--rank", "4",
           "--target-modules", "q_proj", "v_proj", *SMALL, cwd=work))
    meta = json.loads((work / "qlora" / "best" / "config.json").read_text())
    assert meta["base"]["weights"] == "int4"
    config = json.loads((work / "qlora" / "best" / "adapter" / "adapter_config.json").read_text())
    assert sorted(config["target_modules"]) == ["q_proj", "v_proj"]
    rows = _rows(work / "qlora")
    losses = [float(r["train_loss"]) for r in rows if r["train_loss"]]
    valid = [float(r["val_loss"]) for r in rows if r["val_loss"]]
    assert len(losses) == 6 and len(valid) == 2
    assert abs(losses[0] - math.log(320)) < 0.5  # a random model's loss over its 320 tokens: the loss is the right one
    assert losses[-1] < losses[0] - 0.1 and valid[1] < valid[0]  # and it falls: the adapters on int4 layers learn


def test_full_fine_tuning_saves_the_whole_model(work):
    ok(qkv("finetune", "--pretrained", "base", "--data", "train.jsonl", "--out", "full", "--method", "full",
           "--max-steps", "2", "--eval-every", "2", *SMALL, cwd=work))
    assert (work / "full" / "best" / "model.safetensors").is_file()
    assert not (work / "full" / "best" / "adapter").exists()
    import torch

    from qkv.checkpoint import load_checkpoint
    from qkv.interop import load_pretrained

    saved, base = load_checkpoint(work / "full").model.state_dict(), load_pretrained(work / "base").model.state_dict()
    assert saved.keys() == base.keys()  # the whole model, every weight
    assert sum(not torch.equal(saved[name], base[name]) for name in base) > len(base) // 2  # and learnt
    reply = ok(qkv("chat", "--model", "full", "--max-new-tokens", "3", cwd=work, input="Translate to French: a tree\n"))
    assert reply.stdout.strip(), reply  # the saved model answers


@pytest.mark.parametrize(("line", "phrases"), [
    ('{"messages": [{"role": "user", "content": "hi"}]}', ["line 25", "no assistant turn"]),
    ('{"messages": [{"role": "narrator", "content": "hi"}, {"role": "assistant", "content": "x"}]}',
     ["line 25", "'narrator'"]),
    ("not json", ["line 25 is not valid JSON"]),
    ('{"messages": [{"role": "user", "content": "\\ud800"}, {"role": "assistant", "content": "x"}]}',
     ["line 25", "message 0's content is not valid UTF-8 (a lone surrogate U+D800)"]),
])
def test_bad_data_is_one_line_naming_the_line(work, tmp_path, here, line, phrases):
    data = tmp_path / "data.jsonl"
    data.write_text((work / "train.jsonl").read_text() + line + "\n", encoding="utf-8")
    proc = here("finetune", "--pretrained", work / "base", "--data", data, "--out", tmp_path / "run", "--max-steps",
                "1", *SMALL, cwd=tmp_path)
    last_line_error(proc, *phrases)
    assert not (tmp_path / "run" / "best").exists()


@pytest.mark.parametrize(("options", "phrases"), [
    (["--target-modules", "c_attn"], ["unknown LoRA target modules ['c_attn']"]),
    (["--target-modules", "q_proj", "fc1"], ["the LoRA target modules ['fc1'] are not projections of a LLaMA-family "
                                             "model; choose among q_proj"]),
    (["--rank", "100"], ["the LoRA rank must be between 1 and the layer's smaller side (64), got 100"]),
    (["--context", "8"], ["every example is longer than the context of 8 tokens"]),
])
def test_impossible_settings_are_one_line(work, tmp_path, here, options, phrases):
    proc = here("finetune", "--pretrained", work / "base", "--data", work / "train.jsonl", "--out", tmp_path / "run",
                "--max-steps", "1", *SMALL, *options, cwd=tmp_path)
    last_line_error(proc, *phrases)


def test_a_qkv_run_without_hugging_face_names_fine_tunes_whole_and_lora_says_so(lm_run, tmp_path, here):
    (tmp_path / "more.txt").write_text("To be, or not to be, that is the question.\n" * 40, encoding="utf-8")
    proc = here("finetune", "--pretrained", lm_run, "--data", "more.txt", "--out", "run", "--max-steps", "1",
                *SMALL, cwd=tmp_path)
    last_line_error(proc, "got a GPT with norm='layer'", "with --method full")
    assert not (tmp_path / "run" / "best").exists()
    ok(here("finetune", "--pretrained", lm_run, "--data", "more.txt", "--out", "run", "--max-steps", "1",
            "--method", "full", *SMALL, cwd=tmp_path))
    assert (tmp_path / "run" / "best" / "model.safetensors").is_file()


def test_an_adapter_made_for_another_base_is_one_line(work, lora_run, tmp_path, here):
    chat_folder(tmp_path / "other", hidden=32)
    proc = here("generate", "--pretrained", tmp_path / "other", "--adapter", lora_run / "best" / "adapter",
                "--prompt", "hi", "--max-new-tokens", "2", cwd=tmp_path)
    last_line_error(proc, "another base model")


def test_a_lora_run_exports_its_adapters_and_the_merged_model(work, lora_run, here):
    import torch
    import transformers

    from qkv.trained import load_trained

    ok(here("export", "--model", lora_run, "--format", "peft", "--out", work / "peft-out", cwd=work))
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        assert (work / "peft-out" / name).read_bytes() == (lora_run / "best" / "adapter" / name).read_bytes()
    ok(here("export", "--model", lora_run, "--merge", "--out", work / "merged", cwd=work))
    merged = transformers.AutoModelForCausalLM.from_pretrained(work / "merged").eval()
    ids = torch.tensor([[1, 5, 9, 30, 31, 200]])
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, load_trained(lora_run).model(ids), rtol=1e-4, atol=1e-4)
    ok(here("export", "--model", lora_run, "--format", "gguf-lora", "--out", work / "adapter.gguf", cwd=work))
    import gguf

    reader = gguf.GGUFReader(work / "adapter.gguf")
    assert reader.get_field("general.type").contents() == "adapter"
    assert len(reader.tensors) == 2 * 7 * 2  # two layers, seven projections, A and B
    last_line_error(here("export", "--model", lora_run, "--out", work / "unmerged", cwd=work),
                    "holds LoRA adapters: --format peft or gguf-lora writes them, --merge")


def test_a_missing_or_deleted_base_is_one_line_naming_it(work, tmp_path, here):
    common = ["--data", work / "train.jsonl", "--max-steps", "1", "--rank", "4", *SMALL]
    proc = here("finetune", "--pretrained", tmp_path / "train.jsonl" / "base", "--out", tmp_path / "a", *common,
                cwd=tmp_path)
    last_line_error(proc, f"--pretrained '{tmp_path / 'train.jsonl' / 'base'}': no such file or folder; give")
    assert not (tmp_path / "a").exists()
    shutil.copytree(work / "base", tmp_path / "moved")
    ok(here("finetune", "--pretrained", tmp_path / "moved", "--out", tmp_path / "run", *common, cwd=tmp_path))
    shutil.rmtree(tmp_path / "moved")
    proc = here("finetune", "--out", tmp_path / "run", "--resume", "--max-steps", "2", *SMALL, cwd=tmp_path)
    last_line_error(proc, f"this run's base model '{tmp_path / 'moved'}' is gone", "put it back")


def test_a_batch_too_large_for_the_memory_is_refused_before_training(work):
    proc = qkv("finetune", "--pretrained", "base", "--data", "train.jsonl", "--out", "huge", "--max-steps", "1",
               *SMALL, "--batch-size", "100000000", cwd=work)
    last_line_error(proc, "base with --method lora (16,384 parameters learn) needs",
                    "for gradients, AdamW's moments and one batch of 100,000,000 × 64 tokens", "choose smaller sizes")
    assert not (work / "huge" / "last").exists()



def _rows(run):
    with open(run / "log.csv", encoding="utf-8") as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def pairs(work):
    preference_data(work / "pairs.jsonl", 24)
    return "pairs.jsonl"


def test_a_dpo_run_logs_trls_numbers_and_its_adapter_runs_on_the_base(work, pairs):
    ok(qkv("finetune", "--objective", "dpo", "--pretrained", "base", "--data", pairs, "--out", "dpo", "--max-steps",
           "4", "--eval-every", "2", "--rank", "4", *SMALL, cwd=work))
    rows = _rows(work / "dpo")
    train, valid = [r for r in rows if r["train_loss"]], [r for r in rows if r["val_loss"]]
    assert float(train[0]["train_loss"]) == pytest.approx(0.693147, abs=1e-5)  # log 2: the base is the reference
    for name in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins"):
        assert all(r[name] for r in train) and all(r[f"val_{name}"] for r in valid)
    assert all(r["val_chosen_loss"] for r in valid) and (work / "dpo" / "loss.png").is_file()
    assert (work / "dpo" / "best" / "adapter" / "adapter_model.safetensors").is_file()
    ok(qkv("generate", "--pretrained", "base", "--adapter", "dpo/best/adapter", "--prompt", "the sun",
           "--max-new-tokens", "3", cwd=work))


def test_a_preference_run_with_a_precomputed_reference_resumes_exactly(work, pairs):
    common = ["--objective", "ipo", "--precompute-ref", "--pretrained", "base", "--data", pairs, "--schedule",
              "constant", "--warmup", "0", "--eval-every", "2", "--rank", "4", *SMALL]
    ok(qkv("finetune", *common, "--out", "ipo-whole", "--max-steps", "4", cwd=work))
    ok(qkv("finetune", *common, "--out", "ipo-halves", "--max-steps", "2", cwd=work))
    stored = (work / "ipo-halves" / "reference_logps.safetensors").read_bytes()
    ok(qkv("finetune", "--out", "ipo-halves", "--resume", "--max-steps", "4", "--no-progress", "--device", "cpu",
           "--precision", "fp32", cwd=work))
    assert (work / "ipo-halves" / "reference_logps.safetensors").read_bytes() == stored  # read back, not made again
    whole, halves = (_train_losses(work / run) for run in ("ipo-whole", "ipo-halves"))
    assert len(whole) == 4 and halves == whole


@pytest.mark.parametrize("objective", ["dpo", "orpo"])
def test_full_fine_tuning_learns_preferences_against_a_frozen_copy_or_none(work, pairs, objective):
    ok(qkv("finetune", "--objective", objective, "--method", "full", "--pretrained", "base", "--data", pairs, "--out",
           f"full-{objective}", "--max-steps", "2", "--eval-every", "2", *SMALL, cwd=work))
    assert (work / f"full-{objective}" / "best" / "model.safetensors").is_file()
    first = float(_rows(work / f"full-{objective}")[0]["train_loss"])
    assert first == pytest.approx(0.693147, abs=1e-5) if objective == "dpo" else first > 0


@pytest.mark.parametrize(("line", "phrases"), [
    ('{"prompt": "a", "chosen": "", "rejected": "b"}', ["line 25", "the chosen answer is empty"]),
    ('{"prompt": "a", "chosen": "b", "rejected": "b"}', ["line 25", "the same"]),
    ('{"prompt": "a", "chosen": "b"}', ["line 25", "missing 'rejected'"]),
    ('{"prompt": "' + "a " * 200 + '", "chosen": "b", "rejected": "c"}', ["line 25", "the prompt is"]),
])
def test_a_bad_pair_is_one_line_and_nothing_saved_is_touched(work, pairs, tmp_path, here, line, phrases):
    run = tmp_path / "run"
    ok(here("finetune", "--objective", "simpo", "--pretrained", work / "base", "--data", work / pairs, "--out", run,
            "--max-steps", "1", "--rank", "4", *SMALL, cwd=tmp_path))
    saved = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    data = tmp_path / "more.jsonl"
    data.write_text((work / pairs).read_text() + line + "\n", encoding="utf-8")
    for out in (tmp_path / "new", run):  # a new run, and one over the saved run (refused before the data is read)
        proc = here("finetune", "--objective", "simpo", "--pretrained", work / "base", "--data", data, "--out", out,
                    "--max-steps", "2", *SMALL, cwd=tmp_path)
        last_line_error(proc, *(phrases if out != run else ["already holds a trained model", "--resume"]))
    assert not (tmp_path / "new" / "best").exists()
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == saved


def test_a_needless_reference_and_an_adapter_on_a_quantized_base_are_one_line(work, pairs, tmp_path, here):
    proc = here("finetune", "--objective", "orpo", "--precompute-ref", "--pretrained", work / "base", "--data",
                work / pairs, "--out", tmp_path / "a", "--max-steps", "1", *SMALL, cwd=tmp_path)
    last_line_error(proc, "--precompute-ref: --objective orpo has no reference model")
    proc = here("finetune", "--objective", "dpo", "--method", "qlora", "--adapter", work / "dpo" / "best" / "adapter",
                "--pretrained", work / "base", "--data", work / pairs, "--out", tmp_path / "b", "--max-steps", "1",
                *SMALL, cwd=tmp_path)
    last_line_error(proc, "--method qlora keeps the base quantized")
