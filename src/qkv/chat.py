"""Chat prompts: a conversation laid out in the one format a chat model was trained on.

A chat model answers well only when its prompt has the shape of its training conversations: each turn wrapped
in the model's own markers, and the prompt ending where the assistant's answer begins. Models ship that layout
as a Jinja template (``tokenizer.chat_template`` in a GGUF file, ``chat_template.jinja`` or
``tokenizer_config.json`` in a Hugging Face folder). Two ways to use one here:

* :func:`chat_prompt` writes ChatML, SmolLM2's format, by hand, so the layout can be read in Python
  (``<|im_start|>user\\nHi<|im_end|>\\n``); the tests check it against SmolLM2's own template.
* :func:`render_chat` runs any model's template (Llama 3's headers, Qwen3's, ...) with ``jinja2`` in its
  sandbox, as other tools run them: a template is a file from elsewhere, and the sandbox lets it read the
  conversation and call string methods but reach nothing of Python's (no attributes beginning with ``_``, no
  changes to what it is given), and within bounds on what it writes, makes and repeats (a template that would
  make ``'x' * 10**10`` is stopped before it does). Blocks are trimmed as in every published template's intent
  (``trim_blocks``, ``lstrip_blocks``).

And one way to learn from a conversation: :func:`chat_training_ids` lays it out with the model's template and
marks the tokens a chat model is fine-tuned to write (the assistant turns and their end-of-turn tokens).
"""

from __future__ import annotations

import bisect
import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from .files import quoted
from .template_bounds import (
    MAX_CALL_DEPTH,
    MAX_RENDERED_CHARS,
    WORK_FACTOR,
    Budget,
    bounded_filter,
    bounded_sandbox,
    render_within,
    written_value,
)
from .tokenizers import utf8_checked

SMOLLM2_SYSTEM_PROMPT = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
# The roles a training conversation may hold ("tool": a tool's answer, for the templates that lay one out).
TRAINING_ROLES = ("system", "user", "assistant", "tool")
# The most messages a training conversation may hold: finding its assistant turns renders the conversation up to
# each of them (twice), so a conversation costs up to that many renderings of itself.
MAX_TRAINING_MESSAGES = 64


def check_messages(messages: Sequence[Mapping[str, str]]) -> None:
    """Each message a dict with a string ``role`` and ``content``, both valid Unicode
    (:func:`~qkv.tokenizers.utf8_checked`); a ValueError naming the first that is not."""
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or not all(isinstance(message.get(k), str) for k in ("role", "content")):
            raise ValueError(f"message {i} must be a dict with string 'role' and 'content', got {quoted(message)}")
        for key in ("role", "content"):
            utf8_checked(message[key], f"message {i}'s {key}")


def chat_prompt(
    messages: Sequence[Mapping[str, str]],
    *,
    add_generation_prompt: bool = True,
    default_system: str | None = SMOLLM2_SYSTEM_PROMPT,
) -> str:
    """Lay a conversation out in ChatML, SmolLM2's chat format.

    Every message becomes ``<|im_start|>{role}\\n{content}<|im_end|>\\n``. A conversation that does not open
    with a system message gets ``default_system`` first, as SmolLM2 was trained; and the prompt ends with
    ``<|im_start|>assistant\\n``, so the model's next tokens are the assistant's answer, which it closes with
    ``<|im_end|>`` (one of the tokenizer's ``stop_ids``).

    Example:
        >>> chat_prompt([{"role": "user", "content": "Hi"}], default_system="Be brief")
        '<|im_start|>system\\nBe brief<|im_end|>\\n<|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\n'

    Args:
        messages: ``{"role": "system" | "user" | "assistant", "content": text}`` in order.
        add_generation_prompt: end with the opening of an assistant turn.
        default_system: the system message added when the first message is not one (None: add none).

    Returns:
        The prompt text; its special markers become single tokens when encoded.

    Raises:
        ValueError: for a message without a string ``role`` and ``content``.
    """
    check_messages(messages)
    parts = []
    if messages and messages[0]["role"] != "system" and default_system is not None:
        parts.append(f"<|im_start|>system\n{default_system}<|im_end|>\n")
    parts += [f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages]
    if add_generation_prompt:
        parts.append("<|im_start|>assistant\n")
    return "".join(parts)


