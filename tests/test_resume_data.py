"""--resume trains on the data the run started with: a data file changed since (same name, other text) is
refused with one line, where the run recorded its files (size and sha256); a run from before records none."""

import argparse
import json

import pytest
from clitools import one_line_error

from qkv.recipes.settings import DATA_FILES, merged_settings

DEFAULTS = {"text": None, "valid_text": None, "seed": 0, "max_steps": None}


def _settings(out, *, resume, text=None):
    args = argparse.Namespace(out=str(out), resume=resume, text=text, valid_text=None, seed=None, max_steps=9)
    return merged_settings(args, DEFAULTS, command="train lm", paths=("text", "valid_text"))


def _store(out, s, **meta):
    """What a recipe's checkpoint records: its options and (now) its data files."""
    from qkv import GPT, GPTConfig
    from qkv.checkpoint import save_checkpoint

    model = GPT(GPTConfig(vocab_size=8, d_model=8, n_heads=2, n_layers=1, max_seq_len=8))
    save_checkpoint(out / "last", model, tokenizers={},
                    meta={"command": "train lm", "args": {k: s[k] for k in DEFAULTS}, **meta})


def test_settings_record_the_data_files_and_refuse_them_changed_on_resume(tmp_path):
    text = tmp_path / "a.txt"
    text.write_text("to be or not to be\n")
    s = _settings(tmp_path / "run", resume=False, text=[str(text)])
    assert s[DATA_FILES] == {str(text.resolve()): {"size": 19, "sha256": s[DATA_FILES][str(text.resolve())]["sha256"]}}
    _store(tmp_path / "run", s, **{DATA_FILES: s[DATA_FILES]})
    assert _settings(tmp_path / "run", resume=True)[DATA_FILES] == s[DATA_FILES]  # unchanged: resumes
    text.write_text("to be or NOT to be\n")
    with pytest.raises(ValueError, match=r"a\.txt changed since the run started \(same size, another sha256\); resume "
                                         r"with the original data, or start a new run with another --out"):
        _settings(tmp_path / "run", resume=True)
    text.write_text("to be\n")
    with pytest.raises(ValueError, match=r"a\.txt changed since the run started \(size 19 -> 6 bytes\)"):
        _settings(tmp_path / "run", resume=True)


def test_a_run_from_before_the_record_resumes_as_before(tmp_path):
    text = tmp_path / "a.txt"
    text.write_text("to be or not to be\n")
    _store(tmp_path / "run", _settings(tmp_path / "run", resume=False, text=[str(text)]))  # no data_files
    text.write_text("something else entirely\n")
    assert _settings(tmp_path / "run", resume=True)["text"] == [str(text.resolve())]


def test_train_lm_records_its_text_and_resume_refuses_it_changed(cli_work, lm_run, copy_of, here):
    run = copy_of(lm_run)
    shakespeare = cli_work / "shakespeare.txt"
    config = json.loads((run / "last" / "config.json").read_text())
    recorded = config[DATA_FILES][str(shakespeare.resolve())]
    assert recorded["size"] == shakespeare.stat().st_size
    text = run.parent / "text.txt"  # the run's text, moved where this test may change it
    text.write_bytes(shakespeare.read_bytes())
    config["args"]["text"], config[DATA_FILES] = [str(text)], {str(text): recorded}
    (run / "last" / "config.json").write_text(json.dumps(config))
    text.write_text(shakespeare.read_text().replace("First", "Fir5t"))
    proc = here("train", "lm", "--out", run, "--resume", "--max-steps", "9", cwd=cli_work)
    one_line_error(proc, "text.txt changed since the run started (same size, another sha256)",
                   "resume with the original data, or start a new run with another --out")
