"""Preference pairs (qkv.tasks.preference): what is learnt of a pair, the prompt shared by its two answers, the
reference as the model with its adapters off, trl's DPOTrainer step for step, a clear preference learnt, and bad
lines as one line naming the line."""

import json

import pytest
import torch

from qkv.data import DataError
from qkv.lora import LoRAConfig, adapters_off, add_lora
from qkv.tasks.preference import PreferenceTask, answer_logps, collate_pairs, fitting_pairs, read_pairs

pytest.importorskip("transformers")
from finetune_model import PAIRS, chat_folder, preference_data

TRL_NAMES = {"dpo": "sigmoid"}  # trl's loss_type of an objective, where the name differs


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return chat_folder(tmp_path_factory.mktemp("preference") / "base")


def _load(base):
    from qkv.interop import load_pretrained

    return load_pretrained(base)


def _pairs(pre, path, context=64):
    return read_pairs(path, pre.tokenizer, pre.chat_template, context=context)


def _adapted(pre, seed=0, rank=4):
    """The model with adapters whose update is not zero (as after some training)."""
    torch.manual_seed(seed)
    add_lora(pre.model, LoRAConfig(rank=rank, alpha=8))
    with torch.no_grad():
        for name, p in pre.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    return pre.model


def test_a_pair_learns_its_answers_and_its_end_and_shares_its_prompt(base, tmp_path):
    pre = _load(base)
    for chat in (True, False):
        pairs = _pairs(pre, preference_data(tmp_path / f"{chat}.jsonl", 4, chat=chat))
        for pair in pairs:
            for example in (pair.chosen, pair.rejected):
                learnt = [i for i, keep in zip(example.ids, example.learn, strict=True) if keep]
                assert learnt[-1] == pre.tokenizer.eos_id and not any(example.learn[: pair.prompt])
            assert pair.chosen.ids[: pair.prompt] == pair.rejected.ids[: pair.prompt]
        text = pre.tokenizer.decode([i for i, k in zip(pairs[0].chosen.ids, pairs[0].chosen.learn, strict=True) if k])
        assert "le chat" in text
        for pair in pairs:  # the prompt computed once a pair (and answers that begin alike, their beginning)
            shared, apart = (collate_pairs([[(0, pair)]], pad_id=0, share=share).packed for share in (True, False))
            assert apart.real.numel() == pair.tokens and shared.real.numel() <= pair.tokens - pair.prompt


def test_with_the_adapters_off_the_reference_is_the_base_exactly(base, tmp_path):
    plain = _load(base).model.eval()
    pre = _load(base)
    adapted = _adapted(pre).eval()
    pairs = _pairs(pre, preference_data(tmp_path / "p.jsonl", 6))
    batch = collate_pairs([[(i, p)] for i, p in enumerate(pairs)], pad_id=0)
    with torch.no_grad():
        expected, _ = answer_logps(plain, batch)
        with adapters_off(adapted):
            off, _ = answer_logps(adapted, batch)
        on, _ = answer_logps(adapted, batch)
    assert torch.equal(off.chosen, expected.chosen) and torch.equal(off.rejected, expected.rejected)
    assert not torch.allclose(on.chosen, expected.chosen)  # the adapters are back on after


def _task(pre, pairs, objective="dpo", share=True, **options):
    options.setdefault("reference", None if objective in ("simpo", "orpo") else "adapters")
    return PreferenceTask(pre.model, pre.tokenizer, pairs, pairs[:2], objective=objective, beta=0.1, context=64,
                          batch_size=8, packed=False, share=share, **options)


@pytest.mark.parametrize("objective", ["dpo", "orpo"])
def test_a_shared_prompt_gives_the_gradients_of_computing_it_twice(base, tmp_path, objective):
    grads, losses = {}, {}
    for share in (True, False):
        pre = _load(base)
        _adapted(pre)
        pairs = _pairs(pre, preference_data(tmp_path / "p.jsonl", 6))
        task = _task(pre, pairs, objective, share=share)
        batch = task.batches(0)[0]
        loss, n = task.loss(pre.model, batch)
        loss.backward()
        losses[share] = loss.item() / n
        grads[share] = {k: p.grad.clone() for k, p in pre.model.named_parameters() if p.grad is not None}
    assert losses[True] == pytest.approx(losses[False], rel=1e-6)
    assert grads[True].keys() == grads[False].keys() and grads[True]
    for key, grad in grads[True].items():
        torch.testing.assert_close(grad, grads[False][key], rtol=1e-4, atol=1e-6)


