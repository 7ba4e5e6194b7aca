"""Activation-checkpointing axis: whether the model's repeated blocks recompute their activations in backward."""

from __future__ import annotations

from redline.errors import ConfigError
from redline.plan import Choice, parse_switch

# A checkpointed block keeps only its input from the forward and runs its forward again in the
# backward: about one more forward of compute, 20-33% more per step (Korthikanti et al., "Reducing
# Activation Recomputation in Large Transformer Models", https://arxiv.org/abs/2205.05198). A run
# that fits without it pays that for nothing, so "auto" turns it on only when memory runs short.
COST = "about one more forward of compute"


def resolve_activation_checkpointing(
    requested: str | bool, *, blocks: int, short_of_memory: bool = False
) -> Choice[bool]:
    """Decide whether the ``blocks`` repeated blocks of the model recompute their activations in backward.

    ``short_of_memory`` is a fact the caller found: the out-of-memory recovery reached one sample per
    micro-batch, or an estimate says the batch does not fit.
    """
    value = parse_switch("activation_checkpointing", requested)
    if value is False:
        return Choice(False, "requested: every activation is kept for the backward")
    if value is True:
        if blocks == 0:
            raise ConfigError(
                "activation_checkpointing='on' needs repeated blocks (an nn.ModuleList or nn.Sequential of 2+ "
                "modules of one class, like a transformer's layers), and this model has none\n"
                "hint: wrap the parts of your forward you want recomputed in torch.utils.checkpoint.checkpoint("
                "fn, x, use_reentrant=False), and pass activation_checkpointing='off'"
            )
        return Choice(True, f"requested: {_recompute(blocks)}")
    if blocks == 0:
        return Choice(False, "auto: the model has no repeated blocks to recompute")
    if short_of_memory:
        return Choice(True, f"auto: memory runs short, so {_recompute(blocks)}")
    return Choice(False, f"auto: off while memory suffices; recomputing would cost {COST}")


def _recompute(blocks: int) -> str:
    said = f"{blocks} blocks recompute their" if blocks != 1 else "1 block recomputes its"
    return f"{said} activations in backward ({COST})"
