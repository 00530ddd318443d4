"""FSDP2 (qkv.sharding) in two Gloo processes against one process: each process's half of a batch gives, reduced
into the shards and gathered whole, the gradients of the whole batch in one process (Gloo's reduce-scatter sums
where FSDP asks for an average, pytorch #162338: a doubled gradient would fail here, where AdamW's updates,
blind to a gradient's scale, would not show it); the gathered weights are the state dict safetensors stores; whole
weights and optimizer moments scattered back into shards gather to themselves."""

import copy
import socket
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_model
from torch.nn import functional as F

from qkv.config import GPTConfig
from qkv.models import GPT

pytestmark = pytest.mark.slow  # two interpreters

WORLD, BATCH, LENGTH = 2, 4, 12


def _model() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=50, d_model=32, n_heads=4, n_layers=2, max_seq_len=16))  # tied: one table


def _loss_sum(model, ids):
    logits = model(ids[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten(), reduction="sum")


def _run(rank: int, port: int) -> None:
    from qkv.sharding import gathered, gathered_weights, scattered, shard

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        ids = torch.randint(0, 50, (BATCH, LENGTH), generator=torch.Generator().manual_seed(1))
        n = ids[:, 1:].numel()
        reference = _model()
        (_loss_sum(reference, ids) / n).backward()
        model = shard(copy.deepcopy(reference), "cpu")
        model.zero_grad(set_to_none=True)
        half = ids[rank * BATCH // WORLD : (rank + 1) * BATCH // WORLD]
        (_loss_sum(model, half) * WORLD / n).backward()  # as the Trainer scales it: the reduction averages
        for name, p in model.named_parameters():
            expected = dict(reference.named_parameters())[name].grad
            torch.testing.assert_close(gathered(p.grad), expected, atol=1e-6, rtol=1e-5, msg=name)

        weights = gathered_weights(model)
        with tempfile.TemporaryDirectory() as tmp:  # what safetensors writes of the unsharded model
            save_model(reference, f"{tmp}/model.safetensors")
            stored = load_file(f"{tmp}/model.safetensors")
        assert weights.keys() == stored.keys() and all(torch.equal(weights[k], stored[k]) for k in stored)

        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        optimizer.step()
        saved_weights, saved_moments = gathered_weights(model), gathered(optimizer.state_dict())
        assert saved_moments["state"][0]["exp_avg"].shape == next(reference.parameters()).shape
        fresh = shard(_model(), "cpu")
        fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
        scattered(fresh, fresh_optimizer, saved_weights, saved_moments)
        for name, tensor in gathered_weights(fresh).items():
            assert torch.equal(tensor, saved_weights[name]), name
        again = gathered(fresh_optimizer.state_dict())["state"]
        for i, moments in saved_moments["state"].items():
            for key, value in moments.items():
                assert torch.equal(again[i][key], value), (i, key)
        with pytest.raises(KeyError, match=r"do not fit the sharded model: lm_head\.weight differ"):
            renamed = {("tok_emb.weight" if k == "lm_head.weight" else k): v for k, v in saved_weights.items()}
            scattered(fresh, fresh_optimizer, renamed, saved_moments)
    finally:
        dist.destroy_process_group()


def test_two_sharded_processes_give_one_process_gradients_and_checkpoint():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_run, args=(port,), nprocs=WORLD, join=True)
