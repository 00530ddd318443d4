"""Marian (opus-mt) folders in qkv's own Transformer, against transformers' MarianMTModel and MarianTokenizer
reading the same folder: a model built from a small config with random weights, and SentencePiece models trained
here on a few hundred sentences of each side; nothing downloaded."""

from __future__ import annotations

import io
import json

import pytest
import torch

from qkv.interop.hf_marian import load_marian_folder
from qkv.tasks.translation import max_new_tokens, translate, translate_ids, translation_ids

transformers = pytest.importorskip("transformers")
spm = pytest.importorskip("sentencepiece", reason="Marian's tokenizers need sentencepiece")

ENGLISH = ["The robot picked up the red ball.", "A dog runs on the beach.", "Two men are playing chess.",
           "The cat sat on the mat near the door.", "Children play in the park after school.",
           "She reads a book about 3 old ships."]
GERMAN = ["Der Roboter hob den roten Ball auf.", "Ein Hund rennt am Strand.", "Zwei Männer spielen Schach.",
          "Die Katze saß auf der Matte neben der Tür.", "Kinder spielen nach der Schule im Park.",
          "Sie liest ein Buch über 3 alte Schiffe."]


TRAINING_STEPS = 120


def _train(model, tokenizer) -> None:
    """A few steps on the pairs: enough for translations that end (with </s>) at lengths of their own, too few
    for one sure answer, so that beam search has choices to make."""
    batch = tokenizer(ENGLISH, text_target=GERMAN, return_tensors="pt", padding=True)
    batch["labels"][batch["labels"] == tokenizer.pad_token_id] = -100
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(TRAINING_STEPS):
        optimizer.zero_grad()
        model(**batch).loss.backward()
        optimizer.step()
    model.eval()


