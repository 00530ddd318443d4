"""``qkv finetune``: adapt a pretrained language model to a user's own examples.

Three methods (``--method``):

* **lora** (the default): the base model in float32, frozen; a LoRA adapter (:mod:`qkv.lora`) on every attention
  and feed-forward projection learns. The run's checkpoints hold the adapters alone, in PEFT's format, and name
  the base by its source and a fingerprint of its files.
* **qlora**: the same adapters on the base as it is held at rest, 4 or 8 bits a weight (a GGUF file's own
  formats, a Hugging Face folder's weights at int4): the gradient flows through the quantized products
  (:class:`qkv.quantized.QuantizedLinear`), and the float32 model never exists.
* **full**: every weight learns; the checkpoints hold the whole model, as ``qkv train lm``'s do.

The data (:mod:`qkv.tasks.finetune`): chat JSONL, prompt/completion JSONL, or plain text; packed into rows of
``--context`` tokens. Without ``--valid-data`` a ``--valid-fraction`` of the examples is held out.

What is learnt (``--objective``): ``sft`` (the default) imitates the answers; ``dpo``, ``ipo``, ``hinge``, ``simpo``
and ``orpo`` learn from preference pairs (:mod:`qkv.preference`, :mod:`qkv.tasks.preference`) which of two answers
to prefer. The first three compare with a reference model, the model before this training: with adapters, the same
model with its adapters off (no copy); with ``--method full``, a frozen copy, or with ``--precompute-ref`` (any
method) the reference's log-probabilities of every pair computed once before the first step and kept in the run
(``reference_logps.safetensors``), so a resumed run reads them back.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from .base import Recipe
from .settings import TrainingSettings

log = logging.getLogger("qkv")

METHODS = ("lora", "qlora", "full")
REFERENCE_FILE = "reference_logps.safetensors"  # a run's precomputed reference log-probabilities


@dataclass
class FineTuneSettings(TrainingSettings):
    pretrained: str | None = None
    data: list[str] | None = None
    valid_data: list[str] | None = None
    valid_fraction: float = 0.05
    method: str = "lora"
    objective: str = "sft"
    beta: float = 0.1  # the preference objectives' β (trl's default)
    gamma: float = 0.5  # SimPO's target margin γ (trl's simpo_gamma)
    precompute_ref: bool = False
    adapter: str | None = None  # a LoRA adapter merged into the base first (a supervised run's, before DPO)
    rank: int = 8
    alpha: float = 16.0
    lora_dropout: float = 0.0
    rslora: bool = False
    target_modules: list[str] | None = None  # None: every attention and feed-forward projection
    context: int = 512
    batch_size: int = 4
    packing: bool = True
    checkpointing: bool = False
    lr: float | None = 2e-4  # LoRA's usual rate; full fine-tuning: 2e-5
    warmup: int = 10
    schedule: str = "cosine"
    weight_decay: float = 0.0
    eval_every: int = 100


def _check_base(source: str, *, resumed: bool) -> None:
    """The base model must be there before its files are fingerprinted: a path typed wrong, or (``resumed``) the
    base a run was started from and that has since been moved or deleted, is said in one line."""
    from pathlib import Path

    from ..files import quoted

    if source == "smollm2" or Path(source).exists():
        return
    shown = quoted(source, limit=1024)  # a path whole, as long as real ones are
    if resumed:
        raise ValueError(f"this run's base model {shown} is gone (no such file or folder): put it back where it was "
                         "to --resume the run")
    raise ValueError(f"--pretrained {shown}: no such file or folder; give 'smollm2', a .gguf file, a Hugging Face "
                     "model folder or a qkv run")


def base_weights(method: str, source: str) -> str:
    """How the base model's weights are held: float32 to train them or to adapt them (lora, full); for qlora as
    they are stored, a GGUF file's formats kept, a folder's or a qkv run's quantized to int4."""
    from pathlib import Path

    if method != "qlora":
        return "none"
    return "int4" if Path(source).is_dir() else "auto"


