"""chat_training_ids marks exactly the tokens transformers marks from the same templates with {% generation %}
around each assistant turn and its end-of-turn token: for SmolLM2's, Llama 3.1's, Qwen2.5's, Qwen3's and Mistral
v0.3's templates, several assistant turns, and one-line errors where a conversation cannot be learnt from."""

from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from qkv.chat import chat_training_ids
from qkv.tokenizers import PretrainedTokenizer

transformers = pytest.importorskip("transformers")

# The published templates, as Hugging Face ships them, less the tool-calling branches (tools are not passed here).
# Llama 3.1 / 3.3 instruct: a system header always (knowledge cutoff, date), assistant content trimmed.
LLAMA31 = r"""{{- bos_token }}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {{- message.content }}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""  # noqa: E501 (the published template, verbatim)
# Qwen2.5 instruct: ChatML with a default system message; a tool's answer is a user turn in <tool_response>.
QWEN25 = r"""{%- if messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
{%- else %}
    {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""  # noqa: E501 (the published template, verbatim)
# Qwen3: ChatML; the assistant turns after the last user message carry a <think> block (empty when the message has
# no reasoning), earlier ones do not, so a turn is laid out differently once a later user turn follows it.
QWEN3 = r"""{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set content = message.content %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is defined and message.reasoning_content is not none %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in message.content %}
                {%- set content = message.content.split('</think>')[-1].lstrip('\n') %}
                {%- set reasoning_content = message.content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}
"""  # noqa: E501 (the published template, verbatim)
# Mistral 7B instruct v0.3: no system turn (the system message goes into the last user message), no assistant
# header (the answer follows [/INST] after a space), eos closes each answer.
MISTRAL_V03 = r"""{%- if messages[0]["role"] == "system" %}
    {%- set system_message = messages[0]["content"] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}

{#- This block checks for alternating user/assistant messages, skipping tool calling messages #}
{%- set ns = namespace() %}
{%- set ns.index = 0 %}
{%- for message in loop_messages %}
    {%- if not (message.role == "tool" or message.role == "tool_results" or (message.tool_calls is defined and message.tool_calls is not none)) %}
        {%- if (message["role"] == "user") != (ns.index % 2 == 0) %}
            {{- raise_exception("After the optional system message, conversation roles must alternate user/assistant/user/assistant/...") }}
        {%- endif %}
        {%- set ns.index = ns.index + 1 %}
    {%- endif %}
{%- endfor %}

{{- bos_token }}
{%- for message in loop_messages %}
    {%- if message["role"] == "user" %}
        {%- if loop.last and system_message is defined %}
            {{- "[INST] " + system_message + "\n\n" + message["content"] + "[/INST]" }}
        {%- else %}
            {{- "[INST] " + message["content"] + "[/INST]" }}
        {%- endif %}
    {%- elif message["role"] == "assistant" %}
        {{- " " + message["content"]|trim + eos_token}}
    {%- else %}
        {{- raise_exception("Only user and assistant roles are supported, with the exception of an initial optional system message!") }}
    {%- endif %}
{%- endfor %}
"""  # noqa: E501 (the published template, verbatim)

# The same layouts with transformers' {% generation %} markers around what the assistant writes, end-of-turn token
# included: the reference for the mask.
SMOLLM2_MARKED = r"""{% for message in messages %}
{%- if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}
{%- if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\n' }}{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}
{%- else %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endif %}
{%- endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"""  # noqa: E501
LLAMA31_MARKED = LLAMA31.replace(
    "    {%- if not (message.role == 'ipython'",
    "    {%- if message.role == 'assistant' %}\n"
    "        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n"
    "        {%- generation %}{{- message['content'] | trim + '<|eot_id|>' }}{%- endgeneration %}\n"
    "    {%- elif not (message.role == 'ipython'")
QWEN25_MARKED = QWEN25.replace(
    "    {%- if (message.role == \"user\")",
    "    {%- if message.role == \"assistant\" %}\n"
    "        {{- '<|im_start|>assistant\\n' }}{% generation %}{{- message.content + '<|im_end|>' }}{% endgeneration %}"
    "{{- '\\n' }}\n"
    "    {%- elif (message.role == \"user\")")
QWEN3_MARKED = QWEN3.replace(r"""        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\n' }}""", r"""        {{- '<|im_start|>' + message.role + '\n' }}
        {%- generation %}
        {%- if loop.index0 > ns.last_query_index and (loop.last or reasoning_content) %}
            {{- '<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
        {%- else %}
            {{- content }}
        {%- endif %}
        {{- '<|im_end|>' }}
        {%- endgeneration %}
        {{- '\n' }}""")  # noqa: E501
MISTRAL_V03_MARKED = MISTRAL_V03.replace(
    """{{- " " + message["content"]|trim + eos_token}}""",
    """{% generation %}{{- " " + message["content"]|trim + eos_token}}{% endgeneration %}""")

CORPUS = [
    "Hello! How can I help you today?\n\nThe cat sat on the mat.",
    "You are a helpful assistant. Answer in one sentence.\n",
    "What does 猫 mean? It means cat 🐈, and 狗 means dog.",
    "Sure: two plus two is four.\nAnything else?\n\n",
    "system\n\nuser\n\nassistant\n\n",  # so that "\n\n" is one token, which a turn can start inside
]
MIXED = [  # spaces and newlines at the edges (some templates trim them), Chinese and an emoji (multi-byte offsets)
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Hello!"},
    {"role": "assistant", "content": "Hello! How can I help you today?"},
    {"role": "user", "content": "What does 猫 mean?"},
    {"role": "assistant", "content": "\nIt means cat 🐈. "},
    {"role": "user", "content": "And two plus two?"},
    {"role": "assistant", "content": " Sure: two plus two is four.\nAnything else?"},
]
CONVERSATIONS = {"one-turn": MIXED[1:3], "three-turns": MIXED[1:], "with-system": MIXED}
# An answer that starts with blank lines: after ChatML's "assistant\n", byte-level BPE reads "\n\n" + "\n" + "It",
# a token that straddles header and answer; it is learnt, as transformers counts it (it overlaps the answer).
STRADDLING = [MIXED[1], {"role": "assistant", "content": "\n\nIt means cat."}]


@dataclass(frozen=True)
class Family:
    template: str | None  # None: the model's own, read from its GGUF file
    marked: str
    make: Callable[[], PretrainedTokenizer]
    answer: Callable[[str, bool], str]  # an assistant message's text as the template writes it (is it the last?)
    system: bool = True  # whether the template keeps a system message before a conversation's last answer


def _bpe(specials, *, bos, eos, add_bos, added=()) -> PretrainedTokenizer:
    """A small byte-level BPE tokenizer with the family's special tokens (as Llama 3's and Qwen's are built)."""
    hf = Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=list(specials), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    hf.train_from_iterator(CORPUS, trainer=trainer)
    hf.add_tokens(list(added))
    bos_id = None if bos is None else hf.token_to_id(bos)
    return PretrainedTokenizer(hf, bos_id=bos_id, eos_id=hf.token_to_id(eos), add_bos=add_bos)


@cache
def _smollm2() -> tuple[str, PretrainedTokenizer]:
    """SmolLM2's own chat template and tokenizer, read from its GGUF file (the weights are not loaded)."""
    from qkv.interop import smollm2_path
    from qkv.interop.gguf import open_gguf
    from qkv.interop.gguf_tokenizer import tokenizer_from_gguf

    path = smollm2_path()
    if path is None:
        pytest.skip("SmolLM2 is not installed")
    _, metadata = open_gguf(path)
    return metadata["tokenizer.chat_template"], tokenizer_from_gguf(metadata)


def _chatml(content: str, last: bool) -> str:
    return content + "<|im_end|>"


FAMILIES = {
    "smollm2": Family(None, SMOLLM2_MARKED, lambda: _smollm2()[1], _chatml),
    "llama3.1": Family(LLAMA31, LLAMA31_MARKED, cache(lambda: _bpe(
        ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        bos="<|begin_of_text|>", eos="<|eot_id|>", add_bos=True)), lambda c, last: c.strip() + "<|eot_id|>"),
    "qwen2.5": Family(QWEN25, QWEN25_MARKED, cache(lambda: _bpe(
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], bos=None, eos="<|im_end|>", add_bos=False)), _chatml),
    "qwen3": Family(QWEN3, QWEN3_MARKED, cache(lambda: _bpe(
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], bos=None, eos="<|im_end|>", add_bos=False,
        added=["<think>", "</think>"])),
        lambda c, last: ("<think>\n\n</think>\n\n" + c.lstrip("\n") if last else c) + "<|im_end|>"),
    "mistral-v0.3": Family(MISTRAL_V03, MISTRAL_V03_MARKED, cache(lambda: _bpe(
        ["<unk>", "<s>", "</s>", "[INST]", "[/INST]"], bos="<s>", eos="</s>", add_bos=True)),
        lambda c, last: " " + c.strip() + "</s>", system=False),
}