def _sentencepiece(lines: list[str], size: int) -> bytes:
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines * 50), model_writer=model, vocab_size=size,
                                   model_type="unigram", character_coverage=1.0, bos_id=-1, eos_id=-1, unk_id=0,
                                   minloglevel=2)
    return model.getvalue()


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A Marian folder as opus-mt's are: one vocabulary of both sides' pieces ("</s>" 0, "<unk>" 1, "<pad>" last),
    sinusoidal positions, swish, tied embeddings with a final logits bias; weights moved off their initial
    values so that a swapped tensor shows."""
    out = tmp_path_factory.mktemp("opus-mt-en-de")
    source, target = _sentencepiece(ENGLISH, 48), _sentencepiece(GERMAN, 48)
    pieces = []
    for model in (source, target):
        processor = spm.SentencePieceProcessor(model_proto=model)
        pieces += [processor.id_to_piece(i) for i in range(1, processor.get_piece_size())]
    vocab = {"</s>": 0, "<unk>": 1, **{p: i + 2 for i, p in enumerate(dict.fromkeys(pieces))}}
    vocab["<pad>"] = len(vocab)
    (out / "source.spm").write_bytes(source)
    (out / "target.spm").write_bytes(target)
    (out / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    config = transformers.MarianConfig(
        vocab_size=len(vocab), d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
        activation_function="swish", scale_embedding=True, pad_token_id=vocab["<pad>"], eos_token_id=0,
        decoder_start_token_id=vocab["<pad>"], forced_eos_token_id=0, bad_words_ids=[[vocab["<pad>"]]])
    torch.manual_seed(0)
    model = transformers.MarianMTModel(config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
        model.final_logits_bias.normal_()
    _train(model, transformers.MarianTokenizer(*(str(out / n) for n in ("source.spm", "target.spm", "vocab.json"))))
    model.save_pretrained(out)
    return out


def _reference(folder):
    return transformers.MarianMTModel.from_pretrained(folder, attn_implementation="eager").eval(), \
        transformers.MarianTokenizer.from_pretrained(folder)


def test_a_marian_folder_gives_transformers_logits_and_tokens(folder):
    ours, (theirs, tokenizer) = load_marian_folder(folder), _reference(folder)
    src_tok, tgt_tok = ours.tokenizers["src"], ours.tokenizers["tgt"]
    for english, german in zip(ENGLISH, GERMAN, strict=True):
        assert tokenizer(english).input_ids == [*src_tok.encode(english), 0]
        labels = tokenizer(text_target=german).input_ids
        assert labels == [*tgt_tok.encode(german), 0]
        assert tokenizer.decode(labels, skip_special_tokens=True) == tgt_tok.decode(labels) == german
    batch = tokenizer(ENGLISH[:3], return_tensors="pt", padding=True)  # padded: the mask follows pad_id
    pad = ours.model.config.pad_id
    tgt_in = torch.tensor([[pad, *tgt_tok.encode(g)[:6]] for g in GERMAN[:3]])
    with torch.no_grad():
        expected = theirs(**batch, decoder_input_ids=tgt_in).logits
        torch.testing.assert_close(ours.model(batch.input_ids, tgt_in), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("beams, alpha", [(1, 1.0), (4, 1.0), (4, 0.0), (5, 2.0)])
def test_greedy_and_beam_search_translate_as_transformers_generate_does(folder, beams, alpha):
    """Marian's search is transformers' (a pool of finished hypotheses, scores over length^alpha, pad never
    generated, </s> forced at the limit): the same tokens, hypotheses ending at lengths of their own."""
    ours, (theirs, tokenizer) = load_marian_folder(folder), _reference(folder)
    sources = [ours.tokenizers["src"].encode(s) for s in ENGLISH]
    with torch.no_grad():
        mine = translate_ids(ours.model, sources, beam_size=beams, alpha=alpha, ids=translation_ids(ours.tokenizers))
        for source, ids, hypothesis in zip(ENGLISH, sources, mine, strict=True):
            out = theirs.generate(**tokenizer([source], return_tensors="pt"), num_beams=beams, do_sample=False,
                                  max_new_tokens=max_new_tokens(ours.model, len(ids)), length_penalty=alpha)
            assert out[0, 1:].tolist() == [*hypothesis, 0], source
    limits = [max_new_tokens(ours.model, len(ids)) for ids in sources]
    assert any(len(h) < limit - 1 for h, limit in zip(mine, limits, strict=True))  # some end with </s> early


def test_translate_reads_text_and_gives_text(folder):
    ours = load_marian_folder(folder)
    texts = translate(ours.model, ours.tokenizers, ["A dog runs.", ""])
    assert texts[1] == "" and isinstance(texts[0], str)


def test_older_folders_weights_in_pytorch_model_bin_load_as_tensors_only(folder, tmp_path, capfd):
    """pytorch_model.bin (a pickle) is read with torch.load(weights_only=True): the same model; a pickle that
    would run code is refused in one line, its code never run."""
    import shutil

    from safetensors.torch import load_file

    older = tmp_path / "older"
    shutil.copytree(folder, older)
    torch.save(load_file(older / "model.safetensors"), older / "pytorch_model.bin")
    (older / "model.safetensors").unlink()
    src, tgt = torch.tensor([[5, 9, 7, 0]]), torch.tensor([[70, 3, 4]])
    with torch.no_grad():
        expected = load_marian_folder(folder).model(src, tgt)
        torch.testing.assert_close(load_marian_folder(older).model(src, tgt), expected)

    class Payload:
        def __reduce__(self):
            return (print, ("the pickle ran code",))

    torch.save({"model.shared.weight": Payload()}, older / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"cannot read .*pytorch_model\.bin as tensors"):
        load_marian_folder(older)
    assert "the pickle ran code" not in capfd.readouterr().out


def test_a_marian_folder_with_a_missing_file_is_one_line(folder, tmp_path):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(folder, broken)
    (broken / "target.spm").unlink()
    with pytest.raises(ValueError, match=r"is not a whole Marian folder: it lacks target\.spm"):
        load_marian_folder(broken)
    with pytest.raises(ValueError, match=r"^cannot load 'opus-mt-en-zh': no such file or folder here .* qkv reads "
                                         r"local files only"):
        load_marian_folder("opus-mt-en-zh")  # a hub name, not a folder here


@pytest.mark.parametrize("content", [b"", b"not a model"], ids=["empty", "garbage"])
def test_a_sentencepiece_model_that_does_not_parse_is_named(folder, tmp_path, content):
    """sentencepiece says "(an internal error)" or "Model is not initialized" (an empty file parses, then fails
    at its first text): qkv names the file."""
    import shutil

    broken = shutil.copytree(folder, tmp_path / "broken")
    (broken / "source.spm").write_bytes(content)
    with pytest.raises(ValueError, match=r"broken/source\.spm is not a SentencePiece model") as err:
        load_marian_folder(broken)
    assert "\n" not in str(err.value)


def _first_pieces(vocab, n):  # 100 of 301 pieces: the rest of the ids have no piece
    return dict(list(vocab.items())[:n])


@pytest.mark.parametrize("damage", [
    lambda vocab: _first_pieces(vocab, len(vocab) // 3),
    lambda vocab: dict.fromkeys(vocab, 0) | {"<unk>": 1},
    lambda vocab: vocab | {"<unk>": len(vocab) + 5},
    lambda vocab: vocab | {"<unk>": "1"},
], ids=["a third of the pieces", "every piece id 0", "an id beyond the model", "an id as text"])
def test_a_vocabulary_that_is_not_one_piece_per_id_is_refused(folder, tmp_path, here, damage):
    """Such a vocab.json used to translate with exit 0: a wrong text, or a blank line."""
    import shutil

    broken = shutil.copytree(folder, tmp_path / "broken")
    vocab = json.loads((folder / "vocab.json").read_text(encoding="utf-8"))
    (broken / "vocab.json").write_text(json.dumps(damage(vocab), ensure_ascii=False), encoding="utf-8")
    before = {p.name: p.read_bytes() for p in broken.iterdir()}
    proc = here("translate", "--pretrained", broken, ENGLISH[0], cwd=tmp_path)
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    assert len(proc.stderr.splitlines()) == 1 and \
        f"not one piece to each of the model's {len(vocab)} ids" in proc.stderr, proc.stderr
    assert {p.name: p.read_bytes() for p in broken.iterdir()} == before


def test_qkv_translate_and_evaluate_run_a_marian_folder(folder, tmp_path, here):
    """The command line: its translations are the library's (the folder's own beam size, 4, by default), the
    cross-attention map is drawn, int8 weights run, and a missing file or two models are one line."""
    import json as json_

    generation = json_.loads((folder / "generation_config.json").read_text())
    work = tmp_path / "work"
    work.mkdir()
    marian = work / "marian"
    import shutil

    shutil.copytree(folder, marian)
    (marian / "generation_config.json").write_text(json_.dumps(generation | {"num_beams": 4}))
    ours = load_marian_folder(marian)
    expected = translate(ours.model, ours.tokenizers, ENGLISH[:2], beam_size=4, alpha=1.0)
    proc = here("translate", "--pretrained", marian, *ENGLISH[:2], "--attention", "map.png", cwd=work)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == expected and (work / "map.png").stat().st_size > 0
    assert here("translate", "--pretrained", marian, ENGLISH[0], "--quantize", "int8", cwd=work).returncode == 0
    (work / "src.txt").write_text("\n".join(ENGLISH[:2]) + "\n")
    (work / "ref.txt").write_text("\n".join(expected) + "\n")
    proc = here("evaluate", "--pretrained", marian, "--src", "src.txt", "--ref", "ref.txt", cwd=work)
    assert proc.returncode == 0 and "BLEU = 100.00" in proc.stdout, proc.stdout + proc.stderr
    proc = here("translate", "--pretrained", marian, "--model", marian, "hi", cwd=work)
    assert proc.returncode == 2 and "give one model" in proc.stderr
    (marian / "vocab.json").unlink()
    proc = here("translate", "--pretrained", marian, "hi", cwd=work)
    assert proc.returncode == 2 and "lacks vocab.json" in proc.stderr and len(proc.stderr.splitlines()) == 1


def test_a_marian_model_exports_back_to_a_folder_transformers_reads_as_the_original(folder, tmp_path):
    from qkv.interop.export import export_hf

    ours, (theirs, tokenizer) = load_marian_folder(folder), _reference(folder)
    export_hf(ours.model, ours.tokenizers, tmp_path / "out")
    again, again_tokenizer = _reference(tmp_path / "out")
    batch = tokenizer(ENGLISH[:3], return_tensors="pt", padding=True)
    assert again_tokenizer(ENGLISH[:3], padding=True).input_ids == batch.input_ids.tolist()
    tgt_in = torch.tensor([[ours.model.config.pad_id, *ours.tokenizers["tgt"].encode(g)[:6]] for g in GERMAN[:3]])
    with torch.no_grad():
        torch.testing.assert_close(again(**batch, decoder_input_ids=tgt_in).logits,
                                   theirs(**batch, decoder_input_ids=tgt_in).logits, atol=1e-5, rtol=1e-5)
        assert again.generate(**batch, num_beams=3, max_new_tokens=30).tolist() == \
            theirs.generate(**batch, num_beams=3, max_new_tokens=30).tolist()


def test_a_post_norm_transformer_trained_in_qkv_exports_as_marian_and_a_pre_norm_one_is_refused(tmp_path):
    """qkv's Transformer with Marian's layout (Post-Norm, sines then cosines) and one shared BPE vocabulary:
    MarianMTModel gives its logits and greedy tokens; the default Pre-Norm model is refused, fields named."""
    from qkv import Transformer, TransformerConfig
    from qkv.interop.export import export_hf
    from qkv.tokenizers import BOS_ID, BPETokenizer

    bpe = BPETokenizer.train(ENGLISH + GERMAN, vocab_size=120)
    sizes = dict(src_vocab_size=bpe.vocab_size, tgt_vocab_size=bpe.vocab_size, d_model=32, n_heads=4, n_layers=2,
                 d_ff=64, max_seq_len=64, share_embeddings=True)
    model = Transformer(TransformerConfig(**sizes, norm_first=False, sinusoidal_layout="halves", activation="relu",
                                          vocab_multiple=16)).eval()
    export_hf(model, {"src": bpe, "tgt": bpe}, tmp_path / "out")
    theirs = transformers.MarianMTModel.from_pretrained(tmp_path / "out", attn_implementation="eager").eval()
    fast = transformers.PreTrainedTokenizerFast.from_pretrained(tmp_path / "out")
    src = torch.tensor([bpe.encode(ENGLISH[0])])
    assert fast(ENGLISH[0], add_special_tokens=False).input_ids == src[0].tolist()
    tgt_in = torch.tensor([[BOS_ID, *bpe.encode(GERMAN[0])]])
    with torch.no_grad():
        torch.testing.assert_close(theirs(input_ids=src, decoder_input_ids=tgt_in).logits, model(src, tgt_in),
                                   atol=1e-5, rtol=1e-5)
        mine = translate_ids(model, [src[0].tolist()], ids=translation_ids({"tgt": bpe}))[0]
        out = theirs.generate(input_ids=src, max_new_tokens=max_new_tokens(model, src.size(1)))[0, 1:].tolist()
    assert out[: len(mine)] == mine
    with pytest.raises(ValueError, match="a Hugging Face Marian config cannot hold norm_first=True, "
                                         "sinusoidal_layout=interleaved"):
        export_hf(Transformer(TransformerConfig(**sizes)), {"src": bpe, "tgt": bpe}, tmp_path / "refused")


def test_the_explorer_shows_a_marian_models_attention(folder):
    """The explorer's translation view on a Marian model: its greedy translation, read from <pad> (Marian's
    start), the source with its </s>, every layer's cross-attention rows summing to one."""
    from qkv.explore import translation_result

    ours = load_marian_folder(folder)
    result = translation_result(ours.model, ours.tokenizers, ENGLISH[0], name="opus-mt-en-de")
    hypothesis = translate_ids(ours.model, [ours.tokenizers["src"].encode(ENGLISH[0])],
                               ids=translation_ids(ours.tokenizers))[0]
    cross = next(view for view in result["views"] if view["id"] == "cross")
    assert cross["keys"][-1] == "</s>" and cross["queries"][0] == "<pad>"
    assert len(result["steps"]["tokens"]) == len(hypothesis) + 1
    weights = torch.tensor(cross["attention"][-1][0])  # the last layer's first head
    torch.testing.assert_close(weights.sum(-1), torch.ones(len(hypothesis) + 1), atol=1e-3, rtol=0)