def render_chat(template: str, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
                bos_token: str = "", eos_token: str = "", tools: Sequence[Mapping[str, Any]] | None = None) -> str:
    """A conversation laid out by a model's own Jinja chat template, run in ``jinja2``'s sandbox.

    The template sees ``messages``, ``add_generation_prompt``, ``bos_token``, ``eos_token`` and, where given,
    ``tools`` (OpenAI's function objects; an assistant message may hold ``tool_calls``), and may call
    ``raise_exception(text)`` (to refuse a conversation it cannot lay out), ``strftime_now(format)`` and the
    ``tojson`` filter, which is what published templates use.

    A rendering is bounded: it may write at most ``MAX_RENDERED_CHARS`` characters plus 4 per character of the
    conversation (its calls and tools as JSON included), make no one text or list larger than that (``'x' * 10**10``
    is refused before it is made) and ``WORK_FACTOR`` times that in all, run its loops as many steps, and nest its
    calls (a macro calling itself) ``MAX_CALL_DEPTH`` deep.

    Args:
        template: the Jinja source.
        messages: ``{"role": ..., "content": text}`` in order.
        add_generation_prompt: end with the opening of an assistant turn.
        bos_token, eos_token: the tokenizer's begin/end-of-sequence token texts ("" where it has none).
        tools: the functions the model may call, for a template that lays them out (None: none given).

    Returns:
        The prompt text.

    Raises:
        ValueError: a malformed message; a template that is not valid Jinja, fails while rendering (an error of
            its own or a bound passed), refuses the conversation, or reaches for what the sandbox forbids (each in
            one line, with the template's line where known).
    """
    from jinja2.sandbox import SecurityError

    check_messages(messages)
    given = sum(len(m["role"]) + len(m["content"]) + (len(json.dumps(m["tool_calls"])) if "tool_calls" in m else 0)
                for m in messages) + (len(json.dumps(tools)) if tools else 0)
    budget = Budget(MAX_RENDERED_CHARS + 4 * given)
    variables = dict(messages=[dict(m) for m in messages], add_generation_prompt=add_generation_prompt,
                     bos_token=bos_token, eos_token=eos_token)
    if tools is not None:
        variables["tools"] = [dict(t) for t in tools]
    try:
        return render_within(_compiled(template), budget, variables)
    except _Refused as err:
        raise ValueError(f"the model's chat template refuses this conversation: {_one_line(err)}") from None
    except SecurityError as err:
        raise ValueError(f"the model's chat template reaches for what a template may not "
                         f"({_one_line(err).rstrip('.')}); it is not run") from None
    except Exception as err:  # jinja2's errors, the bounds above, Python's (a TypeError, a RecursionError, ...)
        line = _template_line(err)
        line = f" (line {line})" if line else ""
        raise ValueError(f"the model's chat template cannot be rendered{line}: {_one_line(err)}") from None


MAX_TEMPLATE_BYTES = 1 << 20  # published chat templates are a few kilobytes


def check_template(template: str) -> None:
    """``template`` must be Jinja that compiles: checked where a template is taken in (an export), not where it
    is first run.

    Raises:
        ValueError: one line, with the line of the template that does not parse.
    """
    import jinja2

    try:
        _compiled(template)
    except jinja2.TemplateSyntaxError as err:
        raise ValueError(f"the chat template is not valid Jinja (line {err.lineno}): {err.message}") from None
    except RecursionError:
        raise ValueError("the chat template is not valid Jinja: it nests too deeply to be read") from None


def template_tokens(tokenizer) -> dict[str, str]:
    """The ``bos_token`` and ``eos_token`` texts a chat template may write, from the model's
    :class:`~qkv.tokenizers.PretrainedTokenizer` ("" for one it has not): ``render_chat(template, messages,
    **template_tokens(tokenizer))``."""
    return {name: "" if i is None else tokenizer.hf.id_to_token(i)
            for name, i in (("bos_token", tokenizer.bos_id), ("eos_token", tokenizer.eos_id))}