def _family(name: str) -> tuple[str, PretrainedTokenizer, Family]:
    family = FAMILIES[name]
    tokenizer = family.make()
    return family.template or _smollm2()[0], tokenizer, family


def _cases(conversations=CONVERSATIONS) -> list:
    return [pytest.param(name, messages, id=f"{name}-{label}") for name, family in FAMILIES.items()
            for label, messages in conversations.items() if family.system or messages[0]["role"] != "system"]


@cache
def _fast(tokenizer: PretrainedTokenizer):
    """transformers' tokenizer around a copy of the same ``tokenizers.Tokenizer``."""
    return transformers.PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(tokenizer.hf.to_str()))


def _reference(marked: str, messages, tokenizer: PretrainedTokenizer) -> tuple[list[int], list[bool]]:
    """transformers' ids and assistant mask, from the same tokenizer and the marked template."""
    fast = _fast(tokenizer)
    specials = {name: "" if i is None else tokenizer.hf.id_to_token(i)
                for name, i in (("bos_token", tokenizer.bos_id), ("eos_token", tokenizer.eos_id))}
    out = fast.apply_chat_template(list(messages), chat_template=marked, tokenize=True, return_dict=True,
                                   return_assistant_tokens_mask=True, **specials)
    return list(out["input_ids"]), [bool(m) for m in out["assistant_masks"]]


