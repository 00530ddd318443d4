"""A refused start changes nothing: a ``--resume`` with changed data, rank or method, a resume by another command,
a new start over a run that holds a model; each is one line, and every file of the run keeps its bytes and its
modification time, the run's mark (``.qkv-run``) included."""

import pytest
from clitools import last_line_error, ok
from finetune_model import workspace

pytest.importorskip("transformers")

SMALL = ["--context", "64", "--batch-size", "4", "--no-progress", "--device", "cpu", "--precision", "fp32"]


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return workspace(tmp_path_factory.mktemp("refused"), 12)


def _files(run):
    return {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(run.rglob("*")) if p.is_file()}


def test_each_refused_start_leaves_every_file_of_the_run_as_it_was(work, here):
    run = work / "run"
    ok(here("finetune", "--pretrained", "base", "--data", "train.jsonl", "--out", run, "--max-steps", "2",
            "--eval-every", "2", "--rank", "4", *SMALL, cwd=work))
    (work / "other.jsonl").write_text((work / "train.jsonl").read_text().replace("chat", "chien"), encoding="utf-8")
    before = _files(run)
    assert (run / ".qkv-run") in before
    resume = ["--out", run, "--resume", "--max-steps", "4", *SMALL]
    refusals = [
        (["finetune", *resume, "--data", "other.jsonl"], "--data"),
        (["finetune", *resume, "--rank", "8"], "--rank 8 differs from this run's 4"),
        (["finetune", *resume, "--method", "full"], "--method full differs from this run's lora"),
        (["train", "lm", *resume], "is a `qkv finetune` run, not a `qkv train lm` one"),
        (["finetune", "--pretrained", "base", "--data", "train.jsonl", "--out", run, "--max-steps", "4", *SMALL],
         "already holds a trained model"),
    ]
    for args, phrase in refusals:
        last_line_error(here(*args, cwd=work), phrase)
        assert _files(run) == before, args
