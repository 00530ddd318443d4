"""Several processes with torchrun and DistributedDataParallel, on the CPU with Gloo: two processes with the
same global batch follow one process's run, write one set of checkpoints and logs, and resume."""

import re
import socket
import subprocess
import sys

import pytest
import torch
from clitools import ENV, HANG, LM_TINY, TRANSLATION_TINY, command, last_line_error, ok, qkv
from safetensors.torch import load_file

pytestmark = pytest.mark.slow  # each run starts two interpreters


def torchrun(*args, cwd, processes: int = 2) -> subprocess.CompletedProcess:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}"]
    proc = subprocess.run([*launcher, *command(*args)[1:]], cwd=cwd, env=ENV, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=HANG)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _log(run, column):
    header, *rows = (run / "log.csv").read_text().splitlines()
    i = header.split(",").index(column)
    return [(int(r.split(",")[0]), float(r.split(",")[i])) for r in rows if r.split(",")[i]]


def _same_losses(ours: list[tuple[int, float]], theirs: list[tuple[int, float]], *, rel: float) -> None:
    """The same steps, each with the same loss within ``rel`` (pytest.approx takes flat lists only)."""
    assert [step for step, _ in ours] == [step for step, _ in theirs]
    assert [loss for _, loss in ours] == pytest.approx([loss for _, loss in theirs], rel=rel)


# fp32 pinned: on a CPU with AMX, --precision auto picks bf16, whose rounding differs between one process
# accumulating two batches and two processes averaging one each
CPU_FP32 = ["--device", "cpu", "--precision", "fp32"]
LM = ["train", "lm", "--text", "shakespeare.txt", *LM_TINY, *CPU_FP32]
TRANSLATION = ["train", "--src", "train.de", "--tgt", "train.en", "--valid-src", "val.de", "--valid-tgt", "val.en",
               *TRANSLATION_TINY, "--dropout", "0", *CPU_FP32]  # the same numbers: no dropout


@pytest.mark.parametrize("trainer", [LM, TRANSLATION], ids=["lm", "translation"])
def test_two_processes_follow_one_with_the_same_global_batch(cli_work, tmp_path, trainer, here):
    one = ok(here(*trainer, "--out", tmp_path / "one", "--max-steps", "4", "--accum", "2", cwd=cli_work))
    two = torchrun(*trainer, "--out", tmp_path / "two", "--max-steps", "4", cwd=cli_work)
    assert two.stdout.count("step budget reached after 4 steps") == 1  # rank 0 reports, once
    validations = [[line for line in proc.stdout.splitlines() if line.startswith("step ")] for proc in (one, two)]
    assert len(validations[1]) == len(validations[0]) > 0  # rank 0 prints them, rank 1 does not
    # the best's step is a count (which step: the last one's rate is zero at the end of a wsd decay)
    assert re.search(r"  step \d+  -> ", two.stdout) and not re.search(r"step \d+\.0", two.stdout)
    one_w = load_file(tmp_path / "one" / "last" / "model.safetensors")
    two_w = load_file(tmp_path / "two" / "last" / "model.safetensors")
    assert one_w.keys() == two_w.keys()
    for name in one_w:
        # A key projection's bias adds q·b to every score of a row, which softmax ignores: its true gradient is
        # 0, and AdamW turns the rounding noise left in its place into full-sized steps, different in each run.
        if not name.endswith("k_proj.bias"):
            torch.testing.assert_close(two_w[name], one_w[name], atol=1e-5, rtol=1e-4, msg=name)
    for column in ("train_loss", "val_loss"):
        one, two = _log(tmp_path / "one", column), _log(tmp_path / "two", column)
        assert [s for s, _ in one] == [s for s, _ in two]  # one log, not one per process
        assert [v for _, v in two] == pytest.approx([v for _, v in one], rel=1e-4)
    assert sorted(p.name for p in (tmp_path / "two").iterdir()) == [".qkv-run", "best", "last", "log.csv",
                                                                     "loss.png"]


def test_a_run_resumes_in_two_processes(cli_work, tmp_path, here):
    """One process's run (the same global batch: two accumulated batches) goes on in two."""
    ok(here(*LM, "--out", tmp_path / "run", "--max-steps", "3", "--accum", "2", cwd=cli_work))
    proc = torchrun("train", "lm", "--out", tmp_path / "run", "--resume", "--max-steps", "6", "--device", "cpu",
                    "--no-progress", cwd=cli_work)
    assert "at step 3" in proc.stderr and proc.stdout.count("after 6 steps") == 1
    assert [s for s, _ in _log(tmp_path / "run", "val_loss")] == [3, 6]


def test_an_inconsistent_launcher_environment_is_one_line(cli_work, tmp_path):
    proc = subprocess.run(command(*LM, "--out", tmp_path / "run", "--max-steps", "1"), cwd=cli_work,
                          env={**ENV, "RANK": "1", "WORLD_SIZE": "2"}, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=HANG)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "torchrun's environment is incomplete (LOCAL_RANK, MASTER_ADDR, MASTER_PORT not set)" in proc.stderr


def test_a_rank_whose_rank_0_never_comes_says_so_within_the_rendezvous_timeout(cli_work, tmp_path):
    """RANK=1 of 2 with no rank 0 anywhere waited for ever; it gives up after QKV_RENDEZVOUS_TIMEOUT seconds."""
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**ENV, "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "QKV_RENDEZVOUS_TIMEOUT": "2"}
    proc = subprocess.run(command(*LM, "--out", tmp_path / "run", "--max-steps", "1"), cwd=cli_work, env=env,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=HANG)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert f"no rank 0 answered at 127.0.0.1:{port} within 2 s: start all 2 processes with torchrun" in proc.stderr
    assert not (tmp_path / "run").exists()


