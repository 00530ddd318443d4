"""``qkv finetune``: the parser of the fine-tuning recipe (:mod:`qkv.recipes.finetune`)."""

from __future__ import annotations

import argparse

from .common import add_training_arguments, command, show_defaults
from .numbers import COUNT, FRACTION, POSITIVE, PROBABILITY, real


def add_commands(sub) -> None:
    from ..preference import OBJECTIVES
    from ..recipes.finetune import METHODS, FineTuneRecipe, FineTuneSettings

    p = command(sub, "finetune", FineTuneRecipe.summary)
    src = p.add_argument_group("model and data")
    src.add_argument("--pretrained", metavar="SRC",
                     help="the model to adapt: 'smollm2', a .gguf file, a Hugging Face folder, or a qkv language-"
                          "model run")
    src.add_argument("--data", nargs="+", metavar="FILE",
                     help="examples: .jsonl lines {\"messages\": [...]} (the loss on the assistant turns) or "
                          "{\"prompt\", \"completion\"}; any other file is plain text (continued pretraining); "
                          "preference pairs with --objective")
    src.add_argument("--valid-data", nargs="+", metavar="FILE", help="held-out examples (else --valid-fraction of "
                                                                      "--data)")
    src.add_argument("--valid-fraction", type=FRACTION, help="share of the examples held out for validation")
    src.add_argument("--context", type=COUNT, help="tokens a row of packed examples holds (longer examples are "
                                                   "dropped, and counted in the log)")
    src.add_argument("--packing", action=argparse.BooleanOptionalAction,
                     help="lay short examples end to end in full rows, each attending to itself only")
    src.add_argument("--adapter", metavar="DIR",
                     help="a LoRA adapter in PEFT's format (a supervised run's best/) merged into the base first: "
                          "preference tuning after supervised fine-tuning")
    objective = p.add_argument_group("objective")
    objective.add_argument("--objective", choices=("sft", *OBJECTIVES),
                           help="sft: imitate the answers; dpo, ipo, hinge (against a reference: the model before "
                                "this training), simpo, orpo (none): prefer the chosen of two answers, from .jsonl "
                                "lines {\"prompt\", \"chosen\", \"rejected\"} (texts or chat messages)")
    objective.add_argument("--beta", type=POSITIVE, help="the preference objective's beta (trl's; ORPO's lambda)")
    objective.add_argument("--gamma", type=real(), help="SimPO's target margin gamma (trl's simpo_gamma)")
    objective.add_argument("--precompute-ref", action=argparse.BooleanOptionalAction,
                           help="compute the reference's log-probabilities of every pair once before training and "
                                "keep them in the run (no reference forward pass a step; no frozen copy with --method "
                                "full)")
    method = p.add_argument_group("method")
    method.add_argument("--method", choices=METHODS,
                        help="lora: adapters on the float32 base; qlora: adapters on the base kept in 4 or 8 bits "
                             "as stored; full: every weight learns")
    method.add_argument("--rank", type=COUNT, help="LoRA rank r")
    method.add_argument("--alpha", type=POSITIVE, help="LoRA scale: the update is multiplied by alpha / r")
    method.add_argument("--lora-dropout", type=PROBABILITY, help="dropout on the adapters' input")
    method.add_argument("--rslora", action=argparse.BooleanOptionalAction,
                        help="rank-stabilised LoRA: scale by alpha / sqrt(r)")
    method.add_argument("--target-modules", nargs="+", metavar="NAME",
                        help="the projections adapted, by their Hugging Face names: q_proj, k_proj, v_proj, o_proj, "
                             "gate_proj, up_proj, down_proj (default: all of them)")
    method.add_argument("--checkpointing", action=argparse.BooleanOptionalAction,
                        help="activation checkpointing: recompute each layer in the backward pass (less memory, "
                             "about a third more compute)")
    method.add_argument("--fsdp", action=argparse.BooleanOptionalAction, default=None,
                        help="under torchrun, shard the weights, gradients and optimizer state across the processes "
                             "(FSDP2) instead of copying them into each (DDP); default: with --method full")
    add_training_arguments(p, batch=("--batch-size", "rows of packed examples per batch"))
    show_defaults(p, FineTuneSettings)
    p.set_defaults(run=FineTuneRecipe.main, command=FineTuneRecipe.command)
