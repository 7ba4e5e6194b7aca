"""FSDP2: shard a model's parameters, gradients and optimizer state over the data-parallel ranks.

``shard`` applies ``fully_shard`` to each repeated block (the transformer layers), then to the
root, as the FSDP2 docs ask ("called bottom-up"; one all-gather and one reduce-scatter per block,
overlapped with compute): https://pytorch.org/docs/stable/distributed.fsdp.fully_shard.html.
Works on CPU over gloo (a "cpu" device mesh) as on CUDA over NCCL.
"""

from __future__ import annotations

import itertools
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from redline.errors import ConfigError, invalid
from redline.parallel.blocks import find_blocks
from redline.plan.precision import PRECISIONS, PrecisionName

try:  # public since torch 2.6
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
except ImportError:  # pragma: no cover - the private path of torch 2.4-2.5
    from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard

_PARAM_DTYPES = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}


def mixed_precision_policy(precision: PrecisionName) -> MixedPrecisionPolicy | None:
    """Return FSDP2's mixed-precision policy for a Runtime precision; ``None`` for fp32.

    The parameters are all-gathered and computed in bf16/fp16 while the sharded fp32 parameters stay
    the optimizer's master copy; gradients are reduced in fp32 so the mean over ranks loses nothing
    (MixedPrecisionPolicy's docstring).

    Keep the Runtime's autocast around the forward and the loss. The policy casts parameters and
    floating-point inputs at each sharded module's boundary, so every op inside runs in the low dtype,
    layer norms, softmax and the loss included; autocast is what keeps those in fp32 (its "autocast to
    float32" list: https://pytorch.org/docs/stable/amp.html#cuda-ops-that-can-autocast-to-float32), as on
    one device and under DDP. The two compose: a matmul on bf16 parameters runs in bf16 with no extra
    cast. Measured on a small GPT over 2 ranks: without autocast the loss itself is bf16 (it moves in
    steps of 0.03 near 4) and strayed 3e-2 from the fp32 run within 6 steps; with autocast it stayed
    within 2e-4 of it (DDP under autocast: 4e-4). (torchtitan turns autocast off under FSDP and casts its own
    loss to fp32; redline's loss functions are the user's.) For fp16, ``torch.amp.GradScaler`` works
    unchanged: DTensor all-reduces its found-inf flag, so an overflow on one rank skips the step on all.
    """
    if precision not in PRECISIONS:
        raise invalid("precision", precision, f"one of {', '.join(map(repr, PRECISIONS))}")
    dtype = _PARAM_DTYPES.get(precision)
    if dtype is None:
        return None
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)


def _default_mesh() -> DeviceMesh:
    """Return a 1-D device mesh over every rank of the default process group, on its device type.

    gloo gives a "cpu" mesh (FSDP2 then keeps the shards on the CPU); NCCL a "cuda" mesh on the
    current device, which the launcher must have set (``torch.cuda.set_device(local_rank)``).
    """
    if not dist.is_initialized():
        raise ConfigError(
            "FSDP needs a process group, and none is initialised\n"
            "hint: start the script with `redline launch` (or torchrun) and call "
            "torch.distributed.init_process_group first"
        )
    device_type = "cpu" if dist.get_backend() == "gloo" else "cuda"
    return init_device_mesh(device_type, (dist.get_world_size(),))


def shard(
    model: nn.Module, *, mesh: DeviceMesh | None = None, precision: PrecisionName, reshard: bool = True
) -> nn.Module:
    """Shard ``model`` in place with FSDP2: each repeated block, then the root; return it.

    Afterwards the model's parameters are new ``DTensor`` parameters: an optimizer built before must be
    rebuilt on them (the Runtime does). Tied weights stay tied when both users sit outside the
    repeated blocks (GPT's ``wte`` and ``lm_head``): they fall into the root's group.

    ``reshard``: free each block's gathered parameters after its forward and gather them again in
    the backward (the memory FSDP exists to save, for a second all-gather per block). Without it
    the blocks stay gathered from their forward to their backward, which saves nothing on one rank.
    """
    mesh = mesh if mesh is not None else _default_mesh()
    policy = mixed_precision_policy(precision) or MixedPrecisionPolicy()  # the default casts nothing
    # The blocks activation checkpointing recomputes, and single repeated layers too (an MLP's Linears).
    blocks = [block for _, block in find_blocks(model, layers=True)]
    for index, block in enumerate(blocks):
        # The last block is not resharded: its parameters are the first the backward needs; the root
        # keeps its own for the same reason. These are torchtitan's choices, and FSDP2's default for the root.
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard and index < len(blocks) - 1, mp_policy=policy)
    fully_shard(model, mesh=mesh, reshard_after_forward=False, mp_policy=policy)
    _prefetch_in_order(blocks)
    return model


