"""The ``qkv`` command end to end, in real subprocesses, on small slices of real corpora: train, resume,
translate (arguments, file, stdin, beam, attention map), evaluate; and the mistakes users make, each of which
must end in one line on stderr, never a traceback.

One tiny model is trained per module and reused; tests that damage a run work on a copy.
"""

import gzip
import json
import subprocess
from pathlib import Path

import pytest
from clitools import PNG_MAGIC, TRANSLATION_TINY, ok, one_line_error, qkv

pytestmark = pytest.mark.slow  # about 30 subprocesses, each importing torch: a few minutes on 2 CPU cores

TINY = TRANSLATION_TINY
SENTENCES = ["Ein Mann fährt Fahrrad.", "Zwei Hunde spielen im Schnee."]


@pytest.fixture
def work(cli_work) -> Path:
    return cli_work


@pytest.fixture
def trained(translation_trained) -> tuple[Path, subprocess.CompletedProcess]:
    return translation_trained


@pytest.fixture
def run_copy(trained, copy_of) -> Path:
    """A copy of the trained run that a test may damage."""
    return copy_of(trained[0])


def _csv_steps(path: Path) -> list[int]:
    """The steps of the log's evaluation rows (a short run's training rows, which have an lr, come every step)."""
    header, *rows = path.read_text().splitlines()
    column, lr = header.split(",").index("step"), header.split(",").index("lr")
    return [int(row.split(",")[column]) for row in rows if not row.split(",")[lr]]


# --- train ----------------------------------------------------------------------------------------------------

def test_train_writes_checkpoints_log_and_curve(trained):
    run, proc = trained
    ok(proc)
    for name in ("best", "last"):
        for file in ("config.json", "model.safetensors", "tokenizer.src.json", "tokenizer.tgt.json"):
            assert (run / name / file).is_file(), f"{name}/{file}"
    assert (run / "last" / "trainer_state.pt").is_file()
    assert not (run / "best" / "trainer_state.pt").exists()
    assert json.loads((run / "last" / "config.json").read_text())["step"] == 6
    assert _csv_steps(run / "log.csv") == [3, 6]
    assert (run / "loss.png").read_bytes().startswith(PNG_MAGIC)
    assert "step budget reached after 6 steps" in proc.stdout
    assert "400 pairs kept" in proc.stderr and "50 pairs kept" in proc.stderr


def test_resume_continues_from_step_6_to_9(work, run_copy):
    # from the folder the run was started in: the stored data paths are relative to it
    proc = ok(qkv("train", "--out", run_copy, "--resume", "--max-steps", "9", "--no-progress", cwd=work))
    assert "at step 6" in proc.stderr
    assert "after 9 steps" in proc.stdout
    assert json.loads((run_copy / "last" / "config.json").read_text())["step"] == 9
    assert _csv_steps(run_copy / "log.csv") == [3, 6, 9]


def test_tatoeba_tsv_with_bpe_and_test_split(here, work, tmp_path):
    tsv = work / "zh.tsv"
    proc = ok(here("train", "--tsv", tsv, "--tokenizer", "bpe", "--test-size", "20", "--valid-size", "30",
                   "--out", "zh", "--max-steps", "2", *TINY, "--vocab-size", "400", cwd=tmp_path))
    assert "250 pairs kept" in proc.stderr  # 300 - 20 test - 30 validation
    run = tmp_path / "zh"
    sources = (run / "test.src.txt").read_text(encoding="utf-8").splitlines()
    references = (run / "test.ref.txt").read_text(encoding="utf-8").splitlines()
    assert len(sources) == len(references) == 20
    pairs = {tuple(line.split("\t")[:2]) for line in tsv.read_text(encoding="utf-8").splitlines()}
    assert all(pair in pairs for pair in zip(sources, references, strict=True))
    config = json.loads((run / "best" / "config.json").read_text(encoding="utf-8"))
    assert config["target_lang"] == "zh"  # detected from the Chinese side: BLEU used sacreBLEU's zh tokenizer
    assert json.loads((run / "best" / "tokenizer.tgt.json").read_text(encoding="utf-8"))["kind"] == "bpe"


# --- translate ------------------------------------------------------------------------------------------------

def test_translate_arguments_with_attention_map(trained, tmp_path):
    run, _ = trained
    proc = ok(qkv("translate", "--model", run, *SENTENCES, "--attention", "a.png", cwd=tmp_path))
    assert len(proc.stdout.splitlines()) == len(SENTENCES)
    assert (tmp_path / "a.png").read_bytes().startswith(PNG_MAGIC)


