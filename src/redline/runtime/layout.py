"""The memory layout of a run's models and batches: channels_last where "auto" chose it, if the model can run so,
and following the precision the run's first steps switch to.

The rule (plan/layout.py) lays a convolutional model out channels_last for the precision it runs in: on a CPU
with AMX, bf16 convolutions want NHWC while fp32's gain nothing from it. Where the run's first steps switch
the precision (runtime/precision_check.py), the layout "auto" chose goes with it: timed in NCHW, bf16-mixed
ran the digits CNN 1.29-1.37x fp32 on such a CPU, and in NHWC 1.76-1.86x, so a check that timed bf16 in
fp32's layout would keep it at less than its speed, or miss it. The parameters, their gradients and the
optimizer's state of their shape are laid out anew between two optimizer steps, and so are the batches
the Runtime moves from then on.

A model can work in NCHW and fail in NHWC: ``x.view(len(x), -1)`` on a convolution's output, which old
tutorials write, cannot view NHWC memory. So "auto" checks its own pick: it lays a model out NHWC at the model's
first forward with autograd (a training step's, in eval mode too), and that forward and the first other forward (an
evaluation) it runs so each run once more before, on NHWC copies of their inputs (runtime/probe.py). A model whose
optimizer steps on gradients before any such forward is trained through other methods
(``model.decode(model.encode(x))``), which no check can run first: it stays NCHW, and the Plan says why. The
batches the Runtime moves are laid out NHWC once a model is, and no other still waits. Where a forward fails in NHWC
and NCHW runs, the model goes back to NCHW for the rest of the run, the Plan says why, the step goes on, and every
later forward of the model gets its 4-d inputs in NCHW (a batch moved before, a micro-batch cut from it, another
model's output: a convolution given one NHWC operand computes in NHWC). A layout given (``channels_last="on"``) is
not checked: the forward's own error says what failed. When the Runtime closes, the model keeps no hook of it: it
pickles and scripts as it did, a model "auto" laid out NHWC is laid back out NCHW (its outputs, saved weights and
the batches of the loaders set up in the run as they came; a layout given stays), and a copy (``copy.deepcopy``, an
EMA's) made during the run gets none of the check, nor the Runtime.
"""

from __future__ import annotations

import contextlib
import re
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from redline.errors import describe_error
from redline.hardware.device import DeviceFacts
from redline.plan import Choice, parse_switch
from redline.plan.layout import has_conv2d, resolve_channels_last
from redline.runtime.loading import DeviceLoader
from redline.runtime.oom import is_oom
from redline.runtime.optimizer import match_state_layout
from redline.runtime.probe import probe_forward
from redline.runtime.transfer import map_tensors, move_batch
from redline.runtime.weak_hook import WeakHook

TRAINING, OTHER = "training", "other"  # the kinds of forward checked apart: a path may run in one only
_LAID_FROM = re.compile(r": laid out so from step \d+, with [\w-]+$")  # what follow() adds to the rule's reason
NOT_FORWARD = (
    "its optimizer stepped on gradients before any forward of the model with autograd: the loop trains it through "
    "other methods (model.decode(model.encode(x))), which the check cannot run on NHWC copies first"
)


@dataclass
class _Laid:
    """How one set-up model is laid out."""

    channels_last: bool
    sharded: bool = False  # FSDP shards it: NCHW whatever the precision
    optimizer: torch.optim.Optimizer | None = None
    refused: str = ""  # why it runs NCHW where "auto" would lay it out NHWC: its forward failed so, or never ran
    pending: bool = False  # auto's NHWC, waiting for the model's first forward with autograd to be laid out, checked
    stepping: RemovableHandle | None = None  # while pending: its optimizer's step hook (a step with no forward)
    verified: set[str] = field(default_factory=set)  # the kinds of forward seen to run in NHWC
    hook: RemovableHandle | None = None  # the pre-hook that checks its forwards in NHWC
    nchw: RemovableHandle | None = None  # a refused model's: its inputs in NCHW
    outputs: RemovableHandle | None = None  # auto's NHWC model's: its 4-d outputs back in NCHW