def _prefetch_in_order(blocks: list[nn.Module]) -> None:
    """Have each block's forward start the next block's all-gather before its own compute is issued.

    FSDP2 overlaps an all-gather with the compute issued before it; when the host is the bottleneck
    (small blocks, many kernels) issuing the next all-gather first keeps the device fed. This needs
    a fixed order of blocks, which the children of one container have
    (https://pytorch.org/docs/stable/notes/fsdp.html#fsdp-prefetch-nuances). The backward already
    prefetches in the reverse order of the forward.
    """
    for block, after in itertools.pairwise(blocks):
        setter = getattr(block, "set_modules_to_forward_prefetch", None)  # torch >= 2.5
        if setter is not None:
            setter([after])


def full_weights(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Gather a sharded model's whole weights onto rank 0's CPU; collective: every rank calls it.

    Returns, on rank 0, the weights under the unwrapped model's names with a tied weight once, and
    ``{dropped alias: kept name}``; empty dicts on the other ranks. The kept name is the first of a
    tied weight's names in sorted order, as safetensors' ``save_model`` keeps (and notes the alias
    in the file's metadata the same way), so the file loads with ``load_model`` into the plain model.
    """
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = cast(dict[str, torch.Tensor], get_model_state_dict(model, options=options))  # plain CPU tensors
    aliases: dict[str, str] = {}
    for group in _names_by_parameter(model):
        kept, *dropped = sorted(group)
        for alias in dropped:
            if state.pop(alias, None) is not None:
                aliases[alias] = kept
    return state, aliases


# How an optimizer runs, not what it learnt: this run's choice (the Plan's), never the checkpoint's.
_IMPLEMENTATION_KEYS = ("fused", "foreach", "capturable", "differentiable")


def full_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    weights: dict[str, torch.Tensor],
    optimizer_state: dict[str, Any],
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Return whole weights and an unsharded optimizer's ``state_dict()`` as ``set_state_dict`` takes them.

    ``weights`` holds a tied weight under one of its names (as safetensors writes it) and must fit the
    model exactly; ``optimizer_state`` numbers parameters in the order of the optimizer's groups, which
    is the order of the sharded optimizer's groups when both were built by the same factory. The
    optimizer state is keyed by parameter name, with this run's implementation flags kept.
    """
    full: dict[str, Any] = dict(weights)
    for group in _names_by_parameter(model):
        present = [name for name in group if name in weights]
        if present:
            full.update(dict.fromkeys(group, weights[present[0]]))
    expected = set(model.state_dict())
    missing, unexpected = sorted(expected - full.keys()), sorted(full.keys() - expected)
    if missing or unexpected:
        raise ConfigError(
            f"the checkpoint's weights do not fit this model: missing {missing[:5]}, unexpected {unexpected[:5]}\n"
            "hint: resume with the model (and task options) the checkpoint was written by"
        )
    first = {id(param): name for name, param in model.named_parameters()}
    order = [first[id(param)] for group in optimizer.param_groups for param in group["params"]]
    saved = [len(group["params"]) for group in optimizer_state["param_groups"]]
    if saved != [len(group["params"]) for group in optimizer.param_groups]:
        raise ConfigError(
            f"the checkpoint's optimizer groups hold {saved} parameters, this run's "
            f"{[len(group['params']) for group in optimizer.param_groups]}\n"
            "hint: resume with the optimizer the checkpoint was written with"
        )
    groups = []
    for group, live in zip(optimizer_state["param_groups"], optimizer.param_groups, strict=True):
        kept = {key: live[key] for key in _IMPLEMENTATION_KEYS if key in live}
        groups.append({**group, **kept, "params": [order[i] for i in group["params"]]})
    state = {order[i]: v for i, v in optimizer_state["state"].items()}
    return full, {"state": state, "param_groups": groups}


def load_full_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    model_state: dict[str, Any],
    optimizer_state: dict[str, Any],
) -> None:
    """Load whole states (``full_state``'s, on rank 0; empty dicts elsewhere) into a sharded model and optimizer.

    Collective. Rank 0 alone holds the whole state in host memory and broadcasts it; each rank keeps
    its own pieces (``broadcast_from_rank0``), so a model that fits a node once loads on eight ranks.
    """
    # One call each: set_state_dict treats an empty model state (the other ranks') as "optimizer only"
    # and skips the model's broadcast there, while rank 0 waits in it (torch 2.13).
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, model_state, options=options)
    set_optimizer_state_dict(model, optimizer, optimizer_state, options=options)


def _names_by_parameter(model: nn.Module) -> list[list[str]]:
    """Return each parameter's names (a tied one has several), in the model's order."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return list(names.values())