def test_translate_input_file(here, trained, tmp_path):
    run, _ = trained
    (tmp_path / "in.de").write_text("Ein Hund.\nZwei Katzen schlafen.\nEine Frau liest ein Buch.\n", encoding="utf-8")
    proc = ok(here("translate", "--model", run, "--input", "in.de", cwd=tmp_path))
    assert len(proc.stdout.splitlines()) == 3


def test_translate_stdin(trained, tmp_path):
    run, _ = trained
    proc = ok(qkv("translate", "--model", run, cwd=tmp_path, input="\n".join(SENTENCES) + "\n"))
    assert len(proc.stdout.splitlines()) == len(SENTENCES)


def test_translate_beam(here, trained, tmp_path):
    run, _ = trained
    proc = ok(here("translate", "--model", run / "last", "--beam", "3", *SENTENCES, cwd=tmp_path))
    assert len(proc.stdout.splitlines()) == len(SENTENCES)


# --- evaluate -------------------------------------------------------------------------------------------------

def test_export_names_what_a_marian_config_cannot_hold(here, trained, tmp_path):
    """The tiny model is Pre-Norm with interleaved sinusoids: no Marian folder holds it, and the one line says
    why; nothing is written."""
    run, _ = trained
    one_line_error(here("export", "--model", run, "--out", tmp_path / "marian", cwd=tmp_path),
                   "Marian config cannot hold", "norm_first=True", "sinusoidal_layout=interleaved")
    one_line_error(here("export", "--model", run, "--format", "gguf", "--out", tmp_path / "m.gguf", cwd=tmp_path),
                   "translation models (--format hf)")
    assert not list(tmp_path.iterdir())


def test_evaluate_hyp_ref(here, work):
    proc = ok(here("evaluate", "--hyp", "val.en", "--ref", "val.en", cwd=work))
    bleu, chrf = proc.stdout.splitlines()
    assert bleu.startswith("BLEU = 100.00") and "nrefs:1|" in bleu and "tok:13a" in bleu and "version:" in bleu
    assert chrf.startswith("chrF = 100.00") and "nrefs:1|" in chrf and "version:" in chrf


def test_evaluate_lang_zh(here, work):
    proc = ok(here("evaluate", "--hyp", "val.en", "--ref", "val.en", "--lang", "zh", cwd=work))
    assert "tok:zh" in proc.stdout.splitlines()[0]


def test_evaluate_model_src_ref(here, trained, work):
    run, _ = trained
    proc = ok(here("evaluate", "--model", run, "--src", "test.de", "--ref", "test.en", "--output", "hyp.en", cwd=work))
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("translated 10 sentences")
    assert lines[1].startswith("BLEU = ") and lines[2].startswith("chrF = ")
    assert len((work / "hyp.en").read_text(encoding="utf-8").splitlines()) == 10


# --- mistakes: one line on stderr, no traceback ---------------------------------------------------------------

def test_error_unequal_line_counts(here, work, tmp_path):
    (tmp_path / "short.de").write_text("Ein Hund.\nZwei Katzen.\n", encoding="utf-8")
    proc = here("train", "--src", "short.de", "--tgt", work / "train.en", "--out", "out", "--max-steps", "1",
                cwd=tmp_path)
    one_line_error(proc, "short.de", "2 lines", "400", "align")
    assert not (tmp_path / "out").exists()


def test_error_missing_training_file(work, tmp_path, here):
    proc = here("train", "--src", "missing.de", "--tgt", work / "train.en", "--out", "out", "--max-steps", "1",
                cwd=tmp_path)
    one_line_error(proc, "missing.de", "no such file")


def test_error_tsv_without_tabs(tmp_path, here):
    (tmp_path / "pairs.tsv").write_text("Hi.\t你好。\nno tab here\n", encoding="utf-8")
    proc = here("train", "--tsv", "pairs.tsv", "--out", "out", "--max-steps", "1", cwd=tmp_path)
    one_line_error(proc, "pairs.tsv", "line 2", "no tab")


def test_error_corrupt_gzip(work, tmp_path, here):
    packed = gzip.compress((work / "train.de").read_bytes())
    (tmp_path / "train.de.gz").write_bytes(packed[:10] + b"\xff" * 20 + packed[30:])
    proc = here("train", "--src", "train.de.gz", "--tgt", work / "train.en", "--out", "out", "--max-steps", "1",
                cwd=tmp_path)
    one_line_error(proc, "train.de.gz")


