"""The closing line of ``qkv generate`` and ``qkv chat`` on stderr: the prompt's and the generated tokens, their
tokens/s, and why generation stopped; stdout stays what the commands printed before they had the line. The token
counts and stdout expected are computed with the library (qkv.tasks.language_model.complete), not with the CLI."""

import math
import re
from collections import Counter
from pathlib import Path

import pytest
from clitools import ok, qkv

pytestmark = pytest.mark.slow

GPT = Path(__file__).parent / "fixtures" / "checkpoints" / "gpt"  # character-level; greedy "the " -> "'''mmm..."
LINE = re.compile(r"qkv: prompt (\d+) tokens?(?: \((\d+) prompts\))? at ([^ ]+) tokens/s; "
                  r"generated (\d+) tokens?(?: at ([^ ]+) tokens/s)?; stopped: (.+)")
LIMIT, CUT = "--max-new-tokens reached", "--max-new-tokens reached, the reply is cut off"


def closing(line: str) -> tuple[int, int, str]:
    """(prompt tokens, generated tokens, why it stopped) of a closing line; each rate in it a positive finite
    number, the decoding's there whenever a row has tokens after its first."""
    m = LINE.fullmatch(line)
    assert m, line
    rates = [float(m[3])] + ([float(m[5])] if m[5] else [])
    assert all(math.isfinite(r) and r > 0 for r in rates), line
    return int(m[1]), int(m[4]), m[6]


def streamed(model, tokenizer, prompts: list[str], **kwargs) -> tuple[int, list[int], list[str]]:
    """The prompts' tokens, each row's streamed tokens and the continuations, as the library gives them."""
    from qkv.tasks.language_model import complete
    from qkv.tokenizers import encode_prompt

    rows = Counter()
    texts = complete(model, tokenizer, prompts, on_token=lambda row, _: rows.update([row]), **kwargs)
    return sum(len(encode_prompt(tokenizer, p)) for p in prompts), [rows[i] for i in range(len(prompts))], texts


def generated(prompts: list[str], max_new_tokens: int, stop: str | None = None) -> tuple[int, list[int], str]:
    """The fixture model, greedy: the prompts' tokens, each row's streamed tokens, and stdout as generate printed
    it before the closing line (the prompts and continuations, 40 dashes between rows)."""
    from qkv.checkpoint import load_checkpoint

    ckpt = load_checkpoint(GPT)
    tokenizer = ckpt.tokenizers["text"]
    stops = set(tokenizer.encode(stop)) if stop else set()
    n, rows, texts = streamed(ckpt.model, tokenizer, prompts, max_new_tokens=max_new_tokens, stop_ids=stops)
    return n, rows, ("-" * 40 + "\n").join(p + t + "\n" for p, t in zip(prompts, texts, strict=True))


def test_generate_ends_with_a_line_saying_the_budget_ran_out(tmp_path):
    n, rows, stdout = generated(["the "], 30)
    proc = ok(qkv("generate", "--model", GPT, "--prompt", "the ", "--max-new-tokens", "30", cwd=tmp_path))
    assert proc.stdout == stdout
    assert rows == [30] and closing(proc.stderr.splitlines()[-1]) == (n, 30, LIMIT)
    assert sum("qkv: prompt" in line for line in proc.stderr.splitlines()) == 1


@pytest.mark.parametrize("streams", [True, False])
def test_generate_says_a_stop_text_ended_it(tmp_path, here, streams):
    n, rows, stdout = generated(["the "], 30, stop="m")
    assert 0 < rows[0] < 30  # the fixture's greedy continuation meets an "m" early
    proc = ok(here("generate", "--model", GPT, "--prompt", "the ", "--max-new-tokens", "30", "--stop", "m",
                   *([] if streams else ["--no-stream"]), cwd=tmp_path))
    assert proc.stdout == stdout
    assert closing(proc.stderr.splitlines()[-1]) == (n, rows[0], "--stop text")