class FineTuneRecipe(Recipe):
    name, command, summary = "finetune", "finetune", "fine-tune a pretrained language model on your own data"
    Settings = FineTuneSettings
    paths = ("data", "valid_data")
    betas = (0.9, 0.999)

    def prepare(self) -> None:
        from pathlib import Path

        pretrained = self.args.pretrained
        if pretrained and pretrained != "smollm2" and Path(pretrained).exists():
            self.args.pretrained = str(Path(pretrained).resolve())  # stored absolute: --resume from anywhere
        if getattr(self.args, "adapter", None) and Path(self.args.adapter).exists():
            self.args.adapter = str(Path(self.args.adapter).resolve())

    def setup(self) -> None:
        from ..device import map_large_blocks
        from ..footprint import check_training
        from ..lora import LoRAConfig, add_lora, layout_of
        from ..models.common import compile_blocks
        from ..trained import fingerprint

        s = self.s
        if not s.pretrained or not s.data:
            raise ValueError("give the model to fine-tune and its data: --pretrained SRC --data FILE")
        if s.method not in METHODS:
            raise ValueError(f"--method must be one of {', '.join(METHODS)}, got {s.method!r}")
        lora = None if s.method == "full" else LoRAConfig(
            rank=s.rank, alpha=s.alpha, dropout=s.lora_dropout, rslora=s.rslora,
            targets=tuple(s.target_modules) if s.target_modules else LoRAConfig.targets)
        _check_base(s.pretrained, resumed=self.args.resume)
        weights = base_weights(s.method, s.pretrained)
        if s.method == "qlora" and self.runtime.device.type == "cpu":
            map_large_blocks()  # QLoRA is chosen for its memory: peaks near what a step uses (qkv.device)
        self.base_record = {"source": s.pretrained, "weights": weights, "fingerprint": fingerprint(s.pretrained)}
        if s.adapter:
            self.base_record["adapter"] = str(s.adapter)
        self.reference = self._reference_kind()
        if self.args.resume and lora is None:  # full fine-tuning resumes its own weights, template included
            previous = self.resumed()
            self.model, self.tokenizer = previous.model, previous.tokenizers["text"]
            template = previous.meta.get("chat_template")
            if self.reference == "copy":  # the model before its first step, not the resumed one
                self.reference = self._base(weights).model.requires_grad_(False).eval()
        else:
            pre = self._base(weights)
            self.model, self.tokenizer, template = pre.model, pre.tokenizer, pre.chat_template
            if self.reference == "copy":
                import copy

                self.reference = copy.deepcopy(self.model).requires_grad_(False).eval()
        self.template = template
        context = min(s.context, self.model.config.max_seq_len)
        self.train, self.valid = self._data(context) if s.objective == "sft" else self._pairs(context)
        self.context = context
        if lora is not None:
            try:
                layout_of(self.model)  # adapters are placed (and saved) by Hugging Face's names
            except ValueError as err:
                raise ValueError(f"{err}; fine-tune {s.pretrained} with --method full") from None
            add_lora(self.model, lora)
        self.model.checkpointing = s.checkpointing
        if self.args.compile:
            compile_blocks(self.model, dynamic=True)  # one graph for every block and every length
        rows = context if s.objective == "sft" else 2 * context  # a row of pairs holds up to two answers each
        check_training(self.model, batch=s.batch_size, length=rows, checkpointing=s.checkpointing,
                       shards=self.runtime.group.world if self.options().fsdp else 1,
                       what=f"fine-tuning {s.pretrained} with --method {s.method}")

    def _base(self, weights: str):
        """The base model as fine-tuning starts from it: ``--pretrained``, with ``--adapter`` merged into it."""
        from ..trained import load_base

        pre = load_base(self.s.pretrained, weights=weights)
        if self.s.adapter:
            from ..adapters import load_peft_adapter
            from ..lora import merge_lora

            if self.s.method == "qlora":
                raise ValueError("--adapter merges an adapter into the float32 base; --method qlora keeps the base "
                                 "quantized: merge it first (qkv export --merge) or use --method lora")
            load_peft_adapter(pre.model, self.s.adapter)
            merge_lora(pre.model)
        return pre

    def _reference_kind(self) -> str | None:
        """Where a preference objective's reference comes from: None (sft, or reference-free), "precomputed",
        "adapters" (the model with its adapters off) or "copy" (a frozen copy, full fine-tuning)."""
        from ..preference import OBJECTIVES, REFERENCE_FREE

        s = self.s
        if s.objective != "sft" and s.objective not in OBJECTIVES:
            raise ValueError(f"--objective must be sft or one of {', '.join(OBJECTIVES)}, got {s.objective!r}")
        if s.objective == "sft" or s.objective in REFERENCE_FREE:
            if s.precompute_ref:
                raise ValueError(f"--precompute-ref: --objective {s.objective} has no reference model; drop it")
            return None
        if s.precompute_ref or (s.method == "full" and self.options().fsdp):
            return "precomputed"  # a sharded model's frozen copy would be sharded too: computed once instead
        return "copy" if s.method == "full" else "adapters"

    def _data(self, context: int):
        """Supervised examples: (training, validation)."""
        from ..tasks.finetune import fitting, held_out, read_examples, split_text

        s = self.s
        train = [e for path in s.data for e in read_examples(path, self.tokenizer, self.template)]
        train = fitting(split_text(train, context), context, ", ".join(s.data))
        if not s.valid_data:
            return held_out(train, s.valid_fraction, s.seed)
        valid = [e for path in s.valid_data for e in read_examples(path, self.tokenizer, self.template)]
        return train, fitting(split_text(valid, context), context, ", ".join(s.valid_data))

    def _pairs(self, context: int):
        """Preference pairs: (training, validation)."""
        from ..tasks.finetune import held_out
        from ..tasks.preference import fitting_pairs, read_pairs

        s = self.s
        train = [p for path in s.data for p in read_pairs(path, self.tokenizer, self.template, context=context)]
        train = fitting_pairs(train, context, ", ".join(s.data))
        if not s.valid_data:
            return held_out(train, s.valid_fraction, s.seed)
        valid = [p for path in s.valid_data for p in read_pairs(path, self.tokenizer, self.template, context=context)]
        return train, fitting_pairs(valid, context, ", ".join(s.valid_data))

    def options(self):
        """The Trainer's options: full fine-tuning shards the model across processes (FSDP) unless told not to;
        adapters (their base frozen, perhaps quantized) are copied into each (DDP). --compile is done in
        :meth:`setup`."""
        import dataclasses

        fsdp = self.args.fsdp if self.args.fsdp is not None else self.s.method == "full"
        if fsdp and self.s.method != "full":
            raise ValueError(f"--fsdp shards full fine-tuning only; --method {self.s.method} trains adapters, which "
                             "every process holds whole: drop --fsdp")
        # --compile compiles block by block (setup): the Trainer leaves the model as it is
        return dataclasses.replace(super().options(), fsdp=fsdp, compile=False)

    def task(self):
        from ..tasks.finetune import FineTuneTask

        s, model = self.s, self.model
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        total = sum(p.numel() for p in model.parameters())
        tokens = sum(len(e.ids) if s.objective == "sft" else e.tokens for e in self.train)
        what = "examples" if s.objective == "sft" else "pairs"
        log.info("fine-tuning %s (%s): %s of %s parameters learn; %d %s (%s tokens) for training, %d for "
                 "validation, context %d", s.pretrained, s.method, f"{trainable:,}", f"{total:,}", len(self.train),
                 what, f"{tokens:,}", len(self.valid), self.context)
        meta = self.meta(base=self.base_record, chat_template=self.template)
        if s.objective != "sft":
            from ..tasks.preference import PreferenceTask

            log.info("preference objective %s (beta %g%s), reference: %s", s.objective, s.beta,
                     f", gamma {s.gamma:g}" if s.objective == "simpo" else "",
                     {None: "none", "precomputed": f"computed once ({REFERENCE_FILE})", "adapters":
                      "the model with its adapters off"}.get(self.reference, "a frozen copy of the model"))
            return PreferenceTask(model, self.tokenizer, self.train, self.valid, objective=s.objective, beta=s.beta,
                                  gamma=s.gamma, reference=self.reference, store=self.out / REFERENCE_FILE,
                                  context=self.context, batch_size=s.batch_size, seed=s.seed, packed=s.packing,
                                  meta=meta)
        task = FineTuneTask(model, self.tokenizer, self.train, self.valid, context=self.context,
                            batch_size=s.batch_size, seed=s.seed, packed=s.packing, meta=meta)
        batches = task.batches(0)
        real, computed = sum(int((b.copies >= 0).sum()) for b in batches), sum(b.real.numel() for b in batches)
        if computed < real:
            log.info("examples that begin alike share those tokens' work: %s of an epoch's %s tokens are computed "
                     "(%.0f%%)", f"{computed:,}", f"{real:,}", 100 * computed / real)
        return task
