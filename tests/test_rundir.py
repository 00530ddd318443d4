"""A run directory is owned by one process at a time, a user's files are never touched, and what a killed save
leaves behind is cleaned up."""

import os
import shutil
import signal
import subprocess
import sys

import pytest

from qkv.rundir import MARK, claim, holds


def start(out, *, resume):
    """Claim ``out`` and let it go at once."""
    with claim(out, resume=resume):
        pass


def test_a_new_run_may_go_into_a_new_or_empty_directory(tmp_path):
    with claim(tmp_path / "new", resume=False) as out:
        assert (out / MARK).is_file()
    (tmp_path / "empty").mkdir()
    with claim(tmp_path / "empty", resume=False):
        pass


def test_a_directory_of_someone_elses_files_is_never_touched(tmp_path):
    for name in ("log.csv", "loss.png", "test.src.txt"):
        (tmp_path / name).write_text("the user's own")
    with pytest.raises(ValueError, match=r"is not empty and is not a qkv run \(it holds log.csv, loss.png, "
                                         r"test.src.txt\); choose a new or empty directory"):
        start(tmp_path, resume=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["log.csv", "loss.png", "test.src.txt"]
    assert all(p.read_text() == "the user's own" for p in tmp_path.iterdir())


def test_a_model_needs_resume_and_resume_needs_a_model(tmp_path):
    with pytest.raises(ValueError, match="has no checkpoint to resume"):
        start(tmp_path / "run", resume=True)
    assert not (tmp_path / "run").exists()  # a start that failed leaves nothing behind
    with claim(tmp_path / "run", resume=False) as out:
        (out / "last").mkdir()
        (out / "last" / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="already holds a trained model; pass --resume"):
        start(tmp_path / "run", resume=False)
    with claim(tmp_path / "run", resume=True):
        pass


def test_a_run_that_stopped_before_its_first_checkpoint_can_start_again(tmp_path):
    with claim(tmp_path / "run", resume=False) as out:
        (out / "log.csv").write_text("step\n1\n")
    with claim(tmp_path / "run", resume=False):
        pass


HOLD = """
import sys, time
from qkv.rundir import claim
with claim(sys.argv[1], resume=False):
    print("claimed", flush=True)
    time.sleep(60)
"""


def _holder(out):
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "claimed"
    return proc


def test_one_process_at_a_time_and_a_killed_one_leaves_no_stale_lock(tmp_path):
    holder = _holder(tmp_path / "run")
    try:
        with pytest.raises(ValueError, match=rf"another qkv process \(pid {holder.pid}\) is training into"):
            start(tmp_path / "run", resume=False)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    with claim(tmp_path / "run", resume=False):  # the kernel released the dead process's lock
        pass


def test_a_directory_is_claimed_once_within_a_process(tmp_path):
    """Whoever starts the run claims it, once: a second claim inside the first is a mistake, and says so; the
    first one still holds the directory, and lets it go at its end."""
    assert not holds(tmp_path / "run")
    with claim(tmp_path / "run", resume=False):
        assert holds(tmp_path / "run") and holds(str(tmp_path / "." / "run"))
        with pytest.raises(RuntimeError, match="is claimed already by this process"), \
                claim(tmp_path / "run", resume=False):
            pass
        assert holds(tmp_path / "run")
    assert not holds(tmp_path / "run")
    start(tmp_path / "run", resume=False)  # and a later run claims it again


def test_leftovers_of_a_killed_save_are_cleaned_or_restored(tmp_path):
    run = tmp_path / "run"
    with claim(run, resume=False):
        pass
    dead, alive = ".best.99999999.k3x9.tmp", f".log.csv.{os.getpid()}.a1b2.tmp"  # no process has pid 99999999
    for name in (dead, ".last.old", "best"):
        (run / name).mkdir()
        (run / name / "config.json").write_text("{}")
    (run / ".last.old" / "weights").write_text("the last good checkpoint")
    (run / "log.tmp").write_text("half a log")
    (run / alive).write_text("a save under way")
    with claim(run, resume=True):
        pass
    assert sorted(p.name for p in run.iterdir()) == sorted([MARK, "best", "last", alive])
    assert (run / "last" / "weights").read_text() == "the last good checkpoint"
    (run / ".best.old").mkdir()  # best/ is there too: the .old copy is the stale one
    with claim(run, resume=True):
        pass
    assert not (run / ".best.old").exists()


def test_out_must_be_a_directory(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is a file; give a directory"):
        start(tmp_path / "file", resume=False)
    (tmp_path / "link").symlink_to(tmp_path / "nowhere")
    with pytest.raises(ValueError, match=rf"--out {tmp_path / 'link'} is a symbolic link to {tmp_path / 'nowhere'}, "
                                         "which does not exist; create that directory, or give another --out"):
        start(tmp_path / "link", resume=False)
    (tmp_path / "nowhere").mkdir()
    with claim(tmp_path / "link", resume=False) as out:  # a link to a directory is the user's choice of place
        assert (out / MARK).is_file() and (tmp_path / "nowhere" / MARK).is_file()


@pytest.mark.parametrize("resume", [False, True])
@pytest.mark.parametrize("name", [MARK, "log.csv", "loss.png", "test.src.txt", "best"])
def test_a_run_never_writes_through_a_symbolic_link(tmp_path, name, resume):
    run, target = tmp_path / "run", tmp_path / "someone-elses-file"
    with claim(run, resume=False):  # an earlier run, stopped after its first checkpoint when resumed
        if resume:
            (run / "last").mkdir()
            (run / "last" / "config.json").write_text("{}")
    target.write_text("not the run's")
    (run / name).unlink(missing_ok=True)
    (run / name).symlink_to(target)
    with pytest.raises(ValueError, match=rf"--out {run} holds symbolic links \({name} -> {target}\); a run writes its "
                                         "files by name .*: remove the links, or choose a new --out"):
        start(run, resume=resume)
    assert target.read_text() == "not the run's" and (run / name).is_symlink()


def test_a_mark_that_became_a_link_after_the_check_is_not_followed(tmp_path, monkeypatch):
    import qkv.rundir

    run, target = tmp_path / "run", tmp_path / "someone-elses-file"
    run.mkdir()
    target.write_text("not the run's")
    (run / MARK).symlink_to(target)
    monkeypatch.setattr(qkv.rundir, "_refuse_links", lambda out: None)  # the link appears between check and open
    with pytest.raises(ValueError, match=rf"cannot open {run / MARK}: .*\(a symbolic link is never followed\)"):
        start(run, resume=False)
    assert target.read_text() == "not the run's"


def test_the_command_line_refuses_a_run_directory_with_a_link_and_writes_nothing(here, tmp_path):
    from clitools import LM_TINY, one_line_error

    (tmp_path / "text.txt").write_text("the cat sat on the mat.\n" * 50)
    with claim(tmp_path / "run", resume=False):  # an earlier run that stopped before its first checkpoint
        pass
    (tmp_path / "elsewhere.png").write_bytes(b"the user's picture")
    (tmp_path / "run" / "loss.png").symlink_to(tmp_path / "elsewhere.png")
    one_line_error(here("train", "lm", "--text", "text.txt", *LM_TINY, "--max-steps", "2", "--out", "run",
                        cwd=tmp_path), "holds symbolic links (loss.png -> ", "remove the links, or choose a new --out")
    assert (tmp_path / "elsewhere.png").read_bytes() == b"the user's picture"
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [MARK, "loss.png"]


def test_a_run_left_with_best_but_no_last_is_kept_and_says_how_to_go_on(tmp_path):
    """best/ without last/ (an older save order killed between its two saves, or last/ deleted): nothing to resume,
    and a new start would replace that model: both refused in one line that says what to do, the model kept."""
    run = tmp_path / "run"
    with claim(run, resume=False):
        (run / "best").mkdir()
        (run / "best" / "config.json").write_text('{"step": 50}')
    for resume in (True, False):
        with pytest.raises(ValueError, match=r"holds a model in best/ but no last/, so there is no training state to "
                                             r"resume; to keep that model, choose another --out; to train this run "
                                             r"again from the start, move best/ out of it first"):
            start(run, resume=resume)
    assert (run / "best" / "config.json").read_text() == '{"step": 50}'
    shutil.move(run / "best", tmp_path / "kept")
    start(run, resume=False)


def _files(run):
    """Every file of ``run`` with its bytes and modification time."""
    return {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(run.rglob("*")) if p.is_file()}


def test_a_refused_claim_changes_no_file_of_the_run(tmp_path):
    """Refusals (a model without resume; another process's claim) leave the mark and every other file as they
    were, bytes and times: a claim writes nothing into the mark."""
    run = tmp_path / "run"
    with claim(run, resume=False):
        (run / "last").mkdir()
        (run / "last" / "config.json").write_text("{}")
    before = _files(run)
    with pytest.raises(ValueError, match="already holds a trained model"):
        start(run, resume=False)
    assert _files(run) == before
    start(run, resume=True)
    assert _files(run) == before
