"""The commands with the new families, end to end as a user runs them: ``qkv generate`` of a Gemma 3 folder and of a
Qwen3-MoE folder writes transformers' greedy tokens, ``qkv chat`` lays the turns out with Gemma's own template, ``qkv
serve`` decodes the rows of a mixture of experts in one batch as each alone, ``qkv finetune`` adapts a Phi-3 (its
fused layers, one adapter each), a Gemma 3 and a Qwen3-MoE on their 4-bit weights, and what they write runs in peft
and transformers."""

from __future__ import annotations

import json

import pytest
import torch
from clitools import ok, qkv
from family_models import family_model, train_sentencepiece
from test_chat import GEMMA3

transformers = pytest.importorskip("transformers")
pytest.importorskip("google.protobuf", reason="transformers reads SentencePiece models with protobuf")

PAIRS = [("the cat", "le chat"), ("the dog", "le chien"), ("a house", "une maison"), ("the sea", "la mer")]
SMALL = ["--context", "64", "--batch-size", "4", "--lr", "1e-2", "--no-progress", "--device", "cpu",
         "--precision", "fp32", "--eval-every", "2", "--rank", "4"]


def _folder(path, kind: str, spm):
    """A family's folder with a SentencePiece tokenizer and Gemma's chat template, as transformers writes it."""
    path.mkdir()
    family_model(transformers, kind, vocab=384).save_pretrained(path)
    (path / "tokenizer.model").write_bytes(spm.read_bytes())
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "GemmaTokenizer", "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>",
        "additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"]}))
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = GEMMA3
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    spm = train_sentencepiece(root / "spm.model", dummy_prefix=False)
    for kind in ("gemma3_text", "phi3", "qwen3_moe"):
        _folder(root / kind, kind, spm)
    lines = [json.dumps({"messages": [{"role": "user", "content": f"Translate to French: {en}"},
                                      {"role": "assistant", "content": fr}]}) for en, fr in PAIRS * 4]
    (root / "train.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return root


@pytest.mark.parametrize(("kind", "prompt"), [("gemma3_text", "the cat sat"), ("qwen3_moe", "une maison")])
def test_generate_writes_the_greedy_tokens_transformers_writes(work, kind, prompt):
    """(A random model writes byte tokens that are no whole character: transformers decodes each such run to U+FFFD,
    and qkv's streamed text holds back the last run, which the next token could still complete.)"""
    done = ok(qkv("generate", "--pretrained", kind, "--prompt", prompt, "--max-new-tokens", "6", cwd=work))
    tokenizer = transformers.AutoTokenizer.from_pretrained(work / kind)
    hf = transformers.AutoModelForCausalLM.from_pretrained(work / kind).eval()
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = hf.generate(ids, max_new_tokens=6, do_sample=False, min_new_tokens=6)
    expected = tokenizer.decode(out[0, ids.size(1):], skip_special_tokens=True)
    assert done.stdout.rstrip("\n") == prompt + expected.removesuffix("\ufffd")


def _transformers_reply(folder, turn: str, new: int) -> str:
    """transformers' greedy reply to one user turn, laid out by its apply_chat_template, cut at qkv's stop tokens."""
    from qkv.interop import load_pretrained

    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": turn}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True).input_ids
    assert tokenizer.decode(ids[0]).endswith("<start_of_turn>model\n")
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        out = hf.generate(ids, max_new_tokens=new, do_sample=False, min_new_tokens=new)[0, ids.size(1):].tolist()
    stops = load_pretrained(folder).tokenizer.stop_ids
    return tokenizer.decode(out[: next((i for i, t in enumerate(out) if t in stops), len(out))],
                            skip_special_tokens=True)


def test_chat_lays_the_turns_out_with_gemmas_template(work):
    """The reply is transformers' greedy continuation of the prompt its apply_chat_template makes of the turn."""
    turn = "Translate to French: the sea"
    done = ok(qkv("chat", "--pretrained", "gemma3_text", "--max-new-tokens", "4", cwd=work, input=turn + "\n"))
    assert done.stdout == _transformers_reply(work / "gemma3_text", turn, 4) + "\n"


def test_serve_answers_an_openai_client_as_transformers_does(work):
    """qkv serve with a Gemma 3: a greedy chat reply to the official client is transformers' reply."""
    openai = pytest.importorskip("openai")
    pytest.importorskip("uvicorn")
    from live_server import HANG, live

    from qkv.interop import load_pretrained
    from qkv.serve.app import Server
    from qkv.serve.engine import Engine

    pre = load_pretrained(work / "gemma3_text")
    engine = Engine(pre.model, pre.tokenizer, name="gemma", stop_ids=set(pre.tokenizer.stop_ids),
                    chat_template=pre.chat_template)
    turn = "Translate to French: the cat"
    with live(Server(engine)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=HANG)
        reply = client.chat.completions.create(model="gemma", messages=[{"role": "user", "content": turn}],
                                               temperature=0, max_tokens=4)
    assert reply.choices[0].message.content == _transformers_reply(work / "gemma3_text", turn, 4).strip()


def test_serve_decodes_a_mixture_of_experts_rows_in_one_batch_as_each_alone(work, monkeypatch):
    """Each row of a decoding step goes to its own experts: four prompts at once, each answer the one it gets
    alone."""
    import threading

    openai = pytest.importorskip("openai")
    pytest.importorskip("uvicorn")
    from live_server import HANG, live

    from qkv.interop import load_pretrained
    from qkv.serve.app import Server
    from qkv.serve.engine import Engine

    pre = load_pretrained(work / "qwen3_moe")
    engine = Engine(pre.model, pre.tokenizer, name="moe", stop_ids=set(), chat_template=None)
    prompts = ["the cat sat", "a house by the sea", "the dog", "une maison"]
    sizes, step = [], engine.batch.step
    monkeypatch.setattr(engine.batch, "step", lambda: sizes.append(len(engine.batch)) or step())
    together = [None] * len(prompts)
    with live(Server(engine)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=HANG)

        def ask(i):
            return client.completions.create(model="moe", prompt=prompts[i], max_tokens=6, temperature=0,
                                             logprobs=1).choices[0]

        def ask_into(i):
            together[i] = ask(i)

        threads = [threading.Thread(target=ask_into, args=(i,)) for i in range(len(prompts))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(HANG)
        monkeypatch.undo()
        alone = [ask(i) for i in range(len(prompts))]
    assert max(sizes) > 1  # decoded together
    for a, b in zip(together, alone, strict=True):  # the same tokens (by their log-probabilities) and text
        assert (a.text, a.logprobs.token_logprobs) == (b.text, pytest.approx(b.logprobs.token_logprobs, abs=1e-5))


def test_a_phi3_lora_run_adapts_its_fused_layers_and_runs_in_peft(work):
    peft = pytest.importorskip("peft")
    from qkv.trained import load_trained

    ok(qkv("finetune", "--pretrained", "phi3", "--data", "train.jsonl", "--out", "phi3-lora", "--max-steps", "2",
           *SMALL, cwd=work))
    adapter = work / "phi3-lora" / "best" / "adapter"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert sorted(config["target_modules"]) == ["down_proj", "gate_up_proj", "o_proj", "qkv_proj"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(work / "phi3").eval()
    theirs = peft.PeftModel.from_pretrained(hf, adapter).eval()
    ids = torch.tensor([[2, 40, 41, 90, 91, 200]])
    with torch.no_grad():
        torch.testing.assert_close(theirs(ids).logits, load_trained(work / "phi3-lora").model(ids),
                                   atol=1e-4, rtol=1e-4)


def test_qlora_adapts_a_gemma3_on_its_4_bit_weights_and_the_merge_is_a_gemma3(work):
    ok(qkv("finetune", "--pretrained", "gemma3_text", "--data", "train.jsonl", "--out", "gemma-qlora", "--method",
           "qlora", "--max-steps", "2", *SMALL, cwd=work))
    meta = json.loads((work / "gemma-qlora" / "best" / "config.json").read_text())
    assert meta["base"]["weights"] == "int4"
    ok(qkv("export", "--model", "gemma-qlora", "--merge", "--out", "merged", cwd=work))
    merged = transformers.AutoModelForCausalLM.from_pretrained(work / "merged").eval()
    assert type(merged).__name__ == "Gemma3ForCausalLM"


def test_qlora_adapts_a_mixture_of_experts_on_its_4_bit_experts_and_the_merge_is_one(work):
    """QLoRA on a Qwen3-MoE: attention adapted, the experts frozen in int4; the merge is a Qwen3-MoE folder that
    transformers reads into the model qkv reads from it."""
    from qkv.interop import load_pretrained
    from qkv.nn import LoRALinear
    from qkv.trained import load_trained

    ok(qkv("finetune", "--pretrained", "qwen3_moe", "--data", "train.jsonl", "--out", "moe-qlora", "--method",
           "qlora", "--max-steps", "2", *SMALL, cwd=work))
    run = load_trained(work / "moe-qlora").model
    adapted = {name.split(".")[-1] for name, m in run.named_modules() if isinstance(m, LoRALinear)}
    assert adapted and "experts" not in " ".join(n for n, m in run.named_modules() if isinstance(m, LoRALinear))
    ok(qkv("export", "--model", "moe-qlora", "--merge", "--out", "moe-merged", cwd=work))
    merged = transformers.AutoModelForCausalLM.from_pretrained(work / "moe-merged").eval()
    assert type(merged).__name__ == "Qwen3MoeForCausalLM"
    ids = torch.tensor([[2, 40, 41, 90, 91, 200]])
    with torch.no_grad():
        torch.testing.assert_close(load_pretrained(work / "moe-merged").model(ids), merged(ids).logits, atol=1e-4,
                                   rtol=1e-4)