def chat_training_ids(template: str, messages: Sequence[Mapping[str, str]], tokenizer, *, learnt_from: int = 0
                      ) -> tuple[list[int], list[bool]]:
    """A conversation as supervised fine-tuning data: its token ids, and which of them the loss is taken on.

    The conversation is laid out by the model's own template (``add_generation_prompt=False``) and encoded whole,
    after ``bos_id`` where the model wants one and the text does not begin with it (as
    :meth:`~qkv.tokenizers.PretrainedTokenizer.encode_prompt`). The model learns to write the assistant turns
    only: the loss mask is True for every token of an assistant turn (whatever the template writes after the
    assistant header: Qwen3's empty ``<think>`` block, the content) up to and including the turn's end-of-turn
    token (the first of ``tokenizer.stop_ids``: ``<|im_end|>``, ``<|eot_id|>``, ``</s>``), which teaches the
    model to stop; system and user turns, assistant headers and what follows the end-of-turn token (ChatML's
    newline) are False.

    Any template will do that lays the conversation out turn by turn: assistant message ``i`` starts where the
    rendering of ``messages[:i]`` with ``add_generation_prompt=True`` ends, which must be a prefix of the whole
    rendering. The conversation is rendered whole once, and twice more per assistant turn but the last, which
    needs one: at most :data:`MAX_TRAINING_MESSAGES` messages, so that the work is bounded by a fixed multiple of
    the conversation's length. Characters map to tokens by the tokenizer's offsets; a token that straddles the
    turn's start is counted in the turn, as ``transformers`` counts it for ``return_assistant_tokens_mask``.

    Example, with SmolLM2's ``template`` and ``tokenizer``:
        >>> ids, mask = chat_training_ids(template, [{"role": "user", "content": "Hi"},
        ...                                          {"role": "assistant", "content": "Hello."}], tokenizer)
        >>> tokenizer.hf.decode([i for i, m in zip(ids, mask) if m], skip_special_tokens=False)
        'Hello.<|im_end|>'

    Args:
        template: the model's Jinja chat template.
        messages: ``{"role": "system" | "user" | "assistant" | "tool", "content": text}`` in order, with at
            least one assistant message.
        tokenizer: the model's :class:`~qkv.tokenizers.PretrainedTokenizer` (a fast tokenizer, for the offsets);
            its bos and eos texts are given to the template.
        learnt_from: the assistant turns learnt are those from message ``learnt_from`` on (a preference pair's
            answer, after a prompt that may hold earlier assistant turns); at least one.

    Returns:
        ``(ids, mask)``: the token ids and, for each, whether the model is trained to produce it.

    Raises:
        ValueError: a malformed message or one of another role (named, with its index); more than
            :data:`MAX_TRAINING_MESSAGES` messages; a conversation with no assistant turn; a template that cannot
            render it, that lays out earlier turns differently once later ones follow, or that writes an assistant
            turn with no end-of-turn token after it (each in one line).
    """
    turns = [i for i in _assistant_turns(messages) if i >= learnt_from]
    if not turns:
        raise ValueError(f"no assistant message from message {learnt_from} on: nothing to learn")
    specials = template_tokens(tokenizer)
    text = render_chat(template, messages, add_generation_prompt=False, **specials)
    # a template may write what it was given (tool calls as JSON) beyond the messages' texts
    encoding = tokenizer.hf.encode(utf8_checked(text, "the conversation as the chat template lays it out"),
                                   add_special_tokens=False)
    ids, offsets = encoding.ids, encoding.offsets
    ends = [stop for _, stop in offsets]
    starts = [_turn_start(template, messages, i, text, specials) for i in turns]
    mask = [False] * len(ids)
    for i, start, next_start in zip(turns, starts, [*starts[1:], len(text)], strict=True):
        end = min(next_start, _turn_end_bound(template, messages, i, text, specials))
        first, last = _turn_tokens(offsets, ends, ids, start, end, tokenizer, i)
        mask[first : last + 1] = [True] * (last + 1 - first)
    if tokenizer.add_bos and ids[:1] != [tokenizer.bos_id]:
        return [tokenizer.bos_id, *ids], [False, *mask]
    return ids, mask


def _assistant_turns(messages: Sequence[Mapping[str, str]]) -> list[int]:
    """The indices of the assistant messages, after checking every message's shape and role, and their number."""
    if len(messages) > MAX_TRAINING_MESSAGES:
        raise ValueError(f"the conversation has {len(messages):,} messages, more than the {MAX_TRAINING_MESSAGES} a "
                         "training conversation may hold; split it into shorter conversations")
    check_messages(messages)
    for i, message in enumerate(messages):
        if message["role"] not in TRAINING_ROLES:
            raise ValueError(f"message {i} has role {quoted(message['role'])}; expected one of "
                             f"{', '.join(TRAINING_ROLES)}")
    turns = [i for i, message in enumerate(messages) if message["role"] == "assistant"]
    if not turns:
        roles = ", ".join(m["role"] for m in messages) or "no messages"
        raise ValueError(f"the conversation ({roles}) has no assistant turn to learn from")
    return turns


