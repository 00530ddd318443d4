"""Loading weights from other formats into qkv models (Hugging Face GPT-2, LLaMA-style decoders, BERT)."""

from .huggingface import (
    bert_config_from_hf,
    bert_state_dict_from_hf,
    gpt_config_from_hf,
    gpt_state_dict_from_hf,
    load_bert_from_hf,
    load_gpt_from_hf,
)

__all__ = [
    "bert_config_from_hf",
    "bert_state_dict_from_hf",
    "gpt_config_from_hf",
    "gpt_state_dict_from_hf",
    "load_bert_from_hf",
    "load_gpt_from_hf",
]