# --- fine-tuning: adapters replicated (DDP), a whole model sharded (FSDP2) ------------------------------------------

FINETUNE = ["finetune", "--pretrained", "base", "--data", "train.jsonl", "--context", "64", "--batch-size", "2",
            "--lr", "1e-3", "--warmup", "0", "--schedule", "constant", "--eval-every", "2", "--no-progress",
            *CPU_FP32]  # 48 examples: 4 steps of 2 × 2 rows stay inside the first epoch


@pytest.fixture(scope="module")
def finetune_work(tmp_path_factory):
    from finetune_model import workspace

    return workspace(tmp_path_factory.mktemp("finetune"), 48)


def test_adapters_in_two_processes_follow_one(finetune_work):
    work = finetune_work
    ok(qkv(*FINETUNE, "--out", "one", "--max-steps", "4", "--accum", "2", cwd=work))
    torchrun(*FINETUNE, "--out", "two", "--max-steps", "4", cwd=work)
    for column in ("train_loss", "val_loss"):
        assert [v for _, v in _log(work / "two", column)] == pytest.approx([v for _, v in _log(work / "one", column)],
                                                                           rel=1e-4)
    one, two = (load_file(work / run / "last" / "adapter" / "adapter_model.safetensors") for run in ("one", "two"))
    assert one.keys() == two.keys() and len(one) > 0
    for name in one:
        torch.testing.assert_close(two[name], one[name], atol=1e-5, rtol=1e-4, msg=name)


FULL = [*FINETUNE, "--method", "full"]  # --fsdp: the default of --method full


@pytest.fixture(scope="module")
def sharded_run(finetune_work):
    torchrun(*FULL, "--out", "fsdp", "--max-steps", "4", cwd=finetune_work)
    return finetune_work / "fsdp"


def test_a_sharded_full_fine_tuning_writes_the_replicated_runs_checkpoint(finetune_work, sharded_run):
    torchrun(*FULL, "--out", "ddp", "--max-steps", "4", "--no-fsdp", cwd=finetune_work)
    _same_losses(_log(sharded_run, "train_loss"), _log(finetune_work / "ddp", "train_loss"), rel=1e-4)
    ddp, fsdp = (load_file(run / "last" / "model.safetensors") for run in (finetune_work / "ddp", sharded_run))
    assert ddp.keys() == fsdp.keys()  # the same file: tied tables stored once, under the same name
    for name in ddp:
        torch.testing.assert_close(fsdp[name], ddp[name], atol=1e-5, rtol=1e-4, msg=name)


def test_a_sharded_run_resumes_exactly(finetune_work, sharded_run):
    """The whole weights and AdamW moments it wrote, cut back into shards, continue the run as if unbroken."""
    torchrun(*FULL, "--out", "halves", "--max-steps", "2", cwd=finetune_work)
    torchrun("finetune", "--out", "halves", "--resume", "--max-steps", "4", "--no-progress", *CPU_FP32,
             cwd=finetune_work)
    _same_losses(_log(finetune_work / "halves", "train_loss"), _log(sharded_run, "train_loss"), rel=1e-5)


def test_fsdp_with_adapters_is_one_line(finetune_work):
    proc = qkv(*FINETUNE, "--out", "no", "--max-steps", "1", "--fsdp", cwd=finetune_work)
    last_line_error(proc, "--fsdp shards full fine-tuning only; --method lora trains adapters")
    assert not (finetune_work / "no").exists()


# --- preference objectives: the rewards summed over the processes, the reference computed where it lies -----------

PAIRS = [*FINETUNE[:3], "--data", "pairs.jsonl", *FINETUNE[5:], "--objective", "dpo"]


@pytest.fixture(scope="module")
def pairs_work(finetune_work):
    from finetune_model import preference_data

    preference_data(finetune_work / "pairs.jsonl", 48)
    return finetune_work


def test_preference_adapters_in_two_processes_follow_one(pairs_work):
    work = pairs_work
    ok(qkv(*PAIRS, "--out", "dpo-one", "--max-steps", "4", "--accum", "2", cwd=work))
    torchrun(*PAIRS, "--out", "dpo-two", "--max-steps", "4", cwd=work)
    for column in ("train_loss", "rewards/margins", "rewards/accuracies", "val_loss", "val_rewards/chosen"):
        assert [v for _, v in _log(work / "dpo-two", column)] == pytest.approx(
            [v for _, v in _log(work / "dpo-one", column)], rel=1e-4, abs=1e-6), column


def test_a_sharded_preference_run_precomputes_its_reference_as_the_replicated_run_copies_it(pairs_work):
    """Full fine-tuning with FSDP2 computes the reference once before the first step (a sharded frozen copy would be
    sharded too); replicated, it holds a frozen copy: the same losses."""
    work = pairs_work
    torchrun(*PAIRS, "--method", "full", "--out", "dpo-fsdp", "--max-steps", "2", cwd=work)
    torchrun(*PAIRS, "--method", "full", "--no-fsdp", "--out", "dpo-ddp", "--max-steps", "2", cwd=work)
    assert (work / "dpo-fsdp" / "reference_logps.safetensors").is_file()
    assert not (work / "dpo-ddp" / "reference_logps.safetensors").exists()
    _same_losses(_log(work / "dpo-fsdp", "train_loss"), _log(work / "dpo-ddp", "train_loss"), rel=1e-4)
