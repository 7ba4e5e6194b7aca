"""A model's repeated blocks: what FSDP shards one by one and activation checkpointing recomputes."""

from __future__ import annotations

from collections import Counter

from torch import nn


def find_blocks(model: nn.Module, *, layers: bool = False) -> list[tuple[str, nn.Module]]:
    """Return the model's repeated blocks with their names: the children of its largest repeated container.

    A candidate is an ``nn.ModuleList`` or ``nn.Sequential`` (the model itself included) whose children
    holding parameters number two or more and share one class; parameterless children (activations,
    dropout) are ignored. The largest candidate by parameter count wins. A candidate whose blocks share a
    parameter with each other or with the rest of the model is skipped: FSDP, which shards each block on
    its own, would hand the other user a sharded tensor. Blocks are modules with submodules (a
    transformer layer, a residual block): a single layer keeps nothing but its input for the backward,
    which is all a checkpoint keeps too. ``layers=True`` counts single layers as blocks as well (FSDP
    shards an ``nn.Sequential`` of ``nn.Linear`` layer by layer). Names are those of
    ``model.named_modules()``; a model with no candidate gives ``[]``.
    """
    uses = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    best: list[tuple[str, nn.Module]] = []
    best_size = 0
    for prefix, container in model.named_modules():
        if not isinstance(container, nn.ModuleList | nn.Sequential):
            continue
        blocks = [
            (f"{prefix}.{name}" if prefix else name, child)
            for name, child in container.named_children()
            if next(child.parameters(), None) is not None
        ]
        if len(blocks) < 2 or len({type(block) for _, block in blocks}) != 1:
            continue
        if not layers and next(blocks[0][1].children(), None) is None:
            continue
        if not all(_owns_its_parameters(block, uses) for _, block in blocks):
            continue
        size = sum(p.numel() for _, block in blocks for p in block.parameters())
        if size > best_size:
            best, best_size = blocks, size
    return best


def _owns_its_parameters(block: nn.Module, uses: Counter[int]) -> bool:
    inside = Counter(id(p) for _, p in block.named_parameters(remove_duplicate=False))
    return all(uses[key] == count for key, count in inside.items())
