"""A chat template is a file from elsewhere: whatever it asks for, rendering it ends within bounds on what it
writes, makes, repeats and nests, and a template that passes one is a one-line error naming the bound, raised
before the memory is taken (the library's ValueError; exit status 2 from ``qkv chat``)."""

import json
import tracemalloc
from pathlib import Path

import pytest

from qkv.chat import MAX_CALL_DEPTH, MAX_RENDERED_CHARS, _tojson, check_template, render_chat

MESSAGES = [{"role": "user", "content": "Hi"}]
LLAMA3 = ("{{- bos_token }}{% for message in messages %}{{- '<|start_header_id|>' + message['role'] + "
          "'<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}")
BIG = "'y' * 1000000"  # a text a template may make: the bound is MAX_RENDERED_CHARS (and 4 per character given)


@pytest.fixture
def memory_cap():
    """Allocations of more than 2 GiB beyond what the process holds fail (MemoryError) instead of taking the
    machine: a bound that acted only after its allocation shows here as "out of memory", not as its message."""
    resource = pytest.importorskip("resource")
    statm = Path("/proc/self/statm")
    if not statm.is_file():
        yield
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = int(statm.read_text().split()[0]) * resource.getpagesize() + (2 << 30)
    resource.setrlimit(resource.RLIMIT_AS, (cap if hard == resource.RLIM_INFINITY else min(cap, hard), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


@pytest.mark.parametrize(("template", "reason"), [
    ("{{ range(10**12) | length }}", "OverflowError: Range too big"),
    ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", f"its calls nest more than {MAX_CALL_DEPTH} deep"),
    ("{{ 'x' * 10**10 }}", "'*' would make 10,000,000,000 characters"),
    ("{{ [0] * 10**10 }}", "'*' would make 80,000,000,000 characters"),  # a reference per item
    ("{{ ([0] * 100000) * 100000 }}", "'*' would make 80,000,000,000 characters"),
    ("{% for i in range(100000) %}{{ 'x' * 100 }}{% endfor %}", "it writes more than"),
    ("{% macro m() %}{% for i in range(100000) %}xxxxxxxxxxxxxxxxxxxx{% endfor %}{% endmacro %}{{ m() | length }}",
     "it writes more than"),
    ("{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
     "'~' would make 2,097,160 characters"),
    ("{{ 'x'.ljust(10**10) }}", "str.ljust would make 10,000,000,000 characters"),
    ("{{ 'x' | center(10**10) }}", "the 'center' filter would make 10,000,000,000 characters"),
    ("{{ '{:>10000000000}'.format(1) }}", "str.format would make 10,000,000,0"),
    ("{{ '%10000000000d' % 1 }}", "'%' would make 10,000,000,0"),
    (f"{{{{ ([{BIG}] * 1000) | join }}}}", "the 'join' filter would make"),  # a million references to one text
    (f"{{{{ [{BIG}] * 1000 }}}}", "writing a value would make"),
    (f"{{{{ ([{BIG}] * 100) | map('upper') | list | length }}}}", "characters in all, the bound for this conversation"),
    ("{% set z = [0] * 100000 %}{% for a in z %}{% for b in z %}{% endfor %}{% endfor %}", "its loops run more than"),
    ("{% set ns = namespace(x=10**1000) %}{% for i in range(40) %}{% set ns.x = ns.x * ns.x %}{% endfor %}",
     "'*' would make a number of 106,302 bits, more than the 65,536"),
    ("{{ 1 / 0 }}", "ZeroDivisionError: division by zero"),
], ids=["range", "recursive-macro", "text-repetition", "list-repetition", "list-of-lists", "output", "macro-output",
        "doubling", "ljust", "center", "format", "percent", "join", "write", "work", "loops", "number", "python"])
def test_a_template_past_a_bound_is_one_line_before_it_allocates(memory_cap, template, reason):
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match=r"^the model's chat template cannot be rendered") as err:
            render_chat(template, MESSAGES)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    message = str(err.value)
    assert reason in message and "\n" not in message, message
    assert peak < 64 << 20, f"{peak / 2**20:.0f} MiB held before the bound acted"


def test_the_error_names_the_line_of_the_template():
    template = "{% for m in messages %}\n{{ m.content }}\n{{ 'x' * 10**10 }}\n{% endfor %}"
    with pytest.raises(ValueError, match=r"^the model's chat template cannot be rendered \(line 3\): '\*' would"):
        render_chat(template, MESSAGES)


def test_the_bound_grows_with_the_conversation():
    """A long conversation is laid out whole: the bound is MAX_RENDERED_CHARS plus 4 per character of it."""
    long = [{"role": "user", "content": "a" * (2 * MAX_RENDERED_CHARS)}]
    assert len(render_chat(LLAMA3, long)) > 2 * MAX_RENDERED_CHARS
    bound = MAX_RENDERED_CHARS + 4 * len("userHi")
    with pytest.raises(ValueError, match=f"it writes more than {bound:,} characters"):
        render_chat("{% for i in range(20) %}{{ messages[0].content * 100000 }}{% endfor %}", MESSAGES)


# Each construct the bounds reach into (loops and their variants, macros, call/filter/set blocks, ~, %, format,
# slices, the filters measured before they run), as plain jinja2 renders it.
PARITY = [
    LLAMA3,
    "{% for m in messages if m.role == 'user' %}{{ loop.index }}/{{ loop.length }}{% else %}none{% endfor %}"
    "{% for m in [] %}x{% else %}empty{% endfor %}{% for k, v in {'a': 1}.items() %}{{ k }}={{ v }}{% endfor %}"
    "{% for x in [[1, [2]], [3]] recursive %}[{% if x is iterable %}{{ loop(x) }}{% else %}{{ x }}{% endif %}]"
    "{% endfor %}{% for m in messages %}{{ loop.cycle('a', 'b') }}{{ loop.revindex }}{% endfor %}",
    "{% macro w(n) %}<{{ caller() if caller else n }}>{% endmacro %}{% call w(1) %}{{ messages | length }}{% endcall %}"
    "{{ w(2) }}{% filter upper %}{{ bos_token }}abc{% endfilter %}{% set b %}{{ messages[0].content }}{% endset %}"
    "{{ b ~ '!' ~ 3 ~ none }}{{ messages[0] }}{{ [1, 'a'] }}{{ 3.5 }}",
    "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}"
    "{{ '%05d|%s' % (3, 'x') }}{{ '%(a)s' % {'a': 1} }}"
    "{{ '{:>5}|{}'.format('a', 2) }}{{ '{x}'.format_map({'x': 1}) }}{{ messages[::-1] | list | length }}"
    "{{ 'abcdef'[1:4] }}{{ 'a-b'.split('-') | join('+') }}{{ 'a'.center(5, '*') }}{{ 'a\tb'.expandtabs(4) }}"
    "{{ 'aa'.replace('a', 'bc', 1) }}{{ '-'.join(['x', 'y']) }}{{ 'ab'.translate({97: 'zz'}) }}{{ 2 ** 10 }}",
    "{{ [1, 2] | sum }}{{ [[1], [2]] | sum(start=[]) }}{{ [{'n': [1]}] | sum(attribute='n', start=[]) }}"
    "{{ {'a': [1]} | tojson(indent=2) }}{{ 'x' | center(5) }}|{{ 'a\nb' | indent(2, true) }}"
    "{{ [1, 2, 3] | batch(2, 0) | list }}{{ [1, 2, 3] | slice(2) | list }}{{ 'a b c' | wordwrap(2) }}"
    "{{ 'abc' | replace('b', 'xx') }}{{ messages | map(attribute='content') | join(', ') }}{{ '%s!' | format(1) }}"
    "{{ messages | selectattr('role', 'equalto', 'user') | list | length }}{{ 'abc' | truncate(2, true, '', 0) }}",
]


@pytest.mark.parametrize("template", PARITY, ids=["llama3", "loops", "blocks", "operators-methods", "filters"])
def test_a_bounded_rendering_writes_what_jinja2_writes(template):
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    plain = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    plain.filters["tojson"] = _tojson
    messages = [*MESSAGES, {"role": "assistant", "content": " Hello.\n"}]
    expected = plain.from_string(template).render(messages=messages, add_generation_prompt=True, bos_token="<s>",
                                                   eos_token="</s>")
    assert render_chat(template, messages, bos_token="<s>", eos_token="</s>") == expected


def test_a_template_nested_too_deeply_to_read_is_one_line():
    nested = "{{ " + "(" * 300 + "1" + ")" * 300 + " }}"
    with pytest.raises(ValueError, match=r"^the chat template is not valid Jinja: it nests too deeply to be read$"):
        check_template(nested)
    with pytest.raises(ValueError, match=r"^the model's chat template cannot be rendered: it nests too deeply"):
        render_chat(nested, MESSAGES)


def _tiny_llama_folder(folder: Path, template: str) -> Path:
    """The smallest Hugging Face LLaMA folder qkv loads (zero weights, a four-word tokenizer), written by hand:
    transformers takes seconds to import."""
    import torch
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder.mkdir()
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "Hello": 3}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(["<s>", "</s>"])
    tokenizer.save(str(folder / "tokenizer.json"))
    d, ff = 8, 16
    config = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=len(vocab), hidden_size=d,
                  intermediate_size=ff, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                  max_position_embeddings=32, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=True,
                  bos_token_id=1, eos_token_id=2)
    (folder / "config.json").write_text(json.dumps(config))
    shapes = {"model.embed_tokens.weight": (len(vocab), d), "model.norm.weight": (d,)}
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        shapes[f"model.layers.0.self_attn.{name}.weight"] = (d, d)
    for name, shape in (("gate_proj", (ff, d)), ("up_proj", (ff, d)), ("down_proj", (d, ff))):
        shapes[f"model.layers.0.mlp.{name}.weight"] = shape
    for name in ("input_layernorm", "post_attention_layernorm"):
        shapes[f"model.layers.0.{name}.weight"] = (d,)
    save_file({name: torch.zeros(shape) for name, shape in shapes.items()}, str(folder / "model.safetensors"))
    (folder / "chat_template.jinja").write_text(template, encoding="utf-8")
    return folder


