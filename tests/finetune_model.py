"""A tiny LLaMA-family chat model as a Hugging Face folder (random weights, a byte-level BPE trained here, a ChatML
template), and chat examples for it: what the fine-tuning tests adapt."""

from __future__ import annotations

import json
from pathlib import Path

import torch

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>' + '\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
PAIRS = [("the cat", "le chat"), ("the dog", "le chien"), ("a house", "une maison"), ("the sea", "la mer"),
         ("a tree", "un arbre"), ("the sun", "le soleil"), ("a book", "un livre"), ("the moon", "la lune")]


def tokenizer(transformers):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([f"Translate to French: {en}. {fr}" for en, fr in PAIRS] * 5, trainer=trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>",
                                                eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHATML
    return fast


def chat_folder(path: Path, *, seed: int = 0, hidden: int = 64) -> Path:
    """The folder, written by transformers itself."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=320, hidden_size=hidden, num_attention_heads=4, num_key_value_heads=2,
                                      num_hidden_layers=2, intermediate_size=2 * hidden, max_position_embeddings=128,
                                      tie_word_embeddings=True)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    tokenizer(transformers).save_pretrained(path)
    return path


def chat_data(path: Path, n: int = len(PAIRS)) -> Path:
    """JSONL chat examples: "Translate to French: X" answered by the translation."""
    lines = [json.dumps({"messages": [{"role": "user", "content": f"Translate to French: {en}"},
                                      {"role": "assistant", "content": fr}]})
             for en, fr in (PAIRS * (1 + n // len(PAIRS)))[:n]]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def preference_data(path: Path, n: int = len(PAIRS), *, chat: bool = True) -> Path:
    """JSONL preference pairs: "Translate to French: X", the translation chosen, another word's rejected; as chat
    messages, or as text (``chat=False``)."""
    lines = []
    for i in range(n):
        (en, fr), (_, wrong) = PAIRS[i % len(PAIRS)], PAIRS[(i + 1 + i // len(PAIRS)) % len(PAIRS)]
        prompt = f"Translate to French: {en}"
        if chat:
            lines.append(json.dumps({"prompt": [{"role": "user", "content": prompt}],
                                     "chosen": [{"role": "assistant", "content": fr}],
                                     "rejected": [{"role": "assistant", "content": wrong}]}))
        else:
            lines.append(json.dumps({"prompt": prompt + ".", "chosen": " " + fr, "rejected": " " + wrong}))
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def workspace(root: Path, examples: int) -> Path:
    """``root`` with the chat model in ``base/`` and ``examples`` chats in ``train.jsonl``."""
    chat_folder(root / "base")
    chat_data(root / "train.jsonl", examples)
    return root