def _turn_start(template: str, messages: Sequence[Mapping[str, str]], i: int, text: str,
                specials: Mapping[str, str]) -> int:
    """Where assistant message ``i`` starts in ``text``: the end of the prompt that asks the model for it."""
    prompt = render_chat(template, messages[:i], add_generation_prompt=True, **specials)
    if not text.startswith(prompt):
        raise ValueError(f"the chat template lays out earlier turns differently once later ones follow (the prompt "
                         f"for assistant message {i} is not the start of the whole conversation), so qkv cannot "
                         "find the assistant turns")
    return len(prompt)


def _turn_end_bound(template: str, messages: Sequence[Mapping[str, str]], i: int, text: str,
                    specials: Mapping[str, str]) -> int:
    """Where the text of the conversation cut after message ``i`` ends, the bound for that turn's end-of-turn
    token: without it, a template that closes user turns but not assistant turns would have the next user turn
    learnt as part of the answer. No bound where that text is not the start of the whole (Qwen3 writes a
    ``<think>`` block into the last assistant turn only); the next assistant turn's start bounds it then. The
    last message's is the whole text, not rendered again."""
    if i == len(messages) - 1:
        return len(text)
    closed = render_chat(template, messages[: i + 1], add_generation_prompt=False, **specials)
    return len(closed) if text.startswith(closed) else len(text)


def _turn_tokens(offsets: Sequence[tuple[int, int]], ends: Sequence[int], ids: Sequence[int], start: int, end: int,
                 tokenizer, i: int) -> tuple[int, int]:
    """The first token of the turn that starts at character ``start`` and its end-of-turn token, which must start
    before character ``end`` (``ends``: where each token's characters end)."""
    first = bisect.bisect_right(ends, start)  # first token reaching past ``start``
    for t in range(first, len(ids)):
        if offsets[t][0] >= end:
            break
        if ids[t] in tokenizer.stop_ids:
            return first, t
    names = ", ".join(tokenizer.hf.id_to_token(s) for s in sorted(tokenizer.stop_ids)) or "none"
    raise ValueError(f"the chat template writes assistant message {i} with no end-of-turn token after it (the "
                     f"tokenizer's are: {names}), so qkv cannot teach the model where its answer ends")


class _Refused(Exception):
    """Raised by a template's ``raise_exception``."""


def _refuse(message: str):
    raise _Refused(message)


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False, sort_keys: bool = False) -> str:
    """JSON as the templates expect it: not HTML-escaped (Jinja's own ``tojson`` escapes ``<`` and ``&``)."""
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


# Compiling takes milliseconds, rendering far less, and chat_training_ids renders a template twice per assistant turn.
@functools.lru_cache(maxsize=16)
def _compiled(template: str):
    return _environment().from_string(template)


@functools.cache
def _environment():
    import jinja2.ext

    env = bounded_sandbox()(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols],
                             finalize=written_value)
    env.filters["tojson"] = _tojson
    env.filters.update({name: bounded_filter(name, f) for name, f in env.filters.items()})
    del env.globals["lipsum"]  # it writes as many paragraphs as asked; no chat template uses it
    env.globals.update(raise_exception=_refuse, strftime_now=lambda fmt: datetime.now().strftime(fmt))
    return env


def _template_line(err: BaseException) -> int | None:
    """The line of the template where ``err`` was raised (jinja2 puts the template's lines in the traceback)."""
    line, trace = getattr(err, "lineno", None), err.__traceback__
    while trace is not None:
        if trace.tb_frame.f_code.co_filename == "<template>":
            line = trace.tb_lineno
        trace = trace.tb_next
    return line


def _one_line(err: BaseException, most: int = 300) -> str:
    """``err``'s message in one line of at most about ``most`` characters."""
    if isinstance(err, MemoryError):
        return "it runs out of memory"
    if isinstance(err, RecursionError):
        return "it nests too deeply (past Python's recursion limit)"
    text = " ".join(str(err).split())
    if type(err).__module__ == "builtins" or not text:  # Python's errors are named: "TypeError: ..."
        text = f"{type(err).__name__}: {text}".rstrip(": ")
    return text if len(text) <= most else text[:most] + "..."


__all__ = ["MAX_CALL_DEPTH", "MAX_RENDERED_CHARS", "MAX_TEMPLATE_BYTES", "MAX_TRAINING_MESSAGES",
           "SMOLLM2_SYSTEM_PROMPT", "TRAINING_ROLES", "WORK_FACTOR", "chat_prompt", "chat_training_ids",
           "check_messages", "check_template", "render_chat", "template_tokens"]