def _runs(mask: list[bool]) -> list[tuple[int, int]]:
    """The (start, stop) of each run of True."""
    edges = [i for i in range(len(mask) + 1) if (i < len(mask) and mask[i]) != (i > 0 and mask[i - 1])]
    return list(zip(edges[::2], edges[1::2], strict=True))


@pytest.mark.parametrize(("name", "messages"), _cases({**CONVERSATIONS, "straddling": STRADDLING}))
def test_the_mask_is_what_transformers_marks_with_generation_blocks(name, messages):
    template, tokenizer, family = _family(name)
    ids, mask = chat_training_ids(template, messages, tokenizer)
    assert (ids, mask) == _reference(family.marked, messages, tokenizer)


@pytest.mark.parametrize(("name", "messages"), _cases())
def test_each_assistant_turn_and_its_end_of_turn_token_are_learnt_and_nothing_else(name, messages):
    template, tokenizer, family = _family(name)
    ids, mask = chat_training_ids(template, messages, tokenizer)
    answers = [m["content"] for m in messages if m["role"] == "assistant"]
    runs = _runs(mask)
    assert len(runs) == len(answers)  # one run per assistant turn
    assert all(ids[stop - 1] in tokenizer.stop_ids for _, stop in runs)  # each ends with its end-of-turn token
    learnt = [tokenizer.hf.decode(ids[start:stop], skip_special_tokens=False) for start, stop in runs]
    assert learnt == [family.answer(a, k == len(answers) - 1) for k, a in enumerate(answers)]
    untrained = tokenizer.hf.decode([i for i, m in zip(ids, mask, strict=True) if not m], skip_special_tokens=False)
    assert all(m["content"].strip() in untrained for m in messages if m["role"] in ("system", "user"))


