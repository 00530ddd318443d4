"""``qkv serve``: a language model behind OpenAI's HTTP API (see :mod:`qkv.serve`).

    qkv serve --pretrained smollm2                           # http://127.0.0.1:8000/v1
    qkv serve --model runs/lm --port 0                       # any free port
    qkv serve --pretrained model.gguf --host 0.0.0.0 --api-key "$KEY"
    qkv serve --pretrained minilm                            # sentence vectors on /v1/embeddings
"""

from __future__ import annotations

import argparse

from ..files import quoted
from ..serve.protocol import REPLY_TOKENS, ROWS
from .common import add_device_arguments, command, place, runtime
from .explore import LOCAL_HOSTS
from .lm import add_draft_arguments
from .numbers import integer


def serve_cmd(args: argparse.Namespace) -> None:
    if args.host not in LOCAL_HOSTS and not args.api_key:
        raise ValueError(f"--host {args.host} lets other machines in: give --api-key KEY (clients send it as their "
                         "API key), or serve on 127.0.0.1")
    if args.api_key is not None and len(args.api_key) < 16:
        raise ValueError("--api-key must be at least 16 characters (e.g. python -c \"import secrets; "
                         "print(secrets.token_urlsafe())\")")
    if args.compile:
        raise ValueError("--compile does not suit qkv serve: its batch changes size and shape at every request, "
                         "which would compile again each time; leave --compile out")
    if args.name is not None and not (args.name.strip() and args.name.isprintable() and len(args.name) <= 256):
        raise ValueError(f"--name must be a printable name of 1 to 256 characters, got {quoted(args.name)}")
    if bool(args.model) == bool(args.pretrained):
        raise ValueError("give one model: --model DIR (trained with qkv) or --pretrained smollm2|minilm|FILE|DIR")
    try:
        from ..serve.app import serve
    except ModuleNotFoundError as err:
        raise ValueError(f"qkv serve needs {err.name}: pip install 'qkv[serve]'") from None
    device, precision, amp = runtime(args)
    name = args.name or _name(args)
    encoder = _is_encoder(args)
    serve(lambda: _embedder(args, device, name) if encoder else _engine(args, device, precision, amp, name),
          host=args.host, port=args.port, api_key=args.api_key)


def _is_encoder(args: argparse.Namespace) -> bool:
    """Whether the model is a sentence encoder (MiniLM, a Hugging Face BERT folder, a qkv BERT run), served for
    /v1/embeddings, rather than a language model."""
    from pathlib import Path

    from ..interop.sentence import MINILM_NAMES

    if args.pretrained:
        return args.pretrained.lower() in MINILM_NAMES or _config(Path(args.pretrained)).get("model_type") == "bert"
    from ..checkpoint import resolve

    return _config(resolve(args.model)).get("arch") not in ("gpt", None)


def _config(folder) -> dict:
    """A folder's config.json ({} where there is none)."""
    import json

    path = folder / "config.json"
    config = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    return config if isinstance(config, dict) else {}


def _engine(args: argparse.Namespace, device, precision, amp, name: str):
    from ..serve.engine import Engine
    from .lm import load_lm, load_speculation

    model, tokenizer, stops, template = load_lm(args, device, precision)
    return Engine(model, tokenizer, name=name, stop_ids=stops, chat_template=template, rows=args.parallel,
                  max_tokens=args.max_tokens, autocast=amp,
                  speculation=load_speculation(args, tokenizer, device, precision))


def _embedder(args: argparse.Namespace, device, name: str):
    from ..interop.sentence import load_sentence_encoder
    from ..serve.embedder import Embedder

    if args.adapter:
        raise ValueError("--adapter goes on a language model; this is a sentence encoder")
    encoder = load_sentence_encoder(args.pretrained or args.model)
    place(encoder.model, device, args)
    return Embedder(encoder, name=name)


def _name(args: argparse.Namespace) -> str:
    """The name clients call the model by: --pretrained as given, or the run's folder name."""
    from pathlib import Path

    return args.pretrained or Path(args.model).resolve().name


def add_commands(sub) -> None:
    p = command(sub, "serve", "serve a model over OpenAI's HTTP API (chat and completions, streamed; embeddings)")
    src = p.add_argument_group("model (one of)")
    src.add_argument("--model", help="a qkv language-model checkpoint or run directory (uses best/)")
    src.add_argument("--pretrained", help="'smollm2', a .gguf file or a local Hugging Face folder (as qkv generate); "
                                          "'minilm' or a BERT folder: a sentence encoder, for /v1/embeddings")
    src.add_argument("--adapter", metavar="DIR", help="a LoRA adapter in PEFT's format to run on the model")
    net = p.add_argument_group("server")
    net.add_argument("--name", help="the model's name in requests and /v1/models (default: --pretrained as given, "
                                    "or the run's folder name)")
    net.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine "
                                                         "only; another needs --api-key)")
    net.add_argument("--port", type=integer(0, 65535), default=8000, help="port (default 8000; 0: any free one)")
    net.add_argument("--api-key", help="a bearer token every request must send (required off this machine)")
    net.add_argument("--parallel", "-np", type=integer(1, 256), default=ROWS,
                     help=f"sequences decoded together; more requests wait their turn (default {ROWS})")
    net.add_argument("--max-tokens", type=integer(1), default=REPLY_TOKENS,
                     help=f"the tokens a reply may take when its request gives no max_tokens (default {REPLY_TOKENS}; "
                          "a completion's default is 16, as OpenAI's)")
    add_draft_arguments(p)
    add_device_arguments(p, quantize=True)
    p.set_defaults(run=serve_cmd)