def test_activation_checkpointing_gives_the_same_loss_and_gradients(base, tmp_path):
    grads = {}
    for checkpointing in (False, True):
        pre = _load(base)
        _adapted(pre)
        pre.model.train().checkpointing = checkpointing
        task = _task(pre, _pairs(pre, preference_data(tmp_path / "p.jsonl", 6)))
        loss, _ = task.loss(pre.model, task.batches(0)[0])
        loss.backward()
        grads[checkpointing] = [p.grad for p in pre.model.parameters() if p.grad is not None]
    assert grads[True] and len(grads[True]) == len(grads[False])
    for a, b in zip(grads[True], grads[False], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_precomputed_reference_is_the_adapters_off_one_and_is_read_back(base, tmp_path):
    pre = _load(base)
    _adapted(pre)
    pairs = _pairs(pre, preference_data(tmp_path / "p.jsonl", 6))
    store = tmp_path / "ref.safetensors"
    live, kept = _task(pre, pairs), _task(pre, pairs, reference="precomputed", store=store)
    batch = live.batches(0)[0]
    with torch.no_grad():
        a, b = live.losses(pre.model, batch)[0], kept.losses(pre.model, batch)[0]
    torch.testing.assert_close(a.losses, b.losses, rtol=0, atol=1e-12)
    assert store.is_file()
    with torch.no_grad():
        for p in pre.model.parameters():
            p.add_(1.0)  # a changed model: a resumed run's table must come from the file, not from it
    again = _task(pre, pairs, reference="precomputed", store=store)
    for split, table in kept._table().items():
        assert all(torch.equal(getattr(again._table()[split], f), getattr(table, f)) for f in ("chosen", "rejected"))
    fewer = PreferenceTask(pre.model, pre.tokenizer, pairs[:4], pairs[:2], objective="dpo", beta=0.1,
                           reference="precomputed", store=store, context=64, batch_size=8)
    with pytest.raises(DataError, match="the data changed"):
        fewer.losses(pre.model, fewer.batches(0)[0])


@pytest.mark.parametrize("objective", ["dpo", "ipo", "hinge"])
def test_the_first_steps_are_trls_dpo_trainers(base, tmp_path, objective):
    """trl's DPOTrainer with peft LoRA and qkv's task from the same initial adapter, on the very token ids trl makes
    of the pairs, the same four pairs every step: the same losses step for step."""
    pytest.importorskip("trl")
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    from qkv.adapters import load_peft_adapter
    from qkv.tasks.finetune import Example
    from qkv.tasks.preference import Pair

    rows = [json.loads(line) for line in preference_data(tmp_path / "t.jsonl", 4, chat=False).read_text().split("\n")
            if line]
    torch.manual_seed(0)
    config = DPOConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=4, max_steps=3, logging_steps=1,
                       learning_rate=5e-3, beta=0.1, loss_type=[TRL_NAMES.get(objective, objective)], report_to=[],
                       save_strategy="no", use_cpu=True, lr_scheduler_type="constant", max_length=None, seed=0,
                       warmup_steps=0, disable_tqdm=True, bf16=False)  # fp32, as qkv here (trl: bf16 by default)
    trainer = DPOTrainer(model=AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), args=config,
                         train_dataset=Dataset.from_list(rows), processing_class=AutoTokenizer.from_pretrained(base),
                         peft_config=LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    trainer.model.save_pretrained(tmp_path / "initial")  # the adapter before any step: qkv starts from it
    trainer.train()
    theirs = [h["loss"] for h in trainer.state.log_history if "loss" in h]

    def example(prompt, answer):
        return Example(prompt + answer, [False] * len(prompt) + [True] * len(answer))

    pairs = [Pair(example(r["prompt_ids"], r["chosen_ids"]), example(r["prompt_ids"], r["rejected_ids"]),
                  len(r["prompt_ids"])) for r in trainer.train_dataset]
    pre = _load(base)
    load_peft_adapter(pre.model, tmp_path / "initial")
    task = PreferenceTask(pre.model, pre.tokenizer, pairs, pairs, objective=objective, beta=0.1, reference="adapters",
                          context=64, batch_size=4, packed=False)
    params = [p for p in pre.model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=5e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    ours = []
    for _ in range(3):
        loss, n = task.loss(pre.model, task.batches(0)[0])
        (loss / n).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)  # trl's max_grad_norm
        opt.step()
        opt.zero_grad()
        ours.append(loss.item() / n)
    assert ours == pytest.approx(theirs, rel=1e-3), (ours, theirs)  # float32 sums in another order