def test_qkv_explore_exports_a_page_of_a_marian_folder(folder, tmp_path, here):
    proc = here("explore", "--pretrained", folder, "--export", "page.html", "--text", ENGLISH[0], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    page = (tmp_path / "page.html").read_text(encoding="utf-8")
    assert "Cross-attention" in page and folder.name in page


# ------------------------------------------------------------------------------------------ LoRA adapters

MARIAN_TARGETS = ("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2")


def _peft_on_marian(folder, path, targets=MARIAN_TARGETS):
    """transformers' MarianMTModel adapted by peft (rank 4, on the self-attention of both stacks, the decoder's
    cross-attention and the feed-forwards), its adapters random, saved by peft into ``path``."""
    peft = pytest.importorskip("peft")
    base = transformers.MarianMTModel.from_pretrained(folder, attn_implementation="eager")
    adapted = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=list(targets),
                                                        task_type="SEQ_2_SEQ_LM"))
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in adapted.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.2)
    adapted.save_pretrained(path)
    return adapted.eval()


def _logits_both(ours, theirs, tokenizer):
    batch = tokenizer(ENGLISH[:3], return_tensors="pt", padding=True)
    tgt_in = torch.tensor([[ours.model.config.pad_id, *ours.tokenizers["tgt"].encode(g)[:6]] for g in GERMAN[:3]])
    with torch.no_grad():
        return ours.model(batch.input_ids, tgt_in), theirs(**batch, decoder_input_ids=tgt_in).logits


