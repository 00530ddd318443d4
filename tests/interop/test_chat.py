"""Chat templates run in jinja2's sandbox give the prompts transformers renders from the same template; a
template that reaches into Python, refuses a conversation or is not valid Jinja is a one-line error."""

import pytest

from qkv.interop import chat_prompt, render_chat

chat_utils = pytest.importorskip("transformers.utils.chat_template_utils")

# Llama 3's layout (a header per turn, <|eot_id|> after each): the begin-of-text token, loop variables, strip()
LLAMA3 = (
    "{{- bos_token }}"
    "{% for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + "
    "'<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
# Qwen3's habits: a namespace carried through the loop, string methods, a tojson filter, blocks trimmed
QWEN3_LIKE = """{%- set ns = namespace(last_user=-1) %}
{%- for message in messages %}
    {%- if message.role == "user" %}{%- set ns.last_user = loop.index0 %}{%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.role == "system" %}
{{- '<|im_start|>system\\n' + message.content + '\\n' + {"tools": [], "lang": "中文 <b>"} | tojson + '<|im_end|>\\n' }}
    {%- elif message.role == "assistant" and loop.index0 > ns.last_user %}
{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' + message.content.lstrip('\\n') + '<|im_end|>\\n' }}
    {%- else %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""
CONVERSATIONS = [
    [{"role": "user", "content": "Translate 'the cat' into Chinese."}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi "},
     {"role": "assistant", "content": "\nHello."}, {"role": "user", "content": "猫 means?"}],
]


def _theirs(template, messages, add_generation_prompt):
    rendered = chat_utils.render_jinja_template([messages], chat_template=template, bos_token="<s>",
                                                eos_token="</s>", add_generation_prompt=add_generation_prompt)
    return rendered[0][0] if isinstance(rendered, tuple) else rendered[0]


@pytest.mark.parametrize("template", [LLAMA3, QWEN3_LIKE], ids=["llama3", "qwen3-like"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("messages", CONVERSATIONS, ids=["one-turn", "four-turns"])
def test_templates_render_as_transformers_renders_them(template, add_generation_prompt, messages):
    ours = render_chat(template, messages, add_generation_prompt=add_generation_prompt, bos_token="<s>",
                       eos_token="</s>")
    assert ours == _theirs(template, messages, add_generation_prompt)
    assert ours.endswith("<|end_header_id|>\n\n" if "header" in template else "assistant\n") == add_generation_prompt


def test_json_in_a_template_is_not_html_escaped():
    text = render_chat(QWEN3_LIKE, CONVERSATIONS[1])
    assert '"lang": "中文 <b>"' in text


def test_chatml_by_hand_is_a_template_too():
    """chat_prompt's ChatML, as a Jinja template: the same text (the template SmolLM2 ships is checked against
    chat_prompt in test_pretrained.py)."""
    chatml = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
              "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
    for messages in CONVERSATIONS:
        assert render_chat(chatml, messages) == chat_prompt(messages, default_system=None)


@pytest.mark.parametrize(("template", "message"), [
    ("{{ cycler.__init__.__globals__.os.popen('id').read() }}", "reaches for what a template may not"),
    ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "reaches for what a template may not"),
    ("{% set _ = messages.append({'role': 'x'}) %}", "reaches for what a template may not"),
    ("{{ raise_exception('Conversation roles must alternate user/assistant') }}",
     "refuses this conversation: Conversation roles must alternate user/assistant"),
    ("{% for m in messages %}{{ m.content }", "cannot be rendered (line 1)"),
])
def test_a_template_that_cannot_run_is_a_one_line_error(template, message):
    with pytest.raises(ValueError, match=r"^the model's chat template ") as err:
        render_chat(template, CONVERSATIONS[0])
    assert message in str(err.value) and "\n" not in str(err.value)


def test_malformed_messages_are_refused_before_the_template_runs():
    with pytest.raises(ValueError, match="message 1 must be a dict with string 'role' and 'content'"):
        render_chat(LLAMA3, [{"role": "user", "content": "a"}, {"role": "user"}])
