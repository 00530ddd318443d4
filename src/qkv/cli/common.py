"""What the commands share: the parser class, the options of devices and of training recipes, placing a model
on its device, and reading sentences from arguments, a file or stdin."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys

from ..config import GATED_ACTIVATIONS
from ..options import DEFAULT_GROUP_SIZE, DEVICES, GROUP_SIZES, MODES, PRECISIONS
from ..tokenizers import utf8_checked
from .numbers import COUNT, NON_NEGATIVE, POSITIVE, PROBABILITY, SEED, integer, real

log = logging.getLogger("qkv")


class Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs) -> None:
        # No prefixes of options: `--max-minute 2` is a typo, not --max-minutes (subcommands' parsers are
        # made by this class too, so this holds for every parser of qkv)
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        """One line, not a usage dump: what was wrong and where to look."""
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def command(sub, name: str, summary: str) -> argparse.ArgumentParser:
    """A subcommand whose summary is both its line in ``qkv --help`` and the description in its own help."""
    return sub.add_parser(name, help=summary, description=summary[0].upper() + summary[1:] + ".")


# --- the options of training recipes (qkv.recipes) ------------------------------------------------------------

def show_defaults(parser: argparse.ArgumentParser, settings) -> None:
    """End each option's help with its default from ``settings``, a recipe's dataclass, where it has one and the
    help does not already say it: the defaults are written once, in the dataclass."""
    defaults = {f.name: f.default for f in dataclasses.fields(settings)}
    for action in parser._actions:
        value = defaults.get(action.dest)
        if value in (None, False) or "default" in (action.help or ""):
            continue
        shown = f"{value:g}" if isinstance(value, float) else value
        action.help = f"{action.help} (default {shown})" if action.help else f"(default {shown})"


def add_recipe_argument(p: argparse.ArgumentParser, recipes: dict[str, dict]) -> None:
    """``--recipe``: which set of defaults the run starts from (the first is the default); each one's settings are
    listed in the help, but for those it leaves to a rule (None), which their own option's help states."""
    lines = "; ".join(f"{name}: " + (" ".join(_typed(k, v) for k, v in values.items() if v is not None)
                                     or "the defaults shown")
                      for name, values in recipes.items())
    p.add_argument("--recipe", choices=list(recipes),
                   help=f"the defaults a run starts from, before the options typed ({lines}; default "
                        f"{next(iter(recipes))}; a resumed run keeps its own)")


def _typed(key: str, value) -> str:
    """How ``key=value`` would be typed on the command line."""
    flag = key.replace("_", "-")
    if isinstance(value, bool):
        return f"--{flag}" if value else f"--no-{flag}"
    return f"--{flag} {value:g}" if isinstance(value, float) else f"--{flag} {value}"


def add_size_arguments(group: argparse._ArgumentGroup) -> None:
    """The fields of a Transformer's size every trainer lets the command line override (the preset's otherwise)."""
    group.add_argument("--d-model", type=COUNT, help="width of every token vector")
    group.add_argument("--n-heads", type=COUNT, help="attention heads (they divide --d-model)")
    group.add_argument("--n-layers", type=COUNT)
    group.add_argument("--d-ff", type=COUNT, help="hidden width of the feed-forward network")
    group.add_argument("--dropout", type=PROBABILITY)


def add_ingredient_arguments(group: argparse._ArgumentGroup, *, activations: str) -> None:
    """The modern recipe's switches of a Transformer's blocks (``activations``: what the preset uses)."""
    group.add_argument("--activation", choices=["relu", "relu2", "gelu", "gelu_tanh", "silu", *GATED_ACTIVATIONS],
                       help=f"the feed-forward activation ({activations}); relu2 is ReLU squared")
    group.add_argument("--qk-norm", action=argparse.BooleanOptionalAction,
                       help="normalise each head's queries and keys before the scores (as Qwen3 does)")
    group.add_argument("--zero-init", action=argparse.BooleanOptionalAction,
                       help="start the projections into the residual stream (and an untied output layer) at zero")


def add_input_arguments(p: argparse.ArgumentParser, *, blank: str = "") -> None:
    """Sentences as arguments, else --input FILE, else stdin (see :func:`read_inputs`)."""
    p.add_argument("text", nargs="*", help="sentences (else --input FILE, else stdin)")
    p.add_argument("--input", help=f"file of sentences, one per line{blank}")