def test_qwen3_trains_on_the_empty_think_block_of_the_last_answer_only():
    template, tokenizer, _ = _family("qwen3")
    ids, mask = chat_training_ids(template, MIXED, tokenizer)
    learnt = [tokenizer.hf.decode(ids[a:b], skip_special_tokens=False) for a, b in _runs(mask)]
    assert learnt == ["Hello! How can I help you today?<|im_end|>", "\nIt means cat 🐈. <|im_end|>",
                      "<think>\n\n</think>\n\n Sure: two plus two is four.\nAnything else?<|im_end|>"]
    untrained = tokenizer.hf.decode([i for i, m in zip(ids, mask, strict=True) if not m], skip_special_tokens=False)
    assert untrained.endswith("<|im_start|>assistant\n\n")  # the header and ChatML's newline after <|im_end|>


def test_bos_is_added_once_where_the_model_wants_it():
    template, tokenizer, _ = _family("llama3.1")
    ids, mask = chat_training_ids(template, MIXED, tokenizer)
    assert ids.count(tokenizer.bos_id) == 1 and ids[0] == tokenizer.bos_id and not mask[0]  # the template wrote it
    template, qwen, _ = _family("qwen2.5")
    plain_ids, plain_mask = chat_training_ids(template, MIXED, qwen)
    wants_bos = PretrainedTokenizer(qwen.hf, bos_id=qwen.hf.token_to_id("<|endoftext|>"), eos_id=qwen.eos_id,
                                    add_bos=True)
    assert chat_training_ids(template, MIXED, wants_bos) == ([wants_bos.bos_id, *plain_ids], [False, *plain_mask])


def test_a_tool_answer_is_not_learnt():
    template, tokenizer, family = _family("qwen2.5")
    messages = [*MIXED[:3], {"role": "tool", "content": "4"}, {"role": "assistant", "content": "It is 4."}]
    ids, mask = chat_training_ids(template, messages, tokenizer)
    assert (ids, mask) == _reference(family.marked, messages, tokenizer)
    learnt = [tokenizer.hf.decode(ids[a:b], skip_special_tokens=False) for a, b in _runs(mask)]
    assert learnt == ["Hello! How can I help you today?<|im_end|>", "It is 4.<|im_end|>"]


# ChatML whose assistant turns are not closed: the next user turn's <|im_end|> must not be taken for theirs.
UNCLOSED = ("{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content }}"
            "{% if m.role != 'assistant' %}{{ '<|im_end|>' }}{% endif %}{{ '\\n' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


@pytest.mark.parametrize(("name", "template", "messages", "message"), [
    ("qwen2.5", None, [MIXED[1], {"role": "narrator", "content": "Meanwhile"}, MIXED[2]],
     "message 1 has role 'narrator'; expected one of system, user, assistant, tool"),
    ("qwen2.5", None, [MIXED[0], MIXED[1]], "the conversation (system, user) has no assistant turn to learn from"),
    ("qwen2.5", None, [MIXED[1], {"role": "assistant"}], "message 1 must be a dict with string 'role' and 'content'"),
    # Mistral v0.3 writes the system message into the last user turn: into the prompt for the first answer, but
    # nowhere once the conversation ends with an answer.
    ("mistral-v0.3", None, MIXED, "the chat template lays out earlier turns differently once later ones follow "
     "(the prompt for assistant message 2 is not the start of the whole conversation), so qkv cannot find the "
     "assistant turns"),
    ("qwen2.5", UNCLOSED, MIXED[1:3], "the chat template writes assistant message 1 with no end-of-turn token after "
     "it (the tokenizer's are: <|endoftext|>, <|im_end|>), so qkv cannot teach the model where its answer ends"),
    ("qwen2.5", UNCLOSED, MIXED[1:5], "writes assistant message 1 with no end-of-turn token after it"),
    ("mistral-v0.3", None, [MIXED[2], MIXED[1]], "the model's chat template refuses this conversation: After the "
     "optional system message, conversation roles must alternate"),
])
def test_a_conversation_that_cannot_be_learnt_from_is_a_one_line_error(name, template, messages, message):
    default, tokenizer, _ = _family(name)
    with pytest.raises(ValueError) as err:
        chat_training_ids(template or default, messages, tokenizer)
    assert message in str(err.value) and "\n" not in str(err.value)