@pytest.mark.parametrize(("budget", "why"), [(4, "--stop text"), (3, LIMIT)])
def test_a_stop_on_the_last_step_is_a_stop_and_one_after_it_is_the_budget(tmp_path, here, budget, why):
    """Greedy "the " continues with three tokens, then "m": with 4 tokens allowed the 4th is the stop; with 3 the
    budget ends first."""
    n, rows, stdout = generated(["the "], budget, stop="m")
    assert rows == [3]
    proc = ok(here("generate", "--model", GPT, "--prompt", "the ", "--max-new-tokens", budget, "--stop", "m",
                   cwd=tmp_path))
    assert proc.stdout == stdout and closing(proc.stderr.splitlines()[-1]) == (n, 3, why)


def test_generate_counts_every_row_of_a_batch(tmp_path, here):
    n, rows, stdout = generated(["the ", "A"], 20, stop="m")
    assert sorted(rows) == [rows[0], 20] and rows[0] < 20  # one row stops on "m", the other runs out
    proc = ok(here("generate", "--model", GPT, "--prompt", "the ", "--prompt", "A", "--max-new-tokens", "20",
                   "--stop", "m", cwd=tmp_path))
    assert proc.stdout == stdout
    line = proc.stderr.splitlines()[-1]
    prompt, tokens, stopped = closing(line)
    assert (prompt, tokens) == (n, sum(rows)) and "(2 prompts)" in line
    assert sorted(stopped.split(", ")) == sorted([f"{LIMIT} (1 of 2)", "--stop text (1 of 2)"])


def test_generate_with_beams_says_how_long_the_search_took(tmp_path, here):
    proc = ok(here("generate", "--model", GPT, "--prompt", "the ", "--beam", "2", "--stop", "m", cwd=tmp_path))
    assert re.fullmatch(r"qkv: prompt 4 tokens; beam search of 2 beams took \d+\.\d\d s", proc.stderr.splitlines()[-1])
    assert "qkv:" not in proc.stdout


def chatted(folder: Path, turns: list[str], max_new_tokens: int, stop: str | None = None):
    """Per turn, the tokens of the conversation laid out so far, the reply's streamed tokens; and stdout as chat
    printed it before the closing lines (each reply and a newline)."""
    from qkv.chat import render_chat, template_tokens
    from qkv.interop import load_pretrained

    pre = load_pretrained(folder, weights="none")
    stops = set(pre.tokenizer.stop_ids) | (set(pre.tokenizer.encode(stop)) if stop else set())
    messages, counts, stdout = [], [], ""
    for turn in turns:
        messages.append({"role": "user", "content": turn})
        prompt = render_chat(pre.chat_template, messages, **template_tokens(pre.tokenizer))
        n, rows, (reply,) = streamed(pre.model, pre.tokenizer, [prompt], max_new_tokens=max_new_tokens,
                                     stop_ids=stops)
        counts.append((n, rows[0]))
        stdout += reply + "\n"
        messages.append({"role": "assistant", "content": reply.strip()})
    return counts, stdout


@pytest.mark.parametrize("stop", [None, "\n"])
def test_chat_closes_each_reply_with_a_line_and_marks_a_cut_off_one(tmp_path, here, stop):
    """Two turns on stdin: one line each on stderr. The tiny random model answers in newlines: cut off by the budget,
    or, with --stop '\\n', stopped at once (the chat model's end tokens can stop it too: the line names both)."""
    pytest.importorskip("transformers")
    from finetune_model import chat_folder

    folder = chat_folder(tmp_path / "chat")
    turns = ["Translate to French: the cat", "and the dog?"]
    counts, stdout = chatted(folder, turns, 4, stop=stop)
    proc = ok(here("chat", "--pretrained", folder, "--max-new-tokens", "4", *(["--stop", "\\n"] if stop else []),
                   cwd=tmp_path, input="\n".join(turns) + "\n"))
    assert proc.stdout == stdout
    lines = [line for line in proc.stderr.splitlines() if line.startswith("qkv: prompt")]
    want = CUT if stop is None else "end-of-sequence token or --stop text"
    assert [closing(line) for line in lines] == [(n, k, want) for n, k in counts]
    assert [k for _, k in counts] == ([4, 4] if stop is None else [0, 0])