def test_a_peft_adapter_on_a_marian_model_runs_in_qkv_as_in_peft(folder, tmp_path):
    """Marian's PEFT names (model.{encoder,decoder}.layers.N.{self_attn,encoder_attn}.*_proj, fc1, fc2) land on
    qkv's layers: the logits and greedy translations are peft's; without the adapter they are not."""
    from qkv.adapters import load_peft_adapter
    from qkv.lora import LoRAConfig, lora_layers
    from qkv.quantize import quantize

    theirs = _peft_on_marian(folder, tmp_path / "adapter")
    tokenizer = transformers.MarianTokenizer.from_pretrained(folder)
    ours = load_marian_folder(folder)
    config = load_peft_adapter(ours.model, tmp_path / "adapter")
    assert config == LoRAConfig(rank=4, alpha=8.0, targets=MARIAN_TARGETS)
    assert len(lora_layers(ours.model)) == 2 * 6 + 2 * 10  # encoder: 4 + 2 a layer; decoder: 4 + 4 + 2
    mine, expected = _logits_both(ours, theirs, tokenizer)
    torch.testing.assert_close(mine, expected, atol=1e-4, rtol=1e-4)
    with theirs.disable_adapter():
        assert (_logits_both(ours, theirs, tokenizer)[1] - expected).abs().max() > 0.1
    sources = [ours.tokenizers["src"].encode(s) for s in ENGLISH]
    with torch.no_grad():
        hypotheses = translate_ids(ours.model, sources, ids=translation_ids(ours.tokenizers))
        for source, ids, hypothesis in zip(ENGLISH, sources, hypotheses, strict=True):
            out = theirs.generate(**tokenizer([source], return_tensors="pt"), num_beams=1, do_sample=False,
                                  max_new_tokens=max_new_tokens(ours.model, len(ids)))
            assert out[0, 1:].tolist() == [*hypothesis, 0], source
    quantize(ours.model, "int8")  # as --quantize int8 does: the base's layers quantized, the adapters kept float
    assert len(lora_layers(ours.model)) == 2 * 6 + 2 * 10
    quantized, _ = _logits_both(ours, theirs, tokenizer)
    error = (quantized - expected).norm() / expected.norm()  # 1.6% here
    assert error < 0.05, f"int8 logits differ from float32 ones by {error:.1%} (relative RMS)"


