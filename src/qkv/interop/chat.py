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
  changes to what it is given). Blocks are trimmed as in every published template's intent
  (``trim_blocks``, ``lstrip_blocks``).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

SMOLLM2_SYSTEM_PROMPT = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def check_messages(messages: Sequence[Mapping[str, str]]) -> None:
    """Each message a dict with a string ``role`` and ``content``; a ValueError naming the first that is not."""
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or not all(isinstance(message.get(k), str) for k in ("role", "content")):
            raise ValueError(f"message {i} must be a dict with string 'role' and 'content', got {message!r}")


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


def render_chat(template: str, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = True,
                bos_token: str = "", eos_token: str = "") -> str:
    """A conversation laid out by a model's own Jinja chat template, run in ``jinja2``'s sandbox.

    The template sees ``messages``, ``add_generation_prompt``, ``bos_token`` and ``eos_token``, and may call
    ``raise_exception(text)`` (to refuse a conversation it cannot lay out), ``strftime_now(format)`` and the
    ``tojson`` filter, which is what published templates use.

    Args:
        template: the Jinja source.
        messages: ``{"role": ..., "content": text}`` in order.
        add_generation_prompt: end with the opening of an assistant turn.
        bos_token, eos_token: the tokenizer's begin/end-of-sequence token texts ("" where it has none).

    Returns:
        The prompt text.

    Raises:
        ValueError: a malformed message; a template that is not valid Jinja, fails while rendering, refuses the
            conversation, or reaches for what the sandbox forbids (each in one line).
    """
    import jinja2
    from jinja2.sandbox import SecurityError

    check_messages(messages)
    try:
        compiled = _environment().from_string(template)
        return compiled.render(messages=[dict(m) for m in messages], add_generation_prompt=add_generation_prompt,
                               bos_token=bos_token, eos_token=eos_token)
    except _Refused as err:
        raise ValueError(f"the model's chat template refuses this conversation: {err}") from None
    except SecurityError as err:
        raise ValueError(f"the model's chat template reaches for what a template may not "
                         f"({str(err).rstrip('.')}); it is not run") from None
    except jinja2.TemplateError as err:
        line = f" (line {err.lineno})" if getattr(err, "lineno", None) else ""
        raise ValueError(f"the model's chat template cannot be rendered{line}: {err}") from None


class _Refused(Exception):
    """Raised by a template's ``raise_exception``."""


def _refuse(message: str):
    raise _Refused(message)


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False, sort_keys: bool = False) -> str:
    """JSON as the templates expect it: not HTML-escaped (Jinja's own ``tojson`` escapes ``<`` and ``&``)."""
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


@functools.cache
def _environment():
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_refuse, strftime_now=lambda fmt: datetime.now().strftime(fmt))
    return env


__all__ = ["SMOLLM2_SYSTEM_PROMPT", "chat_prompt", "check_messages", "render_chat"]