def add_device_arguments(p: argparse.ArgumentParser, *, quantize: bool = False) -> None:
    """``--device``, ``--precision`` (see :mod:`qkv.device`) and ``--compile``, for every command that runs a
    model; ``--quantize`` and ``--group-size`` (see :mod:`qkv.quantize`) for those that only run one."""
    group = p.add_argument_group("device")
    group.add_argument("--device", default="auto", help=f"{DEVICES} (default auto: a CUDA GPU when there is one)")
    group.add_argument("--precision", default="auto", choices=PRECISIONS,
                       help="matrix products in fp32, bf16 or fp16 autocast (default auto: bf16 on a GPU that has "
                            "it, fp32 on a CPU; fp16 on CUDA only)")
    group.add_argument("--threads", type=integer(1), metavar="N",
                       help="CPU threads (default: the cores this process may use that other programs leave idle)")
    group.add_argument("--compile", action="store_true",
                       help="torch.compile the model first: minutes of compiling, then faster steps (pays off on "
                            "GPUs, long runs and long outputs; on a CPU, decoding with --quantize)")
    if quantize:
        group.add_argument("--quantize", choices=MODES,
                           help="weights of the linear layers in 8 or 4 bits, on the CPU (default none; int4 for "
                                "--pretrained smollm2 on a CPU: 4x faster, perplexity within 0.2%%)")
        group.add_argument("--group-size", type=integer(1), choices=GROUP_SIZES,
                           help=f"with --quantize int4: inputs that share a scale and zero point (default "
                                f"{DEFAULT_GROUP_SIZE}; a pretrained model's are 32, as GGUF's blocks)")


def place(model, device, args: argparse.Namespace, *, quantize: str = "none", calibrate=None):
    """``model`` on ``device``, quantized as --quantize asks (else as ``quantize``, the model's own default, said
    on stderr), compiled when --compile asks: with dynamic shapes, so one graph serves every prompt length and
    every step of a growing KV cache. ``calibrate`` runs the model on :data:`qkv.quantize.CALIBRATION_TEXT`:
    given, int8 keeps each layer's outlier input columns in fp32 (see :mod:`qkv.quantize`)."""
    from ..huge_pages import into_huge_pages
    from ..quantize import DEFAULT_GROUP_SIZE, float_layers, input_magnitudes
    from ..quantize import quantize as quantize_weights

    mode = getattr(args, "quantize", None)
    if mode is None and device.type == "cpu" and quantize != "none":
        mode = quantize
        log.info("%s weights (this model's default on a CPU; --quantize none for fp32)", mode)
    magnitudes = input_magnitudes(model, calibrate) if mode == "int8" and calibrate is not None else None
    quantize_weights(model, mode or "none", group_size=getattr(args, "group_size", None) or DEFAULT_GROUP_SIZE,
                     magnitudes=magnitudes)
    if device.type == "cpu":  # float32 layers decode on all threads (products of a few rows: qkv.nn.linear)
        float_layers(model)
        into_huge_pages(model)  # the weights in 2 MB pages, read faster (qkv.huge_pages)
    model.to(device)
    if args.compile:
        import torch

        # An output layer that recomputes its largest outputs (qkv.quantize) finds them with a count known only
        # from the data: traced as such, not a graph break at every step.
        torch._dynamo.config.capture_dynamic_output_shape_ops = True
        model.compile(dynamic=True)  # in place: the module and its state dict stay as they are
    return model


def runtime(args: argparse.Namespace):
    """(device, precision, autocast context) of --device and --precision, checked before any model is loaded."""
    from ..device import autocast, prepare, resolve_device, resolve_precision

    device = resolve_device(args.device)
    precision = resolve_precision(args.precision, device)
    if getattr(args, "quantize", None) not in (None, "none") and device.type != "cpu":
        raise ValueError(f"--quantize {args.quantize} runs on the CPU's kernels; use --device cpu, or drop --quantize "
                         f"on {device}")
    _check_group_size(args)
    prepare(device)
    return device, precision, autocast(device, precision)


def _check_group_size(args: argparse.Namespace) -> None:
    """--group-size sets the groups of --quantize int4, and nothing else."""
    if getattr(args, "group_size", None) is not None and getattr(args, "quantize", None) != "int4":
        raise ValueError("--group-size sets the groups of --quantize int4; give it with --quantize int4, or drop it")