class Layout:
    """Whether the set-up models and the batches the Runtime moves are channels_last, as the Plan's axis says.

    Where the run ``falls_back`` (in ``world_size`` processes), a model "auto" lays out channels_last runs its first
    forwards so on copies first, inside ``eagerly()`` (a compiled model's own forward: a forward without autograd
    would compile a graph of its own).
    """

    def __init__(
        self,
        facts: DeviceFacts,
        *,
        world_size: int = 1,
        eagerly: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
    ) -> None:
        self.facts, self.world_size, self.eagerly = facts, world_size, eagerly
        self.requested: str | bool = "auto"
        self.choice: Choice[bool] | None = None  # the layout now (None before a model is set up)
        self.planned: Choice[bool] | None = None  # the layout setup gave, for the precision the run began in
        self._loaders: weakref.WeakSet[DeviceLoader] = weakref.WeakSet()
        self._laid: weakref.WeakKeyDictionary[nn.Module, _Laid] = weakref.WeakKeyDictionary()
        self._probing = False
        self._stepping = False  # a step's post-hooks are running

    @property
    def channels_last(self) -> bool:
        """Whether the batches the Runtime moves are laid out NHWC: once a set-up model is, and none still waits (a
        waiting model may train through other methods, whose convolutions would then give NHWC outputs)."""
        chosen = self.choice is not None and self.choice.value
        return chosen and any(m.channels_last for m in self._laid.values()) and not self._waiting

    @property
    def changed(self) -> bool:
        """Whether the layout changed since the last model was set up, or a model waits to be laid out."""
        return self.choice is not self.planned or self._waiting

    @property
    def _waiting(self) -> bool:
        """Whether a set-up model waits for its first forward with autograd to be laid out NHWC."""
        return any(m.pending for m in self._laid.values())

    @property
    def shown(self) -> Choice[bool] | None:
        """The layout as the Plan gives it: ``choice``, with a note where a model still waits to be laid out."""
        if self.choice is None or not self._waiting:
            return self.choice
        return Choice(self.choice.value, f"{self.choice.reason}; laid out at the model's first forward with autograd")

    def setup(self, model: nn.Module, requested: str | bool, precision: str, *, sharded: bool = False) -> Choice[bool]:
        """Lay ``model`` out as ``requested`` ("auto": by the rule, for ``precision``); return the axis's Choice.
        A model FSDP will shard (``sharded``) stays NCHW, whatever the precision the run goes on in."""
        self.requested = requested
        laid = self._laid.setdefault(model, _Laid(False))
        laid.sharded = sharded
        choice = self._rule(model, laid, requested, precision)
        if laid.refused and choice.value and self._falls_back:
            choice = Choice(False, self._refusal(choice, laid.refused))
        self._lay(model, laid, choice.value)
        self._set(choice)
        self.planned = choice
        return choice

    def adopt(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """``model``'s optimizer: its state is laid out with the model, from now on."""
        laid = self._laid[model]
        if laid.stepping is not None and laid.optimizer is not optimizer:  # set up again, with another optimizer
            laid.stepping.remove()
            laid.stepping = None
        laid.optimizer = optimizer
        match_state_layout(optimizer)
        self._watch_steps(laid)

    def loader(self, loader: Iterable[Any], device: torch.device) -> DeviceLoader:
        """``loader`` on ``device``, its 4-d batches laid out as the model is now and after any change."""
        moved = DeviceLoader(loader, device, channels_last=self.channels_last, whole=not self._falls_back)
        self._loaders.add(moved)
        return moved

    def move(self, batch: Any, device: torch.device) -> Any:
        """``batch`` on ``device``, laid out as the loaders' batches are (``rt.to_device``)."""
        laid, whole = self.channels_last, not self._falls_back  # auto's NHWC lays out only what the model takes
        return move_batch(batch, device, non_blocking=device.type == "cuda", channels_last=laid, whole=whole)

    def close(self) -> None:
        """Take the hooks off the set-up models (the check of a forward still to come, a refused model's conversion,
        auto's NCHW outputs), and lay a model "auto" laid out NHWC back out NCHW, with its optimizer's state: without
        the hook its outputs would come out NHWC (``.view`` fails on them), and its non-contiguous weights would not
        save (safetensors refuses them). The loaders set up in the run, and ``move``, give their batches NCHW with it
        (on an NHWC batch, a convolution of the NCHW model computes NHWC again). A layout given
        (``channels_last="on"``) stays as asked."""
        auto = parse_switch("channels_last", self.requested) is None
        for model, laid in list(self._laid.items()):
            for handle in (laid.hook, laid.nchw, laid.outputs, laid.stepping):
                if handle is not None:
                    handle.remove()
            laid.hook = laid.nchw = laid.outputs = laid.stepping = None
            if auto and laid.channels_last:
                lay_out(model, laid.optimizer, channels_last=False)
                laid.channels_last = False
        if self.choice is not None:
            self._set(self.choice)  # the loaders' batches as the models are now

    def follow(self, precision: str, *, step: int) -> None:
        """Lay the set-up models (with their optimizers' state) and the loaders' batches out as the rule would for
        ``precision``, from optimizer step ``step`` on. Only "auto" follows: a layout given stays, and so does NCHW for
        a model whose forward failed in NHWC."""
        for model, laid in list(self._laid.items()):
            wanted = self._rule(model, laid, self.requested, precision)
            if self.planned is None or wanted.value == (laid.channels_last or laid.pending) or laid.refused:
                continue
            self._lay(model, laid, wanted.value)
            if wanted.value == self.planned.value:
                self._set(self.planned)
            else:
                self._set(Choice(wanted.value, f"{wanted.reason}: laid out so from step {step}, with {precision}"))

    def _rule(self, model: nn.Module, laid: _Laid, requested: str | bool, precision: str) -> Choice[bool]:
        conv = has_conv2d(model)
        return resolve_channels_last(requested, self.facts, has_conv2d=conv, precision=precision, sharded=laid.sharded)

    @property
    def _falls_back(self) -> bool:
        return falls_back(self.requested, self.world_size)

    def _lay(self, model: nn.Module, laid: _Laid, channels_last: bool) -> None:
        # auto's NHWC, unchecked: laid out at the model's first forward with autograd, checked then; a loop
        # whose steps call other methods of the model (encode, decode) never runs the check, and keeps NCHW
        laid.pending = channels_last and self._falls_back and TRAINING not in laid.verified and not laid.channels_last
        if channels_last != laid.channels_last and not laid.pending:
            lay_out(model, laid.optimizer, channels_last=channels_last)
            laid.channels_last = channels_last
        self._watch_steps(laid)
        checking = channels_last and self._falls_back and len(laid.verified) < 2
        if checking and laid.hook is None:
            laid.hook = model.register_forward_pre_hook(
                WeakHook(self, "_before_forward"), with_kwargs=True, prepend=True
            )
        elif not checking and laid.hook is not None:
            laid.hook.remove()
            laid.hook = None
        inside = channels_last and self._falls_back  # auto's NHWC stays inside the model: the loss sees NCHW outputs
        if inside and laid.outputs is None:
            laid.outputs = model.register_forward_hook(nchw_outputs)
        elif not inside and laid.outputs is not None:
            laid.outputs.remove()
            laid.outputs = None

    def _set(self, choice: Choice[bool]) -> None:
        self.choice = choice
        for loader in self._loaders:
            loader.channels_last, loader.whole = self.channels_last, not self._falls_back

    def _watch_steps(self, laid: _Laid) -> None:
        """Hook the optimizer of a ``pending`` model: a step it takes before the model's first forward with autograd
        ends the wait (``_stepped``); let go of it otherwise."""
        if laid.pending and laid.optimizer is not None and laid.stepping is None:
            laid.stepping = laid.optimizer.register_step_post_hook(WeakHook(self, "_stepped"))
        elif not laid.pending and laid.stepping is not None and not self._stepping:  # torch is calling its hooks
            laid.stepping.remove()
            laid.stepping = None

    def _stepped(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """An optimizer stepped: a model of it still waiting for its first forward with autograd, whose gradients it
        stepped on, was trained through other methods (``model.decode(model.encode(x))``), which no check sees before
        they run: it stays NCHW. (Its hook stays, doing nothing, until the Runtime closes: torch is iterating them.)"""
        self._stepping = True
        try:
            for model, laid in list(self._laid.items()):
                waits = laid.pending and laid.optimizer is optimizer
                if waits and any(p.grad is not None for p in model.parameters()):  # not a step before any backward
                    laid.refused = NOT_FORWARD
                    self._lay(model, laid, False)
                    if self.choice is not None and self.choice.value:
                        self._set(Choice(False, self._refusal(self.choice, NOT_FORWARD)))
        finally:
            self._stepping = False

    def _before_forward(self, model: nn.Module, args: Any, kwargs: Any) -> tuple[Any, Any] | None:
        """Before the first forward of its kind in NHWC: where that fails on copies of its inputs and NCHW runs, lay
        the model out NCHW for good, give this forward its inputs so, and every later one (``nchw_inputs``)."""
        laid = self._laid.get(model)
        if self._probing or laid is None:
            return None
        kind = TRAINING if model.training and torch.is_grad_enabled() else OTHER
        given: tuple[Any, Any] | None = None  # this forward's inputs laid out anew, where they were
        if laid.pending and torch.is_grad_enabled():  # its forward is how it trains (in eval mode too, frozen norms)
            laid.pending = False
            lay_out(model, laid.optimizer, channels_last=True)
            laid.channels_last = True
            self._watch_steps(laid)
            self._set(cast(Choice[bool], self.choice))  # the batches moved from now on
            if self.channels_last:  # this one's too, as the next ones come: a model compiled on its first call
                given = in_layout((args, kwargs), channels_last=True)  # compiles once
        if not laid.channels_last or kind in laid.verified:
            return given
        try:  # on NHWC copies of the inputs, as the batches moved from now on come
            self._probe(model, *(given or in_layout((args, kwargs), channels_last=True)))
        except Exception as exc:
            if is_oom(exc):
                return given  # memory, not the layout: the forward itself meets it, and the next forward is checked
            failed = describe_error(exc)
        else:
            laid.verified.add(kind)
            self._lay(model, laid, True)  # both kinds ran: the hook goes
            return given
        lay_out(model, laid.optimizer, channels_last=False)
        args, kwargs = nchw_inputs(model, args, kwargs)
        try:
            self._probe(model, args, kwargs)
        except Exception:
            lay_out(model, laid.optimizer, channels_last=True)  # it fails either way: its own error is the forward's
            return None
        laid.channels_last, laid.refused = False, failed
        self._lay(model, laid, False)  # the check goes, the conversion comes
        laid.nchw = model.register_forward_pre_hook(nchw_inputs, with_kwargs=True, prepend=True)
        if self.choice is not None and self.choice.value:
            self._set(Choice(False, self._refusal(self.choice, failed)))
        return args, kwargs

    def _probe(self, model: nn.Module, args: Any, kwargs: Any) -> None:
        self._probing = True
        try:
            with self.eagerly():
                probe_forward(model, args, kwargs)
        finally:
            self._probing = False

    @staticmethod
    def _refusal(choice: Choice[bool], failed: str) -> str:
        if failed == NOT_FORWARD:  # it waited, so it was never laid out, whatever step the precision switched at
            rule = _LAID_FROM.sub("", choice.reason)
            return f"{rule}, but {NOT_FORWARD}: NCHW (channels_last='on' lays it out anyway, unchecked)"
        return f"{choice.reason}, but the model's forward failed so ({failed}): NCHW"


def falls_back(requested: str | bool, world_size: int) -> bool:
    """Whether a run goes back to NCHW where its model fails in NHWC: where "auto" chose the layout, in one process
    (under several, each rank would decide alone). The Trainer's trial times a precision so too (runtime/trial.py)."""
    return parse_switch("channels_last", requested) is None and world_size == 1


def nchw_inputs(model: nn.Module, args: Any, kwargs: Any) -> tuple[Any, Any]:
    """The pre-hook of a model whose forward fails in NHWC: its 4-d floating-point inputs in NCHW."""
    return in_layout((args, kwargs), channels_last=False)


def lay_out(model: nn.Module, optimizer: torch.optim.Optimizer | None, *, channels_last: bool) -> None:
    """Lay ``model``'s 4-d parameters, gradients and buffers out NHWC (``channels_last``) or NCHW, in place, and the
    optimizer's state of their shape with them (its momenta then match the gradients they are updated with).

    Done outside inference mode, where a forward may have called it: the parameters stay trainable."""
    with torch.inference_mode(False):
        model._apply(lambda t: restrided(t, channels_last=channels_last))  # 5-d (Conv3d) tensors are kept as they are
        if optimizer is not None:
            match_state_layout(optimizer)
    torch.clear_autocast_cache()  # inside autocast, a weight's cast copy would keep the old layout


def nchw_outputs(model: nn.Module, args: Any, output: Any) -> Any:
    """The forward hook of a model auto laid out NHWC: its 4-d floating-point outputs in NCHW, so code outside the
    model sees the layout it wrote for (a loss's ``logits.view(len(logits), -1)`` fails on NHWC strides). A model
    whose outputs are not images (a classifier's logits) pays nothing."""
    return in_layout(output, channels_last=False)


def in_layout(inputs: Any, *, channels_last: bool) -> Any:
    """``inputs`` (tensors in tuples, lists, dicts, dataclasses) with their 4-d floating-point tensors (images) laid
    out NHWC or NCHW."""
    return map_tensors(inputs, lambda t: restrided(t, channels_last=channels_last) if t.is_floating_point() else t)


def restrided(tensor: torch.Tensor, *, channels_last: bool) -> torch.Tensor:
    """A 4-d ``tensor`` with the strides of the layout, copied where it has others (other tensors as they are).

    By strides, not ``is_contiguous``: a one-channel image or weight laid out NHWC counts as contiguous either way,
    yet a convolution reads its strides as NHWC's."""
    if tensor.dim() != 4:
        return tensor
    c, h, w = tensor.shape[1:]
    strides = (h * w * c, 1, w * c, c) if channels_last else (c * h * w, h * w, w, 1)
    if tensor.stride() == strides:
        return tensor
    return tensor.clone(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
