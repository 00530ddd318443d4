"""Chat templates run in jinja2's sandbox give the prompts transformers renders from the same template; a
template that reaches into Python, refuses a conversation or is not valid Jinja is a one-line error."""

import pytest

from qkv.chat import chat_prompt, render_chat

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
# Gemma 3's (as its tokenizer_config.json writes it): the system prompt folded into the first user turn, roles
# checked to alternate with raise_exception, "model" for the assistant, content as a string or a list of parts
GEMMA3 = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'text' -%}{{ item['text'] | trim }}{%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""
# Phi-3's: a tag per role, <|end|> after each turn, the end-of-text token when no answer is asked for
PHI3 = ("{% for message in messages %}{% if message['role'] == 'system' %}{{'<|system|>\n' + message['content'] + "
        "'<|end|>\n'}}{% elif message['role'] == 'user' %}{{'<|user|>\n' + message['content'] + '<|end|>\n'}}"
        "{% elif message['role'] == 'assistant' %}{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}"
        "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}"
        "{% endif %}")
CONVERSATIONS = [
    [{"role": "user", "content": "Translate 'the cat' into Chinese."}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi "},
     {"role": "assistant", "content": "\nHello."}, {"role": "user", "content": "猫 means?"}],
]


def _theirs(template, messages, add_generation_prompt):
    rendered = chat_utils.render_jinja_template([messages], chat_template=template, bos_token="<s>",
                                                eos_token="</s>", add_generation_prompt=add_generation_prompt)
    return rendered[0][0] if isinstance(rendered, tuple) else rendered[0]


@pytest.mark.parametrize(("template", "answer"), [(LLAMA3, "<|end_header_id|>\n\n"), (QWEN3_LIKE, "assistant\n"),
                                                (GEMMA3, "<start_of_turn>model\n"), (PHI3, "<|assistant|>\n")],
                         ids=["llama3", "qwen3-like", "gemma3", "phi3"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("messages", CONVERSATIONS, ids=["one-turn", "four-turns"])
def test_templates_render_as_transformers_renders_them(template, answer, add_generation_prompt, messages):
    ours = render_chat(template, messages, add_generation_prompt=add_generation_prompt, bos_token="<s>",
                       eos_token="</s>")
    assert ours == _theirs(template, messages, add_generation_prompt)
    assert ours.endswith(answer) == add_generation_prompt


def test_gemmas_template_refuses_turns_that_do_not_alternate_in_one_line():
    with pytest.raises(ValueError, match="Conversation roles must alternate"):
        render_chat(GEMMA3, [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], bos_token="<s>")


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


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
WITH_CALLS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
              {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
                  "name": "get_weather", "arguments": {"city": "Paris"}}}]},
              {"role": "tool", "content": '{"celsius": 18}', "tool_call_id": "call_1"},
              {"role": "assistant", "content": "18 degrees."}, {"role": "user", "content": "And Rome?"}]


@pytest.mark.parametrize("name", ["Qwen-Qwen2.5-7B-Instruct", "Qwen-Qwen3-0.6B", "meta-llama-Llama-3.2-3B-Instruct",
                                  "meta-llama-Llama-3.1-8B-Instruct", "NousResearch-Hermes-3-Llama-3.1-8B-tool_use"])
def test_published_templates_lay_out_tools_calls_and_answers_as_transformers_does(name):
    import os
    from pathlib import Path

    path = Path(os.environ.get("QKV_LLAMA_CPP_SOURCE", "/nonexistent")) / "models" / "templates" / f"{name}.jinja"
    if not path.is_file():
        pytest.skip("needs the published chat templates of llama.cpp's sources (QKV_LLAMA_CPP_SOURCE; .ci/run)")
    template = path.read_text()
    ours = render_chat(template, WITH_CALLS, bos_token="<s>", eos_token="</s>", tools=TOOLS)
    theirs = chat_utils.render_jinja_template([WITH_CALLS], tools=TOOLS, chat_template=template, bos_token="<s>",
                                              eos_token="</s>", add_generation_prompt=True)
    assert ours == (theirs[0][0] if isinstance(theirs, tuple) else theirs[0])
    assert '"get_weather"' in ours and 'celsius' in ours and '"Paris"' in ours
