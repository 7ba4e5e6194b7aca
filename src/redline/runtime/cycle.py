"""Counting batches into optimizer steps: accumulation cycles, when gradients are freed, which optimizers step.

A Runtime's ``backward`` (or ``train_step``) counts a batch; every ``grad_accum`` batches end a
cycle, whose backward reduces the gradients over the ranks and whose ``step`` really steps. The
gradients a step used are freed right after it on CUDA, and just before the next backward elsewhere
(as late as the plain loop frees them). The first backward after a step starts from no gradients on
any set-up model, as a plain loop's ``zero_grad()`` on each optimizer before its backward: a GAN's
generator loss, back-propagated through the discriminator after the discriminator stepped, leaves
gradients there that are not the discriminator's next step's to take. Only an optimizer that
``setup`` returned may step: setup may rebuild the one it was given (fused, or over the shards under
FSDP), and the user's own then trains nothing of the set-up model, or trains it with a second,
separate state. Under ``redline launch --hang-timeout`` the cycle tells the hang watchdog where the
loop is: in a backward (its gradient all-reduce), or between optimizer steps (the user's data,
forward and loss).
"""

from __future__ import annotations

import weakref
from pathlib import Path

import torch

from redline.errors import ConfigError
from redline.parallel.env import DistEnv, process_group_store
from redline.parallel.watchdog import Watchdog


class Cycle:
    """The batch and step count of one Runtime, with the optimizers its ``setup`` returned."""

    def __init__(self, grad_accum: int, *, zero_after_step: bool) -> None:
        self.grad_accum = grad_accum
        self.zero_after_step = zero_after_step
        self.backwards = 0
        self._micro_steps: dict[int, int] = {}
        self._pending_zero: dict[int, torch.optim.Optimizer] = {}
        self._freed: set[int] = set()  # optimizers whose gradients were freed after a step since the last backward
        self._round_over = False  # an optimizer stepped since the last backward
        self._set_up: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self.watchdog: Watchdog | None = None  # set while a launched job with --hang-timeout runs

    def adopt(self, optimizer: torch.optim.Optimizer) -> None:
        """Record ``optimizer`` as one that ``setup`` returned."""
        self._set_up.add(optimizer)

    @property
    def steps(self) -> int:
        """Whole steps so far: a cycle's gradients are not state."""
        return self.backwards // self.grad_accum

    @property
    def current_step(self) -> int:
        """The step the last counted batch belongs to, from 1."""
        return (self.backwards - 1) // self.grad_accum + 1

    def next_batch(self) -> bool:
        """Count a batch; return whether it ends a cycle (its backward reduces over the ranks)."""
        if self._round_over:  # a step came since the last backward: no gradient carries over to this one
            # The last step's gradients, freed as late as the plain loop frees them, and those a backward
            # after a step left on another optimizer's parameters (a GAN's discriminator), but for an
            # optimizer amid its accumulation cycle, whose gradients are still adding up.
            stale = {
                id(o): o for o in self._set_up if id(o) not in self._freed and not self._micro_steps.get(id(o))
            } | self._pending_zero
            for optimizer in stale.values():
                optimizer.zero_grad(set_to_none=True)
            self._round_over = False
        self._pending_zero.clear()
        self._freed.clear()
        self.backwards += 1
        if self.watchdog is not None:
            self.watchdog.beat(self.current_step, "backward (gradient all-reduce)")
        return self.backwards % self.grad_accum == 0

    def due(self, optimizer: torch.optim.Optimizer) -> bool:
        """Count a ``step`` call for ``optimizer``; return whether it ends the optimizer's cycle."""
        if len(self._set_up) and optimizer not in self._set_up:
            raise ConfigError(
                f"rt.step() got an optimizer ({type(optimizer).__name__}) that rt.setup() did not return: setup "
                "may rebuild the one it is given (fused, or over the shards under FSDP), and only the one it "
                "returns trains the set-up model\nhint: keep what setup returns: "
                "`model, optimizer = rt.setup(model, optimizer)`, and step that"
            )
        if self.grad_accum == 1:
            return True
        key = id(optimizer)
        count = self._micro_steps.get(key, 0) + 1
        self._micro_steps[key] = count % self.grad_accum
        return count == self.grad_accum

    def stepped(self, optimizer: torch.optim.Optimizer) -> None:
        """Free the gradients ``optimizer`` just stepped on, now or before the next backward."""
        self._round_over = True
        if self.zero_after_step:
            optimizer.zero_grad(set_to_none=True)
            self._freed.add(id(optimizer))
        else:
            self._pending_zero[id(optimizer)] = optimizer
        if self.watchdog is not None:
            self.watchdog.beat(self.steps + 1, "the loop between optimizer steps (data, forward, loss)")

    def restart(self, step: int) -> None:
        """Start a fresh cycle after ``step`` whole steps: a cycle begun before a load is dropped."""
        self.backwards = step * self.grad_accum  # steps go on counting from the loaded state's
        self._micro_steps.clear()
        self._pending_zero.clear()
        self._freed.clear()
        self._round_over = False


def hang_watchdog(env: DistEnv, out_dir: Path | None, timeout_s: float | None = None) -> Watchdog | None:
    """The hang watchdog of a distributed run given ``timeout_s``, or of a launched job given --hang-timeout
    (REDLINE_HANG_TIMEOUT), not yet entered; else None."""
    timeout_s = timeout_s or env.hang_timeout_s
    store = process_group_store() if env.distributed and timeout_s else None
    return Watchdog(store, env.rank, env.world_size, timeout_s, out_dir) if store is not None else None
