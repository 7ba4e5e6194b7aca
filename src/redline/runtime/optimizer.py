"""Building the user's optimizer, and rebuilding it with another implementation."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from redline.config import call_refused
from redline.errors import ConfigError, few, invalid
from redline.plan.optimizer import scheduled

# The factory gets ``model.parameters()``: one typed ``(params: Iterator[nn.Parameter])`` or ``Iterable[...]`` fits
OptimizerLike = torch.optim.Optimizer | Callable[[Iterator[nn.Parameter]], torch.optim.Optimizer]
_FACTORY = "`lambda params: torch.optim.AdamW(params, lr=1e-3)`"


def build_optimizer(optimizer: OptimizerLike, model: nn.Module) -> torch.optim.Optimizer:
    """Return ``optimizer`` as an instance: built from a factory ``params -> Optimizer`` if need be."""
    if isinstance(optimizer, torch.optim.Optimizer):
        _check_params(optimizer, model)
        check_no_closure(optimizer)
        return optimizer
    if not callable(optimizer):
        raise invalid("optimizer", type(optimizer).__name__, "an Optimizer or a factory params -> Optimizer")
    if why := call_refused(optimizer, 1):  # called below, its TypeError would point at this line
        raise invalid("optimizer", type(optimizer).__name__, "a factory params -> Optimizer", f"{why}; e.g. {_FACTORY}")
    built = optimizer(model.parameters())
    if not isinstance(built, torch.optim.Optimizer):
        raise ConfigError(
            f"the optimizer factory returned {type(built).__name__} {built!r:.60}, not a torch.optim.Optimizer\nhint: "
            f"build one on the parameters it is given, e.g. {_FACTORY}"
        )
    _check_params(built, model, factory=True)
    check_no_closure(built)
    return built


def check_no_closure(optimizer: torch.optim.Optimizer) -> None:
    """Refuse an optimizer whose ``step`` needs a closure (torch.optim.LBFGS): redline steps once per batch.

    Such an optimizer evaluates the loss and gradients itself, several times a step, through the
    closure; the Runtime's ``step(optimizer)`` and the Trainer run forward and backward once per
    batch and then step, and torch's grad scaler (fp16) takes no closure at all.
    """
    try:
        closure = inspect.signature(type(optimizer).step).parameters.get("closure")
    except (TypeError, ValueError):  # a step without a signature to read: let it run
        return
    if closure is None or closure.default is not inspect.Parameter.empty:
        return
    name = type(optimizer).__name__
    raise ConfigError(
        f"{name}.step() needs a closure that re-evaluates the loss (it calls it several times a step), and redline "
        "steps an optimizer once per batch, after one forward and backward\n"
        f"hint: use an optimizer that steps without a closure (torch.optim.AdamW, SGD, ...); to train with {name}, "
        "write the loop yourself and call optimizer.step(closure) there, without Runtime.step or the Trainer"
    )


def check_materialized(model: nn.Module) -> None:
    """Refuse a model whose tensors are on the meta device: shapes without data, which no device move can fill."""
    empty = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if empty:
        raise ConfigError(
            f"the model's ({type(model).__name__}) tensors {few(empty, 4)} are on the meta device: shapes with no "
            "data, which setup cannot move to the device\nhint: build the model without torch.device('meta'), or "
            "load its weights first: model.load_state_dict(weights, assign=True)"
        )


def check_trainable(model: nn.Module) -> None:
    """Refuse a model with nothing to train: no parameters, or none that requires a gradient."""
    params = list(model.parameters())
    name = type(model).__name__
    if not params:
        buffers = [buffer_name for buffer_name, _ in model.named_buffers()]
        if buffers:  # tensors it registered as state (register_buffer), which no optimizer steps
            fix = f"its tensors are buffers ({few(buffers, 3)}), which "
            fix += "are not trained: make the ones to learn nn.Parameter(...) instead of register_buffer(...)"
        else:
            fix = "make its layers attributes of the module (layers kept in a Python list are not registered: "
            fix += "use nn.ModuleList), and build them in __init__, not in forward"
        raise ConfigError(f"the model ({name}) has no parameters: there is nothing to train\nhint: {fix}")
    lazy = [n for n, p in model.named_parameters() if isinstance(p, nn.parameter.UninitializedParameter)]
    if lazy:
        raise ConfigError(
            f"the model's ({name}) parameters {few(lazy, 4)} are not initialized yet (a lazy module, nn.LazyLinear "
            "say): their shapes are needed to place, wrap and step them before the first batch\nhint: run one forward "
            "on a sample batch where the model is built (model(inputs)), or give the layer its input size"
        )
    if not any(p.requires_grad for p in params):
        raise ConfigError(
            f"none of the model's ({name}) {len(params)} parameter tensors requires a gradient: there is nothing "
            "to train\nhint: unfreeze the layers to train (param.requires_grad_(True))"
        )


def _check_params(optimizer: torch.optim.Optimizer, model: nn.Module, *, factory: bool = False) -> None:
    own = {id(p) for p in model.parameters()}
    for group in optimizer.param_groups:
        for param in group["params"]:
            if id(param) in own:
                continue
            if factory:  # `lambda params: AdamW(net.parameters())`: it would step another model, and this one never
                raise ConfigError(
                    "the optimizer factory built an optimizer over parameters that are not the model's: it did not use "
                    "the params it was given, and the model it steps is another one\nhint: build it from its argument, "
                    "e.g. `lambda params: torch.optim.AdamW(params, lr=1e-3)`"
                )
            raise ConfigError(
                "the optimizer holds a parameter that is not in the model passed with it\n"
                "hint: build the optimizer from this model's parameters, or pass a factory "
                "`lambda params: torch.optim.AdamW(params, lr=...)`"
            )


def check_stateless(optimizer: torch.optim.Optimizer, onto: str = "", *, scan: bool = True) -> None:
    """Refuse to rebuild an optimizer that has stepped (its moments would be lost) or that an LR scheduler holds.

    ``onto``: what it is rebuilt on. The scheduler would go on setting the learning rate of the optimizer
    it was built on, which no longer trains anything. ``scan=False``: the heap is not scanned for a scheduler
    (``scheduled``), for an optimizer a factory has just built.
    """
    if any(optimizer.state.values()):
        raise ConfigError(
            f"cannot rebuild {type(optimizer).__name__}{onto}: it already holds state\n"
            "hint: pass the optimizer before its first step, or as a factory"
        )
    if scheduled(optimizer, scan=scan):
        raise ConfigError(
            f"cannot rebuild {type(optimizer).__name__}{onto}: an LR scheduler was built on it, and would go on "
            "setting the learning rate of this optimizer, which the rebuilt one replaces\n"
            "hint: build the scheduler after setup, on the optimizer it returns: "
            "`model, optimizer = rt.setup(model, optimizer)`, then `scheduler = StepLR(optimizer, ...)`"
        )


# Where torch.optim.Optimizer keeps the hooks its register_*_hook methods add; torch offers no public way to list them.
_HOOKS = (
    "_optimizer_step_pre_hooks",
    "_optimizer_step_post_hooks",
    "_optimizer_state_dict_pre_hooks",
    "_optimizer_state_dict_post_hooks",
    "_optimizer_load_state_dict_pre_hooks",
    "_optimizer_load_state_dict_post_hooks",
)


def rebuild_optimizer(optimizer: torch.optim.Optimizer, *, scan: bool = True, **impl: Any) -> torch.optim.Optimizer:
    """Return a new optimizer of the same class, groups, hyperparameters and hooks, with ``impl`` changed.

    Only an optimizer that holds no state yet can be rebuilt without changing the run. Constructor
    arguments the optimizer keeps nowhere in its ``defaults`` are lost: pass a factory to keep them.
    ``scan=False``: one a factory has just built, which no LR scheduler can hold yet (a scan of the heap for one
    takes milliseconds to tens of them).
    """
    check_stateless(optimizer, scan=scan)
    rebuilt = same_kind(optimizer, [group["params"] for group in optimizer.param_groups], **impl)
    for name in _HOOKS:  # a post-step hook (an EMA update, a log) would otherwise stop running, silently
        hooks, into = getattr(optimizer, name, None), getattr(rebuilt, name, None)
        if hooks and into is not None:
            into.update(hooks)
    return rebuilt


def same_kind(optimizer: torch.optim.Optimizer, params: list[list[torch.Tensor]], **impl: Any) -> torch.optim.Optimizer:
    """A new optimizer of ``optimizer``'s class and hyperparameters over ``params`` (a list per parameter group, each
    group kept, an empty one too, as torch allows it), with ``impl`` changed, and none of its hooks."""
    paired = zip(optimizer.param_groups, params, strict=True)
    groups = [{**group, "params": kept, **impl} for group, kept in paired]
    defaults = {**optimizer.defaults, **impl}
    if impl.get("fused"):  # fused and foreach are exclusive
        for options in (defaults, *groups):
            if "foreach" in options:
                options["foreach"] = None
    # defaults may hold keys the constructor sets itself (AdamW's decoupled_weight_decay): pass only
    # the ones it takes; every group keeps all of its own keys.
    accepted = inspect.signature(type(optimizer).__init__).parameters
    return type(optimizer)(groups, **{k: v for k, v in defaults.items() if k in accepted})


# how an optimizer steps, not what it does: the Plan may choose them, and a checkpoint keeps no promise of them
_IMPLEMENTATION = frozenset({"params", "lr", "initial_lr", "foreach", "fused", "capturable", "differentiable"})


def group_options(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Each parameter group's options (lr, weight_decay, betas, ...) as plain values, taken as it is built: what
    a resumed run's optimizer is compared with the checkpoint's by (a schedule, or a loop's own decay, moves the
    lr of both later; the lr is ``initial_lr`` where a scheduler was built on it already)."""

    def plain(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return value.tolist()
        return tuple(plain(v) for v in value) if isinstance(value, (tuple, list)) else value

    groups = []
    for group in optimizer.param_groups:
        options = {"lr": plain(group.get("initial_lr", group.get("lr")))}
        options.update((key, plain(value)) for key, value in group.items() if key not in _IMPLEMENTATION)
        groups.append(options)
    return groups


def loaded_options(
    built: list[dict[str, Any]], saved: list[dict[str, Any]], loaded: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """The options an optimizer goes on with after loading a checkpoint's: the checkpoint's (``saved``), but for those
    it set back to this run's (``built``) as it loaded (``loaded``: ``group_options`` then), as AdamW sets its
    decoupled_weight_decay whatever an Adam's checkpoint held. The lr is the checkpoint's: a load restores it (a
    decay since may have brought it to this run's)."""
    options = []
    for i, kept in enumerate(saved):
        mine, now = built[i] if i < len(built) else {}, loaded[i] if i < len(loaded) else {}
        own = {k for k in kept if k != "lr" and k in mine and k in now and now[k] == mine[k] != kept[k]}
        options.append({k: now[k] if k in own else v for k, v in kept.items()})
    return options


def changed_options(before: list[dict[str, Any]], after: list[dict[str, Any]]) -> list[str]:
    """The options a load changed, each as "lr 0.1, the checkpoint's 0.003" (and its group, where there are several)."""
    changed = []
    for i, (now, kept) in enumerate(zip(before, after, strict=False)):
        where = f" (group {i})" if len(before) > 1 else ""
        changed += [
            f"{key} {now[key]}{where}, the checkpoint's {kept[key]}"
            for key in now
            if key in kept and now[key] != kept[key]
        ]
    return changed


def match_state_layout(optimizer: torch.optim.Optimizer) -> None:
    """Give each state tensor of its parameter's shape (a momentum, Adam's moments) the parameter's strides.

    torch's fused optimizers read a parameter, its gradient and its state as flat memory, so a state laid out
    otherwise, channels_last against an NCHW weight, is updated wrongly and without an error (fused SGD and Adam on
    a CPU; the for-loop and foreach kinds are right either way). A state takes another layout when it is loaded
    from a run laid out otherwise, or when the run lays its model out anew (runtime/layout.py). Sharded (DTensor)
    state is left as it is.
    """
    for param, state in optimizer.state.items():
        if type(param.data) is not torch.Tensor:
            continue
        for key, value in state.items():
            if (
                type(value) is torch.Tensor
                and value.layout == param.layout == torch.strided  # a sparse momentum (a sparse embedding's) as is
                and value.shape == param.shape
                and value.device == param.device  # a state kept elsewhere on purpose (offloaded) stays there
                and value.stride() != param.stride()
            ):
                state[key] = torch.empty_like(param, dtype=value.dtype).copy_(value)
