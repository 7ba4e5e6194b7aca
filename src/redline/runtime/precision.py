"""Applying the precision the resolver chose: autocast in the forward, loss scaling in backward and step.

plan/precision.py decides (fp32, bf16-mixed, fp16-mixed, with the reason); a ``Precision`` applies
that choice. Only fp16 needs a grad scaler: its narrow range underflows small gradients unless the
loss is scaled up, and the gradients are unscaled before clipping and the step
(https://pytorch.org/docs/stable/amp.html#gradient-scaling). With several optimizers (a GAN's two),
the scale is updated once all of them whose gradients it multiplied have stepped, as torch's
multiple-optimizer recipe does: an update between two steps would unscale the second optimizer's
gradients by a scale they were not multiplied by
(https://pytorch.org/docs/stable/notes/amp_examples.html#working-with-multiple-models-losses-and-optimizers).
"""

from __future__ import annotations

import contextlib
import weakref
from collections import Counter
from collections.abc import Callable
from typing import Any, cast

import torch

from redline.errors import ConfigError
from redline.plan import Choice
from redline.plan.precision import PrecisionName
from redline.runtime.fused import step_unfusing
from redline.runtime.weak_hook import WeakHook

AUTOCAST_DTYPES = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}
_NOTHING = contextlib.nullcontext()