def test_qkv_chat_with_a_template_past_a_bound_exits_2_in_one_line(tmp_path):
    """Once "out of memory; use a smaller model" after a 10 GB allocation: now the template's error, before."""
    from clitools import one_line_error, qkv

    _tiny_llama_folder(tmp_path / "model", "{{ 'x' * 10**10 }}")
    proc = qkv("chat", "--pretrained", "model", "--max-new-tokens", "2", cwd=tmp_path, input="Hello\n")
    assert proc.returncode == 2
    one_line_error(proc, "qkv chat: error: the model's chat template cannot be rendered (line 1): '*' would make "
                   "10,000,000,000 characters")


def test_the_compiled_template_calls_each_bound():
    """The buffers, loops and ``~`` are bounded inside jinja2's compiler, which jinja2 does not publish: a version
    whose compiler no longer calls the overridden methods shows here by name (and in the output, macro-output,
    loops and doubling cases above by behaviour)."""
    from qkv.chat import _environment

    source = _environment().compile("{% macro m() %}{% for i in [1] %}{{ i ~ 'a' }}{% endfor %}{% endmacro %}{{ m() }}",
                                    raw=True)
    for bound in ("environment.bounded_buffer()", "environment.bounded_loop,", "environment.bounded_concat("):
        assert bound in source, f"jinja2 no longer compiles {bound}: qkv.template_bounds needs updating"
