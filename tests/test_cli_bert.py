"""``qkv embed / search / similarity / classify`` and ``qkv train mlm / classify`` end to end in subprocesses, on
slices of the shared corpora; and the mistakes users make, each ending in one line on stderr."""

import gzip
import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
from clitools import DATA, PNG_MAGIC, ok, one_line_error, qkv

from qkv.interop.sentence import MINILM_INSTALL, minilm_path

pytestmark = pytest.mark.slow

TINY = ["--preset", "tiny", "--d-model", "32", "--n-heads", "2", "--n-layers", "1", "--max-length", "32",
        "--vocab-size", "500", "--batch-size", "8", "--eval-every", "3", "--warmup", "2", "--no-progress"]
needs_minilm = pytest.mark.skipif(minilm_path() is None, reason=f"all-MiniLM-L6-v2 is not installed: {MINILM_INSTALL}")


@pytest.fixture(scope="module")
def work(tmp_path_factory, shared_data) -> Path:
    root = tmp_path_factory.mktemp("bert")
    text = (DATA / "tinyshakespeare" / "input.txt").read_text(encoding="utf-8")[:20_000]
    (root / "shakespeare.txt").write_text(text, encoding="utf-8")
    # Two kinds of English: Tatoeba's conversational sentences and Multi30k's image captions.
    tatoeba = [line.split("\t")[0] for line in (DATA / "tatoeba-en-zh" / "cmn.txt").read_text("utf-8").splitlines()]
    captions = gzip.decompress((DATA / "multi30k" / "val.en.gz").read_bytes()).decode("utf-8").splitlines()
    r = random.Random(0)
    rows = [(t, "tatoeba") for t in r.sample(tatoeba, 100)] + [(c, "caption") for c in r.sample(captions, 100)]
    r.shuffle(rows)
    (root / "kinds.tsv").write_text("".join(f"{t}\t{k}\n" for t, k in rows), encoding="utf-8")
    return root


@pytest.fixture(scope="module")
def mlm_run(work) -> Path:
    ok(qkv("train", "mlm", "--text", "shakespeare.txt", "--out", "mlm", "--max-steps", "6", *TINY, cwd=work))
    return work / "mlm"


def test_train_mlm_writes_checkpoints_log_and_a_guess(work, mlm_run):
    assert (mlm_run / "best" / "model.safetensors").exists() and (mlm_run / "last" / "trainer_state.pt").exists()
    config = json.loads((mlm_run / "best" / "config.json").read_text())
    assert config["arch"] == "bert-mlm" and config["model"]["d_model"] == 32
    header, *rows = (mlm_run / "log.csv").read_text().splitlines()
    assert "val_accuracy" in header and any(r.startswith("6,") for r in rows)


def test_train_mlm_resumes_to_the_new_budget(here, work, mlm_run, tmp_path):
    run = tmp_path / "mlm"
    shutil.copytree(mlm_run, run)
    proc = ok(here("train", "mlm", "--out", run, "--resume", "--max-steps", "9", "--no-progress", cwd=work))
    assert "after 9 steps" in proc.stdout and "fill-mask:" in proc.stdout


def test_a_trained_bert_embeds_too(here, work, mlm_run):
    lines = ok(here("embed", "--model", mlm_run, "to be or not to be", "that is the question", cwd=work)).stdout
    rows = [json.loads(line) for line in lines.splitlines()]
    assert [r["text"] for r in rows] == ["to be or not to be", "that is the question"]
    assert len(rows[0]["embedding"]) == 32 and abs(np.linalg.norm(rows[0]["embedding"]) - 1) < 1e-5


def test_train_classify_then_classify(here, work):
    proc = ok(here("train", "classify", "--data", "kinds.tsv", "--out", "clf", "--max-steps", "6", *TINY, cwd=work))
    assert "val_accuracy" in proc.stdout
    out = ok(here("classify", "--model", "clf", "A dog runs on the beach.", "Where is the station?", cwd=work)).stdout
    labels = [line.split("\t") for line in out.splitlines()]
    assert len(labels) == 2 and all(label in ("caption", "tatoeba") and 0.5 <= float(p) <= 1 for label, p, _ in labels)


@needs_minilm
def test_embed_writes_npy_and_json_lines_from_arguments_files_and_stdin(work, here):
    """In this process, and from a pipe as a user starts it."""
    ok(here("embed", "The cat sits.", "Il pleut.", "--output", "v.npy", "--batch-size", "1", cwd=work))
    matrix = np.load(work / "v.npy")
    assert matrix.shape == (2, 384) and matrix.dtype == np.float32
    (work / "sentences.txt").write_text("The cat sits.\n\nIl pleut.\n", encoding="utf-8")
    ok(here("embed", "--input", "sentences.txt", "--output", "v.jsonl", cwd=work))
    rows = [json.loads(line) for line in (work / "v.jsonl").read_text().splitlines()]
    assert [r["text"] for r in rows] == ["The cat sits.", "Il pleut."]  # the blank line is skipped
    np.testing.assert_allclose(np.array([r["embedding"] for r in rows]), matrix, atol=1e-6)
    piped = ok(qkv("embed", cwd=work, input="Il pleut.\n")).stdout
    np.testing.assert_allclose(json.loads(piped)["embedding"], matrix[1], atol=1e-6)
    ok(here("embed", "The cat sits.", "Il pleut.", "--output", "v8.npy", "--quantize", "int8", cwd=work))
    eight = np.load(work / "v8.npy")  # calibrated int8 (outlier columns in fp32): near, not equal
    assert 0 < np.abs(eight @ eight.T - matrix @ matrix.T).max() < 0.01 and (eight * matrix).sum(1).min() > 0.99