class Precision:
    """One precision, applied: ``autocast()``, ``backward(loss)``, ``step(optimizer)``, and its state."""

    def __init__(self, name: PrecisionName, device: torch.device | str) -> None:
        self.name: PrecisionName = name
        self.device = torch.device(device)
        self.device_type = self.device.type
        self.dtype = AUTOCAST_DTYPES.get(name)
        self.scaler = torch.amp.GradScaler(self.device_type) if name == "fp16-mixed" else None
        self._one: torch.Tensor | None = None
        self._skipped: torch.Tensor | int = 0  # fp16 steps skipped on overflow, counted on the device
        self._scaled = False  # a scaled backward ran that no step has unscaled yet
        self._stepping = False
        self._optimizers: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()  # the guarded ones
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []  # on the guarded ones: removed at close
        self._stepped: set[int] = set()  # optimizers stepped since the scale was last updated
        self._unscaled: set[int] = set()  # optimizers whose gradients were unscaled for the coming step

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """Return the context that runs the forward pass in this precision."""
        if self.dtype is None:
            return _NOTHING  # reusable: the fp32 loop pays for no new object per step
        return torch.autocast(self.device_type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """Back-propagate ``loss``, scaled up first under fp16; ``kwargs`` go to torch's ``backward``."""
        if self.scaler is not None:
            self._update()  # a new loss to scale: the steps of the last one are all taken
            self.scaler.scale(loss).backward(**kwargs)
            self._scaled = True
        else:
            loss.backward(**kwargs)

    def step(self, optimizer: torch.optim.Optimizer, clip: Callable[[torch.optim.Optimizer], object] | None) -> None:
        """Step ``optimizer``: unscale the gradients (fp16), clip them if asked, then step.

        Under fp16 the scaler skips a step whose gradients overflowed, and lowers the scale; that is
        the normal start of loss scaling, counted in ``skipped_steps``. The count stays on the device
        (the scale before and after, compared there), so the step never waits for the device: with a
        fused optimizer nothing of the scaler's step is read back either.
        """
        if self.scaler is None:
            if clip is not None:
                clip(optimizer)
            step_unfusing(optimizer, optimizer.step)
            return
        if id(optimizer) in self._stepped:  # stepped again without a backward between: a new round
            self._update()
        self._stepping = True
        try:
            if not _has_gradients(optimizer):  # as in fp32, a no-op: the scaler has no gradient to check
                optimizer.step()
                return
            if clip is not None:
                self.unscale(optimizer)
                clip(optimizer)
            step_unfusing(optimizer, lambda: cast(torch.amp.GradScaler, self.scaler).step(optimizer))
        finally:
            self._stepping = False
            self._unscaled.discard(id(optimizer))
        self._stepped.add(id(optimizer))
        if not any(id(o) not in self._stepped and _has_gradients(o) for o in self._optimizers):
            self._update()  # no other optimizer holds gradients this scale multiplied

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide ``optimizer``'s gradients by the loss scale now (fp16; once before its step), to clip or read them.

        The scaler notes an overflow it finds, and the step that follows is skipped as it would have been.
        """
        if self.scaler is None or id(optimizer) in self._unscaled or not _has_gradients(optimizer):
            return
        if id(optimizer) in self._stepped:  # stepped already on this scale: the gradients are a new round's
            self._update()
        self.scaler.unscale_(optimizer)
        self._unscaled.add(id(optimizer))

    def clip_grad_norm(self, optimizer: torch.optim.Optimizer, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip ``optimizer``'s gradients to ``max_norm`` (unscaled first); return their norm before clipping."""
        self.unscale(optimizer)
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)

    def _update(self) -> None:
        """Update the scale after the steps taken since the last update (lowered if any overflowed)."""
        if self.scaler is None or not self._stepped:
            return
        before = self._scale()
        self.scaler.update()
        self._stepped.clear()
        self._scaled = False
        self._skipped = self._skipped + (self._scale() < before).int()  # the scale drops only on overflow

    def guard(self, optimizer: torch.optim.Optimizer, chosen: Choice[str]) -> Choice[str]:
        """Refuse what this precision cannot train ``optimizer``'s parameters with; return the Plan's row, ``chosen``,
        with the parameters' dtype where it is not float32 (no precision changes it).

        Under fp16, ``optimizer.step()`` called directly is refused on gradients that a backward scaled up: they are
        still multiplied by the loss scale (65,536 at the start), and stepping on them moves the weights that many
        times too far, to inf within a step or two. Only ``step`` unscales. float16 parameters are refused under fp16
        and bf16 (``refuse_half_parameters``).
        """
        if self.name in AUTOCAST_DTYPES:
            refuse_half_parameters(optimizer, self.name)
        if self.scaler is not None:
            self._optimizers.add(optimizer)
            # held weakly and removed at close: a Runtime stopped amid a step (a notebook's interrupt after
            # rt.backward) would otherwise refuse every later step of the user's optimizer, another Runtime's too
            self._hooks.append(optimizer.register_step_pre_hook(WeakHook(self, "_refuse_scaled_step")))
        said = parameter_dtypes(optimizer)
        return chosen if not said or said in chosen.reason else Choice(chosen.value, f"{chosen.reason}; {said}")

    def release(self) -> None:
        """Take this precision's hooks off the optimizers it guarded (a closed Runtime's)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    def _refuse_scaled_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._scaled and not self._stepping:
            scale = float(self._scale())
            raise ConfigError(
                f"optimizer.step() was called directly under fp16-mixed: the gradients are still multiplied by "
                f"the loss scale ({scale:g}), so the step would be {scale:g} times too large\n"
                "hint: call rt.step(optimizer) instead; it unscales the gradients (and clips them, and skips a "
                "step that overflowed) before stepping"
            )

    def _scale(self) -> torch.Tensor:
        """The current loss scale as a device tensor: scaling a one, through the scaler's public API."""
        assert self.scaler is not None
        if self._one is None:
            self._one = torch.ones((), device=self.device)
        return self.scaler.scale(self._one)

    @property
    def skipped_steps(self) -> int:
        """fp16 steps the scaler skipped on overflow, one per update of the scale (reading it waits for the device).

        Several optimizers stepped on the same scale (a GAN's two) share one update, as in torch's recipe.
        """
        return int(self._skipped)

    def state_dict(self) -> dict[str, Any]:
        """Return what a resumed run needs: the loss scale and its growth tracker (empty without fp16)."""
        if self.scaler is None:
            return {}
        return {"scaler": self.scaler.state_dict(), "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()``'s state; a state from another precision is ignored (it holds nothing here)."""
        if self.scaler is None or not state:
            return
        scaler = state.get("scaler", state)  # redline 0.1 stored the scaler's own state dict
        if scaler:
            self.scaler.load_state_dict(scaler)
        self._skipped = int(state.get("skipped_steps", 0))
        self._stepped.clear()

    def __repr__(self) -> str:
        return f"Precision({self.name!r})"


def _has_gradients(optimizer: torch.optim.Optimizer) -> bool:
    """Whether a backward reached any of ``optimizer``'s parameters since their gradients were last freed."""
    return any(p.grad is not None for group in optimizer.param_groups for p in group["params"])


def half_model_keeps_fp32(model: torch.nn.Module, precision: str, requested: str) -> Choice[str] | None:
    """fp32, with why, where "auto" (``requested``) chose ``precision``, a mixed one, by the rule or a trial for a
    ``model`` with float16 trained parameters, which mixed precision refuses (``refuse_half_parameters``); None where
    it did not. Only a mixed precision the user asked for is refused."""
    halves = sum(p.numel() for p in model.parameters() if p.requires_grad and p.dtype == torch.float16)
    if requested != "auto" or precision not in AUTOCAST_DTYPES or not halves:
        return None
    return Choice(
        "fp32",
        f"auto: fp32, not {precision}, since the model trains {halves:,} float16 parameters: mixed precision keeps "
        f"the weights in float32 and refuses float16 ones (drop the model's .half() to have {precision})",
    )


def refuse_half_parameters(optimizer: torch.optim.Optimizer, precision: str = "fp16-mixed") -> None:
    """Refuse float16 parameters to train under fp16-mixed or bf16-mixed (``precision``), which keep the weights in
    float32 and autocast the forward.

    Under fp16-mixed a model cast with ``.half()`` would fail at its first ``rt.step`` with torch's "Attempting to
    unscale FP16 gradients". Under bf16-mixed it would train float16 weights on float16
    gradients with no loss scale to keep the small ones from underflowing, the forward cast to bfloat16 on the way.
    """
    halves = sum(p.numel() for group in optimizer.param_groups for p in group["params"] if p.dtype == torch.float16)
    if not halves:
        return
    why = (
        "its loss scaler cannot unscale float16 gradients"
        if precision == "fp16-mixed"
        else "it has no loss scale, so float16 weights would train on float16 gradients that underflow"
    )
    dtype = str(AUTOCAST_DTYPES[precision]).removeprefix("torch.")
    raise ConfigError(
        f"precision={precision!r} got a model with {halves:,} float16 parameters: {precision} keeps the "
        f"weights in float32 and autocasts the forward to {dtype}, and {why}\nhint: drop the model's .half() (or "
        f".to(torch.float16)): {precision} gives the {dtype} speed; or train the float16 model as it is with "
        "precision='fp32'"
    )


def parameter_dtypes(optimizer: torch.optim.Optimizer) -> str:
    """Which of the parameters ``optimizer`` trains are not float32, and what that means ("" where all are)."""
    counts: Counter[torch.dtype] = Counter()
    for group in optimizer.param_groups:
        for p in group["params"]:
            counts[p.dtype] += p.numel()
    others = {dtype: count for dtype, count in counts.items() if dtype != torch.float32}
    if not others:
        return ""
    names = " and ".join(str(dtype).removeprefix("torch.") for dtype in others)
    share, total = sum(others.values()), counts.total()
    which = "the model's" if share == total else f"{share:,} of the model's {total:,}"
    return f"{which} trained parameters are {names}, not float32: they and their gradients stay {names}"