def add_training_arguments(p: argparse.ArgumentParser, *, batch: tuple[str, str], lr_help: str = "peak learning rate",
                           warmup_help: str = "warmup steps") -> argparse._ArgumentGroup:
    """The options every ``qkv train`` recipe shares: budget, batch, optimizer, schedule, checkpoints (their
    defaults: the recipe's settings, see :func:`show_defaults`).

    ``batch`` is the batch option's flag and what it counts (``("--batch-size", "windows per batch")``). Returns
    the group, for the recipe's own training options.
    """
    train = p.add_argument_group("training")
    train.add_argument("--out", required=True, help="run directory: checkpoints, log.csv, loss.png")
    train.add_argument("--resume", action="store_true", help="continue the run in --out exactly where it stopped")
    train.add_argument("--max-steps", type=COUNT)
    train.add_argument("--epochs", type=POSITIVE)
    train.add_argument("--max-minutes", type=POSITIVE,
                       help="wall-clock budget of the whole run, its final evaluation included (--resume counts the "
                            "minutes already trained)")
    flag, counts = batch
    train.add_argument(flag, type=COUNT, help=counts)
    train.add_argument("--accum", type=COUNT, help="batches per optimizer step (gradient accumulation)")
    train.add_argument("--optimizer", choices=["adamw", "muon"],
                       help="muon: Muon for the attention and feed-forward matrices, AdamW for the rest")
    train.add_argument("--lr", type=POSITIVE, help=lr_help)
    train.add_argument("--muon-lr", type=POSITIVE, help="Muon's peak learning rate (with --optimizer muon)")
    train.add_argument("--warmup", type=integer(0), help=warmup_help)
    train.add_argument("--schedule", choices=["cosine", "wsd", "inverse_sqrt", "constant"],
                       help="after warmup; cosine decays to --min-lr-ratio × --lr by the "
                            "end of --max-steps/--epochs or, without them, of --max-minutes; wsd holds --lr, then "
                            "falls in a straight line to the same floor over the last fifth")
    train.add_argument("--min-lr-ratio", type=real(0, 1),
                       help="cosine's and wsd's floor as a fraction of --lr")
    train.add_argument("--clip", type=NON_NEGATIVE, help="gradient-norm clipping (0 disables)")
    train.add_argument("--weight-decay", type=NON_NEGATIVE, help="decoupled weight decay (AdamW's and Muon's)")
    train.add_argument("--eval-every", type=COUNT,
                       help="steps between validations and checkpoints")
    train.add_argument("--eval-at-minutes", type=POSITIVE, nargs="+", metavar="M",
                       help="also validate (and checkpoint) when the run has trained this many minutes")
    train.add_argument("--seed", type=SEED, help="seeds the model's initialisation, the data order and dropout")
    train.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_device_arguments(p)
    return train


# --- files out ------------------------------------------------------------------------------------------------

def add_force_argument(p: argparse.ArgumentParser, options: str) -> None:
    """``--force``: replace the files that ``options`` name (else a name that exists is refused)."""
    p.add_argument("--force", action="store_true", help=f"replace the file {options} names if it exists (else an "
                                                         "existing file is refused)")


def check_new_file(path: str | None, option: str, force: bool) -> None:
    """Before any work: the file ``option`` names (None: not given) must not exist, unless ``force``; a folder is
    never replaced. What is written there replaces it whole (:func:`qkv.files.write_atomically`), never through a
    link.

    Raises:
        ValueError: ``path`` exists (a file, or a link even to nowhere) and not ``force``, or is a folder.
    """
    from pathlib import Path

    from ..files import quoted

    if path is None:
        return
    target, shown = Path(path), quoted(path, limit=1024)  # a path whole, as long as real ones are
    if target.is_dir() and not target.is_symlink():
        raise ValueError(f"{option} {shown} is a folder; give a file name")
    if (target.exists() or target.is_symlink()) and not force:
        raise ValueError(f"{option} {shown} exists; pass --force to replace it, or give another name")


# --- sentences in ---------------------------------------------------------------------------------------------

def read_inputs(texts: list[str], input_file: str | None, what: str, *, keep_blank: bool = False) -> list[str]:
    """Sentences from the arguments, else ``--input FILE``, else stdin, one per line (all read at once, so they
    are batched like a file's).

    ``keep_blank`` keeps every line as it is, so outputs stay line-aligned with the input (translation);
    otherwise lines are stripped and blank ones skipped.
    """
    from ..data import read_lines

    if texts and input_file:
        raise ValueError("give sentences as arguments or with --input, not both")
    if input_file:
        lines = read_lines(input_file)
    elif texts:
        lines = checked_arguments(texts)
    elif sys.stdin is not None and not sys.stdin.closed and not sys.stdin.isatty():
        lines = _read_stdin().splitlines()
    else:
        lines = []
    if not any(line.strip() for line in lines):
        raise ValueError(f"nothing to {what}: give sentences as arguments, with --input FILE, or on stdin")
    return lines if keep_blank else [line.strip() for line in lines if line.strip()]


def _read_stdin() -> str:
    """stdin as UTF-8, checked: Python's own decoding of stdin may pass bad bytes on as lone surrogates
    (``surrogateescape``), which the tokenizers then refuse without naming the line."""
    from ..data import decode_text

    buffer = getattr(sys.stdin, "buffer", None)
    return sys.stdin.read() if buffer is None else decode_text(buffer.read(), "stdin")


def checked_arguments(texts: list[str]) -> list[str]:
    """Sentences from the command line, each :func:`utf8_checked` with its number."""
    return [utf8_checked(text, f"sentence {number} of the arguments") for number, text in enumerate(texts, 1)]