@needs_minilm
def test_search_finds_the_line_itself_and_its_paraphrase(here, work):
    corpus = ["The weather is lovely today.", "He drove his car to the station.", "A man is playing the guitar.",
              "The weather is lovely today.", "Stocks fell sharply on Monday."]
    (work / "corpus.txt").write_text("\n".join(corpus) + "\n", encoding="utf-8")
    out = ok(here("search", "--corpus", "corpus.txt", "--top-k", "2", "A man is playing the guitar.",
                  "Someone plays an instrument", cwd=work)).stdout
    blocks = out.split("\n\n")
    assert blocks[0].splitlines()[0] == "query: A man is playing the guitar."
    score, _, line, *text = blocks[0].splitlines()[1].split()
    assert (score, line, " ".join(text)) == ("1.0000", "3", "A man is playing the guitar.")
    assert "guitar" in blocks[1].splitlines()[1]
    assert out.count("The weather is lovely today.") <= 2  # a repeated line is one passage


@needs_minilm
def test_similarity_and_an_attention_map(here, work):
    same = ok(here("similarity", "A cat.", "A cat.", cwd=work)).stdout.strip()
    assert same == "1.0000"
    near = float(ok(here("similarity", "A man is eating food.", "A man eats a piece of bread.", "--attention",
                         "att.png", "--layer", "0", "--head", "5", "--sentence", "1", cwd=work)).stdout)
    far = float(ok(here("similarity", "A man is eating food.", "Quantum chromodynamics", cwd=work)).stdout)
    assert near > 0.5 > far
    assert (work / "att.png").read_bytes().startswith(PNG_MAGIC)


@needs_minilm
def test_fine_tune_minilm_starts_from_its_weights(here, work):
    proc = ok(here("train", "classify", "--data", "kinds.tsv", "--init", "minilm", "--pooling", "mean", "--out",
                   "clf-minilm", "--max-steps", "3", "--eval-every", "3", "--batch-size", "8", "--max-length", "32",
                   "--no-progress", cwd=work))
    assert "step budget reached after 3 steps" in proc.stdout


def test_mistakes_end_in_one_line(work, mlm_run, tmp_path, here):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text(json.dumps({"model_type": "bert", "vocab_size": 10, "hidden_size": 8,
                                                    "num_attention_heads": 2, "num_hidden_layers": 1,
                                                    "intermediate_size": 16}))
    (broken / "model.safetensors").write_bytes(b"not safetensors")
    shutil.copy(mlm_run / "best" / "tokenizer.text.json", broken / "tokenizer.json")
    (work / "notabs.tsv").write_text("no tab on this line\n", encoding="utf-8")
    (work / "blank.txt").write_text("\n  \n", encoding="utf-8")
    one_line_error(here("embed", "--model", tmp_path / "nothing", "x", cwd=work), "nothing")
    one_line_error(here("embed", "--model", broken, "x", cwd=work), "tokenizer.json")
    one_line_error(here("embed", "--model", mlm_run, cwd=work, input=""), "nothing to embed")
    one_line_error(here("embed", "--model", mlm_run, "--input", "blank.txt", cwd=work), "nothing to embed")
    one_line_error(here("embed", "--model", mlm_run, "x", "--output", "v.txt", cwd=work), ".npy")
    one_line_error(here("embed", "--model", mlm_run, "x", "--attention", "a.png", "--layer", "5", cwd=work), "layer")
    one_line_error(here("embed", "--model", mlm_run, "x", "--attention", "a.png", "--sentence", "1", cwd=work),
                   "--sentence")
    one_line_error(here("search", "--model", mlm_run, "--corpus", "missing.txt", "q", cwd=work), "missing.txt")
    one_line_error(here("search", "--model", mlm_run, "--corpus", "blank.txt", "q", cwd=work), "no text to search")
    one_line_error(here("train", "mlm", "--out", tmp_path / "r", "--max-steps", "1", cwd=work), "--text")
    one_line_error(here("train", "classify", "--data", "notabs.tsv", "--out", tmp_path / "r", "--max-steps", "1",
                        cwd=work), "line 1 has no tab")
    one_line_error(here("train", "classify", "--data", "kinds.tsv", "--init", "minilm", "--preset", "mini", "--out",
                        tmp_path / "r", "--max-steps", "1", cwd=work), "--preset")
    one_line_error(here("train", "mlm", "--text", "shakespeare.txt", "--out", mlm_run, "--max-steps", "1", cwd=work),
                   "already holds a trained model")
    one_line_error(here("classify", "--model", mlm_run, "x", cwd=work), "not a classifier")
