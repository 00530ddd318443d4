"""Loading weights from other formats into qkv models: Hugging Face GPT-2, LLaMA-style decoders and BERT;
GGUF files; pretrained language models with their tokenizers (:func:`load_pretrained`); and sentence encoders
such as all-MiniLM-L6-v2 (:func:`load_sentence_encoder`)."""

from .gguf import (
    GGUFContents,
    hf_config_from_gguf,
    hf_state_dict_from_gguf,
    load_gpt_from_gguf,
    read_gguf,
    unpermute_rope_rows,
)
from .huggingface import (
    bert_config_from_hf,
    bert_state_dict_from_hf,
    gpt_config_from_hf,
    gpt_state_dict_from_hf,
    load_bert_from_hf,
    load_gpt_from_hf,
)
from .pretrained import Pretrained, chat_prompt, load_pretrained, smollm2_path
from .sentence import SentenceEncoder, load_sentence_encoder, minilm_path

__all__ = [
    "GGUFContents",
    "Pretrained",
    "SentenceEncoder",
    "bert_config_from_hf",
    "bert_state_dict_from_hf",
    "chat_prompt",
    "gpt_config_from_hf",
    "gpt_state_dict_from_hf",
    "hf_config_from_gguf",
    "hf_state_dict_from_gguf",
    "load_bert_from_hf",
    "load_gpt_from_gguf",
    "load_gpt_from_hf",
    "load_pretrained",
    "load_sentence_encoder",
    "minilm_path",
    "read_gguf",
    "smollm2_path",
    "unpermute_rope_rows",
]