def test_a_clear_preference_is_learnt_and_the_chosen_answers_stay_likely(base, tmp_path):
    """Chosen always the right translation: held-out pairs (each prompt against wrong answers not trained on)
    prefer it after 40 steps, and the chosen answers' cross-entropy does not rise (bound: 5%)."""
    pre = _load(base)
    add_lora(pre.model, LoRAConfig(rank=8, alpha=16))

    def lines(wrong_offsets):
        return [json.dumps({"prompt": [{"role": "user", "content": f"Translate to French: {en}"}],
                            "chosen": [{"role": "assistant", "content": fr}],
                            "rejected": [{"role": "assistant", "content": PAIRS[(i + k) % len(PAIRS)][1]}]})
                for i, (en, fr) in enumerate(PAIRS) for k in wrong_offsets]

    (tmp_path / "train.jsonl").write_text("\n".join(lines([1, 2, 3])) + "\n")
    (tmp_path / "valid.jsonl").write_text("\n".join(lines([4, 5, 6, 7])) + "\n")
    train, valid = (_pairs(pre, tmp_path / f"{n}.jsonl") for n in ("train", "valid"))
    task = PreferenceTask(pre.model, pre.tokenizer, train, valid, objective="dpo", beta=0.1, reference="adapters",
                          context=64, batch_size=8, seed=0)
    pre.model.eval()
    with torch.no_grad():
        before = task.evaluate(pre.model)
    params = [p for p in pre.model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2)
    pre.model.train()
    for step in range(40):
        for batch in task.batches(step):
            loss, n = task.loss(pre.model, batch)
            (loss / n).backward()
            opt.step()
            opt.zero_grad()
    pre.model.eval()
    with torch.no_grad():
        after = task.evaluate(pre.model)
    assert before["val_rewards/accuracies"] < 0.6  # the adapters start as the base: no preference yet
    assert after["val_rewards/accuracies"] > 0.9 and after["val_loss"] < 0.8 * before["val_loss"]
    assert after["val_chosen_loss"] <= 1.05 * before["val_chosen_loss"]


@pytest.mark.parametrize(("line", "phrases"), [
    ('{"prompt": "a", "chosen": "", "rejected": "b"}', ["line 3", "the chosen answer is empty"]),
    ('{"prompt": "a", "chosen": "b", "rejected": "  "}', ["line 3", "the rejected answer is empty"]),
    ('{"prompt": "a", "chosen": "b", "rejected": "b"}', ["line 3", "the same"]),
    ('{"prompt": "a", "chosen": "b"}', ["line 3", "missing 'rejected'"]),
    ('["a", "b", "c"]', ["line 3", "missing 'prompt', 'chosen', 'rejected'"]),
    ('{"prompt": "a", "chosen": [{"role": "assistant", "content": "b"}], "rejected": "c"}',
     ["line 3", "all be texts or all be lists"]),
    ('{"prompt": "' + "long " * 80 + '", "chosen": "b", "rejected": "c"}',
     ["line 3", "the prompt is", "context of 64"]),
    ("{oops", ["line 3 is not valid JSON"]),
])
def test_a_bad_line_is_one_error_naming_it(base, tmp_path, line, phrases):
    pre = _load(base)
    path = preference_data(tmp_path / "p.jsonl", 2, chat=False)
    path.write_text(path.read_text() + line + "\n")
    with pytest.raises(DataError) as err:
        _pairs(pre, path)
    message = str(err.value)
    assert "\n" not in message and all(p in message for p in phrases), message


def test_pairs_too_long_for_the_context_are_dropped_and_counted(base, tmp_path, caplog):
    pre = _load(base)
    pairs = _pairs(pre, preference_data(tmp_path / "p.jsonl", 4, chat=False))
    longest = max(max(len(p.chosen.ids), len(p.rejected.ids)) for p in pairs)
    with caplog.at_level("WARNING"):
        kept = fitting_pairs(pairs, longest - 1, "p.jsonl")
    assert 0 < len(kept) < len(pairs) and "pairs dropped" in caplog.text
    with pytest.raises(DataError, match="every pair's prompt and answer are longer"):
        fitting_pairs(pairs, 3, "p.jsonl")
