"""``qkv train --arch``: the LSTM encoder-decoders (with no, dot-product and additive attention) and the
Transformer, each trained a few steps on the same slice of Multi30k, then loaded by the same ``translate``
and ``evaluate`` commands; and the option mix-ups, each one line on stderr.
"""

import json
import shutil
from pathlib import Path

import pytest
from clitools import PNG_MAGIC, ok, one_line_error

pytestmark = pytest.mark.slow  # trains four models; run in this process (test_cli.py starts the command as a user does)

COMMON = ["--vocab-size", "300", "--batch-tokens", "800", "--eval-every", "2", "--bleu-samples", "5", "--no-progress",
          "--warmup", "2", "--max-steps", "3"]
SIZES = {
    "transformer": ["--d-model", "32", "--n-heads", "2", "--n-layers", "1", "--d-ff", "64"],
    "lstm": ["--embedding-dim", "16", "--hidden-size", "32", "--n-layers", "1"],
    "lstm-dot": ["--embedding-dim", "16", "--hidden-size", "32", "--n-layers", "2", "--no-bidirectional"],
    "lstm-additive": ["--embedding-dim", "16", "--hidden-size", "32", "--n-layers", "1", "--attention-dim", "8",
                      "--teacher-forcing", "0.5"],
}
ATTENTION = {"lstm": "none", "lstm-dot": "dot", "lstm-additive": "additive"}
SENTENCES = ["Ein Mann fährt Fahrrad.", "Zwei Hunde spielen im Schnee."]


@pytest.fixture
def work(cli_work) -> Path:
    """The shared slices of Multi30k (conftest.py)."""
    return cli_work


def _trained(here, work: Path, arch: str) -> Path:
    """The run of ``arch`` in ``work``, trained on first use (3 steps, by ``qkv`` run in this process) and shared
    by every test after."""
    if not (work / arch / "last").is_dir():
        proc = ok(here("train", "--arch", arch, "--src", "train.de", "--tgt", "train.en", "--valid-src", "val.de",
                       "--valid-tgt", "val.en", "--out", arch, *SIZES[arch], *COMMON, cwd=work))
        assert "step budget reached after 3 steps" in proc.stdout
    return work / arch


@pytest.fixture(params=list(SIZES))
def run(request, work, here) -> tuple[str, Path]:
    return request.param, _trained(here, work, request.param)


def test_every_arch_trains_into_the_same_checkpoints(run):
    arch, path = run
    for name in ("best", "last"):
        for file in ("config.json", "model.safetensors", "tokenizer.src.json", "tokenizer.tgt.json"):
            assert (path / name / file).is_file(), f"{name}/{file}"
    config = json.loads((path / "last" / "config.json").read_text())
    assert config["step"] == 3 and config["args"]["arch"] == arch
    if arch == "transformer":
        assert config["arch"] == "transformer"
    else:
        assert config["arch"] == "lstm" and config["model"]["attention"] == ATTENTION[arch]
        assert config["model"]["hidden_size"] == 32 and config["model"]["share_embeddings"]
    assert config["args"]["teacher_forcing"] == (0.5 if arch == "lstm-additive" else 1.0)
    recipe = ("speedrun", "muon") if arch == "transformer" else ("classic", "adamw")  # each architecture's own
    assert (config["args"]["recipe"], config["args"]["optimizer"], config["args"]["lr"]) == (*recipe, 1e-3)
    assert (path / "loss.png").read_bytes().startswith(PNG_MAGIC)


def test_every_arch_translates_and_evaluates(here, run, tmp_path):
    arch, path = run
    args = ["translate", "--model", path, "--beam", "2", *SENTENCES]
    if arch != "lstm":
        args += ["--attention", "a.png"]
    proc = ok(here(*args, cwd=tmp_path))
    assert len(proc.stdout.splitlines()) == len(SENTENCES)
    if arch != "lstm":
        assert (tmp_path / "a.png").read_bytes().startswith(PNG_MAGIC)
    if arch == "lstm-dot":  # the carried state changes nothing but speed
        no_cache = ok(here("translate", "--model", path, "--beam", "2", "--no-cache", *SENTENCES, cwd=tmp_path))
        assert no_cache.stdout == proc.stdout
    work = path.parent
    proc = ok(here("evaluate", "--model", path / "last", "--src", "test.de", "--ref", "test.en", cwd=work))
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("translated 10 sentences")
    assert lines[1].startswith("BLEU = ") and lines[2].startswith("chrF = ")


def test_resume_an_lstm_run(work, tmp_path, here):
    run = Path(shutil.copytree(_trained(here, work, "lstm-additive"), tmp_path / "run"))
    proc = ok(here("train", "--out", run, "--resume", "--max-steps", "4", "--no-progress", cwd=work))
    assert "at step 3" in proc.stderr and "after 4 steps" in proc.stdout
    config = json.loads((run / "last" / "config.json").read_text())
    assert config["step"] == 4 and config["args"]["arch"] == "lstm-additive"
    assert config["args"]["teacher_forcing"] == 0.5 and config["model"]["attention_dim"] == 8


def test_error_attention_map_of_the_bottleneck_model(work, tmp_path, here):
    proc = here("translate", "--model", _trained(here, work, "lstm"), "--attention", "a.png", "Ein Hund.", cwd=tmp_path)
    one_line_error(proc, "no attention", "lstm-dot or lstm-additive")
    assert not (tmp_path / "a.png").exists()


@pytest.mark.parametrize("args, phrases", [
    (["--teacher-forcing", "0.5"], ["--teacher-forcing 0.5 needs an LSTM"]),
    (["--hidden-size", "64"], ["--hidden-size: LSTM option(s), not for --arch transformer"]),
    (["--arch", "lstm", "--d-model", "64", "--n-heads", "4"], ["--d-model, --n-heads: Transformer option(s)"]),
    (["--arch", "lstm-dot", "--attention-dim", "8"], ["--attention-dim", "lstm-additive"]),
    (["--arch", "lstm", "--teacher-forcing", "1.5"], ["argument --teacher-forcing: must be a finite number in [0, 1]"]),
    (["--arch", "lstm", "--hidden-size", "33"], ["odd hidden_size=33"]),
    (["--arch", "lstm", "--recipe", "speedrun"], ["--recipe speedrun is the Transformer's", "drop --recipe"]),
])
def test_error_options_of_the_other_architecture(work, tmp_path, args, phrases, here):
    proc = here("train", "--src", work / "train.de", "--tgt", work / "train.en", "--out", "out", "--max-steps", "1",
                "--valid-size", "20", *args, cwd=tmp_path)
    one_line_error(proc, *phrases)
