"""Without the shared corpora (a clone outside this setup) the tests that read them are skipped, each with one
reason that says what is missing, where, and where docs/testing.md says to fetch it: never an error."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from clitools import ENV, HANG
from shared_data import CORPORA, missing_corpora

ROOT = Path(__file__).resolve().parents[1]


def test_the_reason_names_the_folder_the_missing_files_and_the_docs_that_say_where_to_get_them(tmp_path):
    reason = missing_corpora(tmp_path)
    assert str(tmp_path) in reason and "multi30k/train.de.gz" in reason and f"and {len(CORPORA) - 3} more" in reason
    assert "docs/testing.md#the-shared-corpora" in reason and "QKV_DATA" in reason
    docs = (ROOT / "docs" / "testing.md").read_text(encoding="utf-8")
    assert "## The shared corpora" in docs and all(Path(name).parts[0] in docs for name in CORPORA)
    for name in CORPORA:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(b"")
    assert missing_corpora(tmp_path) is None


@pytest.mark.slow
def test_the_tests_that_read_the_corpora_are_skipped_with_that_reason_when_they_are_absent(tmp_path):
    """QKV_DATA at an empty folder: those tests skip with the one reason, the others pass."""
    files = ["tests/test_cli_bert.py", "tests/test_data.py::test_read_parallel_real_corpora",
             "tests/test_tokenizers.py::test_bpe_special_ids"]
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "0", "-q", "-rs", *files],
                          cwd=ROOT, env={**ENV, "QKV_DATA": str(tmp_path)}, capture_output=True, text=True,
                          timeout=HANG)
    assert proc.returncode == 0, proc.stdout[-3000:]  # no test failed or ended in an error
    assert re.search(r"\d+ skipped", proc.stdout.strip().splitlines()[-1])
    reasons = {line.split(": ", 1)[1] for line in proc.stdout.splitlines() if line.startswith("SKIPPED")}
    assert reasons == {missing_corpora(tmp_path)}, reasons
    assert os.listdir(tmp_path) == []