def test_a_qkv_adapter_on_a_marian_model_runs_in_peft(folder, tmp_path):
    peft = pytest.importorskip("peft")
    from qkv.adapters import save_peft_adapter
    from qkv.lora import LoRAConfig, add_lora

    ours, config = load_marian_folder(folder), LoRAConfig(rank=4, alpha=6.0, targets=("q_proj", "v_proj", "fc2"))
    add_lora(ours.model, config).eval()
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in ours.model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.2)
    save_peft_adapter(ours.model, config, tmp_path / "adapter", base_name=str(folder))
    base = transformers.MarianMTModel.from_pretrained(folder, attn_implementation="eager")
    theirs = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    assert theirs.peft_config["default"].task_type == "SEQ_2_SEQ_LM"
    mine, expected = _logits_both(ours, theirs, transformers.MarianTokenizer.from_pretrained(folder))
    torch.testing.assert_close(mine, expected, atol=1e-4, rtol=1e-4)


def test_qkv_translate_runs_a_peft_adapter_on_a_marian_folder(folder, tmp_path, here):
    """``--adapter``: with ``--quantize none`` the library's translations with the adapter (which are peft's,
    above), every other --quantize runs; an adapter of another family is one line."""
    from qkv.adapters import load_peft_adapter

    _peft_on_marian(folder, tmp_path / "adapter")
    ours = load_marian_folder(folder)
    load_peft_adapter(ours.model, tmp_path / "adapter")
    expected = translate(ours.model, ours.tokenizers, ENGLISH[:2], beam_size=1)
    common = ("translate", "--pretrained", folder, "--adapter", "adapter", *ENGLISH[:2], "--beam", "1")
    proc = here(*common, "--quantize", "none", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == expected
    for quantize in ("int8", "int4"):
        proc = here(*common, "--quantize", quantize, cwd=tmp_path)
        assert proc.returncode == 0 and len(proc.stdout.splitlines()) == 2, proc.stderr
    from safetensors.torch import save_file

    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps(config | {"target_modules": ["o_proj"]}))
    llama = {f"base_model.model.model.layers.0.self_attn.o_proj.lora_{side}.weight": torch.zeros(4, 4)
             for side in "AB"}  # a LLaMA-family adapter
    save_file(llama, tmp_path / "adapter" / "adapter_model.safetensors")
    proc = here(*common, cwd=tmp_path)
    assert proc.returncode == 2 and len(proc.stderr.splitlines()) == 1, proc.stderr
    assert "the LoRA target modules ['o_proj'] are not projections of a Marian model" in proc.stderr


@pytest.mark.parametrize("limit", [{"max_length": 4}, {"max_new_tokens": 2}])
def test_the_folders_own_length_limit_is_where_translations_stop(folder, tmp_path, here, limit):
    """transformers stops a translation at the folder's max_length (new tokens and the start token) or
    max_new_tokens; qkv stopped at its own, longer limit (2 × source + 10)."""
    import shutil

    marian = shutil.copytree(folder, tmp_path / "marian")
    generation = json.loads((marian / "generation_config.json").read_text())
    generation = {k: v for k, v in generation.items() if k not in ("max_length", "max_new_tokens")}
    (marian / "generation_config.json").write_text(json.dumps(generation | {"num_beams": 1, **limit}))
    theirs, tokenizer = _reference(marian)
    with torch.no_grad():
        out = [theirs.generate(**tokenizer([s], return_tensors="pt"))[0] for s in ENGLISH[:3]]
    expected = [tokenizer.decode(ids, skip_special_tokens=True) for ids in out]
    assert all(len(ids) <= 4 for ids in out)  # the start token and at most 3 (2) more
    proc = here("translate", "--pretrained", marian, *ENGLISH[:3], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == expected
    assert load_marian_folder(marian).max_new_tokens == (3 if "max_length" in limit else 2)
