"""Reading other projects' files into qkv models and tokenizers.

* :mod:`.hf_gpt`, :mod:`.hf_bert`: Hugging Face GPT-2 and LLaMA-style decoders, BERT encoders (state dicts
  and configs) -> :class:`~qkv.GPT`, :class:`~qkv.BERT`;
* :mod:`.hf_vit`, :mod:`.hf_swin`, :mod:`.hf_clip`: Hugging Face ViT, Swin and CLIP -> :class:`~qkv.ViT`,
  :class:`~qkv.Swin`, :class:`~qkv.CLIP` (and the classifiers);
* :mod:`.hf_common`: what those converters share (config fields, strict tensor-by-tensor reading);
* :mod:`.hf_folder`: the files of a Hugging Face model folder (config, safetensors weights, tokenizer);
* :mod:`.gguf`, :mod:`.gguf_tokenizer`: GGUF files (llama.cpp's format): weights and tokenizer;
* :mod:`.pretrained`: one door for pretrained language models with their tokenizers (:func:`load_pretrained`);
* :mod:`.sentence`: one door for sentence encoders such as all-MiniLM-L6-v2 (:func:`load_sentence_encoder`).
"""

from .gguf import (
    GGUFContents,
    hf_config_from_gguf,
    hf_state_dict_from_gguf,
    load_gpt_from_gguf,
    read_gguf,
    unpermute_rope_rows,
)
from .gguf_tokenizer import tokenizer_from_gguf
from .hf_bert import bert_config_from_hf, bert_state_dict_from_hf, load_bert_from_hf
from .hf_clip import clip_config_from_hf, clip_state_dict_from_hf, load_clip_from_hf
from .hf_folder import read_safetensors, tokenizer_from_hf_folder, wordpiece_tokenizer_from_hf_folder
from .hf_gpt import gpt_config_from_hf, gpt_state_dict_from_hf, load_gpt_from_hf
from .hf_swin import load_swin_from_hf, swin_config_from_hf, swin_state_dict_from_hf
from .hf_vit import load_vit_from_hf, vit_config_from_hf, vit_state_dict_from_hf
from .pretrained import Pretrained, load_pretrained, smollm2_path
from .sentence import SentenceEncoder, load_sentence_encoder, minilm_path

__all__ = [
    "GGUFContents",
    "Pretrained",
    "SentenceEncoder",
    "bert_config_from_hf",
    "bert_state_dict_from_hf",
    "clip_config_from_hf",
    "clip_state_dict_from_hf",
    "gpt_config_from_hf",
    "gpt_state_dict_from_hf",
    "hf_config_from_gguf",
    "hf_state_dict_from_gguf",
    "load_bert_from_hf",
    "load_clip_from_hf",
    "load_gpt_from_gguf",
    "load_gpt_from_hf",
    "load_pretrained",
    "load_sentence_encoder",
    "load_swin_from_hf",
    "load_vit_from_hf",
    "minilm_path",
    "read_gguf",
    "read_safetensors",
    "smollm2_path",
    "swin_config_from_hf",
    "swin_state_dict_from_hf",
    "tokenizer_from_gguf",
    "tokenizer_from_hf_folder",
    "unpermute_rope_rows",
    "vit_config_from_hf",
    "vit_state_dict_from_hf",
    "wordpiece_tokenizer_from_hf_folder",
]
