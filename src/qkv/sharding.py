"""Fully sharded data parallel training (FSDP2): each of N processes keeps 1/N of every weight, of its gradient
and of the optimizer's moments, where DDP keeps all of them in each.

    torchrun --nproc_per_node 2 -m qkv.cli finetune --method full --pretrained smollm2 --data chat.jsonl --out run

PyTorch's :func:`torch.distributed.fsdp.fully_shard` does the work: a layer's weights are gathered whole just
before its forward (and again before its backward), its gradients reduced and scattered back to their shards
right after. Each layer of a stack (every ``nn.ModuleList``'s items) is one such unit, and the model itself the
last (embeddings, final norm, output head), so a process holds one layer whole at a time beside its shards.

Sharded weights are :class:`~torch.distributed.tensor.DTensor` s. What leaves the processes — a checkpoint — is
whole: :func:`gathered` assembles every shard on each process (a collective: every rank calls it), rank 0 writes;
:func:`scattered` cuts whole tensors read from a checkpoint back into this process's shards. A sharded run's
checkpoint is therefore the file a one-process or DDP run writes, and any of them resumes any other.

Gloo (the CPU's backend) has summed where FSDP asks its reduce-scatter for an average (pytorch #162338): the
reduction is asked for as a sum, then divided by the world size (:func:`shard`).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model`` was sharded by :func:`shard`."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def unsharded_class(model: nn.Module) -> type:
    """The class ``model`` had before :func:`shard` (``fully_shard`` gives it a subclass of its own)."""
    from torch.distributed.fsdp import FSDPModule

    cls = type(model)
    return next(base for base in cls.__bases__ if base is not FSDPModule) if is_sharded(model) else cls


def shard(model: nn.Module, device_type: str) -> nn.Module:
    """Shard ``model`` in place across the processes of the default group: each layer of each stack, then the
    rest. Build the optimizer afterwards: its parameters are the shards."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    if not hasattr(FSDPModule, "set_force_sum_reduction_for_comms"):
        raise RuntimeError("sharded training needs a newer PyTorch (FSDP2 as in torch 2.13): pip install -U torch, "
                           "or train with --no-fsdp")
    # a sharded module's output that is a view warns of in-place changes: qkv's losses make none
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    mesh = init_device_mesh(device_type, (dist.get_world_size(),))
    for stack in [m for m in model.modules() if isinstance(m, nn.ModuleList)]:
        for layer in stack:
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if dist.get_backend() == "gloo":  # its reduce-scatter has summed when asked to average (pytorch #162338)
        model.set_force_sum_reduction_for_comms(True)  # a sum, then FSDP's own division by the world size
    return model


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This process's shard of ``tensor`` (the tensor itself if it is not sharded)."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def gathered(value: Any) -> Any:
    """``value`` (a tensor, or dicts and lists of them) with every sharded tensor made whole, on the CPU. A
    collective: every process calls it, in the same order."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return value.full_tensor().cpu()
    if isinstance(value, dict):
        return {k: gathered(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(gathered(v) for v in value)
    return value


def gathered_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The sharded model's state dict, whole; a tensor tied to another (an output head sharing the embedding
    table) appears once, as ``safetensors`` stores it."""
    state = model.state_dict(keep_vars=True)
    return {name: gathered(state[name].detach()) for name in _first_names(state)}


def _first_names(state: dict[str, torch.Tensor]) -> list[str]:
    """The names of ``state`` with one name per tensor: of tied names, the first in alphabetical order, as
    ``safetensors`` keeps them (so a sharded run's file is a one-process run's)."""
    first: dict[int, str] = {}
    for name in sorted(state):
        first.setdefault(id(state[name]), name)
    return [name for name, t in state.items() if first[id(t)] == name]


def scattered(model: nn.Module, optimizer: torch.optim.Optimizer, weights: dict[str, torch.Tensor],
              optimizer_state: dict[str, Any]) -> None:
    """Load whole ``weights`` and a whole ``optimizer_state`` (as ``optimizer.state_dict()`` of an unsharded
    run) into the sharded ``model`` and its ``optimizer``: each process keeps its own shards."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    def like(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
        if not isinstance(param, DTensor) or full.shape != param.shape:
            return full
        return distribute_tensor(full.to(param.device, param.dtype), param.device_mesh, param.placements)

    params = dict(model.named_parameters(remove_duplicate=False))
    state = model.state_dict(keep_vars=True)
    differ = (set(_first_names(state)) - set(weights)) | (set(weights) - set(state))
    if differ:
        raise KeyError(f"the weights do not fit the sharded model: {', '.join(sorted(differ)[:3])} differ")
    model.load_state_dict({name: like(t, params[name]) if name in params else t for name, t in weights.items()},
                          strict=False)  # a tied weight's second name is loaded through its first
    order = [p for group in optimizer.param_groups for p in group["params"]]
    state = {i: {k: like(v, order[i]) if torch.is_tensor(v) else v for k, v in moments.items()}
             for i, moments in optimizer_state["state"].items()}
    optimizer.load_state_dict({**optimizer_state, "state": state})