def test_error_model_dir_missing(tmp_path, here):
    proc = here("translate", "--model", "no-such-run", "Ein Hund.", cwd=tmp_path)
    one_line_error(proc, "no-such-run", "no such model directory")


def test_error_corrupted_weights(run_copy, here):
    (run_copy / "best" / "model.safetensors").write_bytes(b"\x00garbage, not safetensors" * 10)
    proc = here("translate", "--model", run_copy, "Ein Hund.", cwd=run_copy.parent)
    one_line_error(proc, "model.safetensors", "corrupted")


def test_error_corrupted_tokenizer(run_copy, here):
    (run_copy / "best" / "tokenizer.src.json").write_text("[]")
    proc = here("translate", "--model", run_copy, "Ein Hund.", cwd=run_copy.parent)
    one_line_error(proc, "tokenizer.src.json")


def test_error_beam_zero(trained, tmp_path, here):
    proc = here("translate", "--model", trained[0], "--beam", "0", "Ein Hund.", cwd=tmp_path)
    one_line_error(proc, "argument --beam: must be an integer >= 1, got '0'")


def test_error_unknown_option(trained, tmp_path):
    proc = qkv("translate", "--model", trained[0], "--bogus", "Ein Hund.", cwd=tmp_path)
    one_line_error(proc, "unrecognized arguments: --bogus", "--help")


def test_error_train_into_existing_run(trained, work, here):
    run, _ = trained
    before = (run / "best" / "model.safetensors").read_bytes()
    proc = here("train", "--src", "train.de", "--tgt", "train.en", "--out", "run", "--max-steps", "1", cwd=work)
    one_line_error(proc, "already holds a trained model", "--resume")
    assert (run / "best" / "model.safetensors").read_bytes() == before


def test_error_resume_a_finished_run(work, run_copy, here):
    # trained to its whole --max-steps 6; the budget counts the run, so nothing is left to do
    before = (run_copy / "last" / "model.safetensors").read_bytes()
    proc = here("train", "--out", run_copy, "--resume", "--no-progress", cwd=work)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    last = proc.stderr.splitlines()[-1]  # after the data and model lines, the error
    assert last.startswith("qkv train: error:") and "already ran 6 steps" in last and "raise --max-steps" in last
    assert (run_copy / "last" / "model.safetensors").read_bytes() == before


def test_error_resume_without_checkpoint(work, tmp_path, here):
    proc = here("train", "--src", work / "train.de", "--tgt", work / "train.en", "--out", "fresh", "--resume",
                "--max-steps", "1", cwd=tmp_path)
    one_line_error(proc, "fresh", "no checkpoint to resume")


def test_error_nothing_on_stdin(trained, tmp_path, here):
    proc = here("translate", "--model", trained[0], cwd=tmp_path, input="")
    one_line_error(proc, "nothing to translate")


def test_the_transformer_trains_with_the_speedrun_recipe_and_the_lstms_with_theirs(work, tmp_path, here):
    """qkv train's default: Muon, wsd and the multi30k model; --recipe classic: the paper's schedule and the small
    model; an LSTM keeps its own recipe (AdamW: Muon has no matrices there)."""

    def trained(name, *args):
        ok(here("train", "--src", work / "train.de", "--tgt", work / "train.en", "--out", name, "--max-steps", "1",
                "--valid-size", "20", "--vocab-size", "300", "--bleu-samples", "0", "--no-progress", *args,
                cwd=tmp_path))
        return json.loads((tmp_path / name / "last" / "config.json").read_text())

    config = trained("speedrun", "--d-model", "32", "--n-heads", "2", "--n-layers", "1")
    settings = {k: config["args"][k] for k in ("recipe", "optimizer", "schedule", "preset", "batch_tokens")}
    assert settings == dict(recipe="speedrun", optimizer="muon", schedule="wsd", preset="multi30k", batch_tokens=2000)
    assert (config["model"]["d_ff"], config["model"]["attention_dropout"]) == (1024, 0.0)
    config = trained("classic", "--d-model", "32", "--n-heads", "2", "--n-layers", "1", "--recipe", "classic")
    settings = {k: config["args"][k] for k in ("recipe", "optimizer", "schedule", "preset", "lr")}
    assert settings == dict(recipe="classic", optimizer="adamw", schedule="inverse_sqrt", preset="small", lr=7e-4)
    assert config["model"]["d_ff"] == 512
    config = trained("lstm", "--arch", "lstm", "--hidden-size", "32", "--embedding-dim", "16")
    assert (config["args"]["recipe"], config["args"]["optimizer"], config["args"]["lr"]) == ("classic", "adamw", 1e-3)
