"""Counting batches into optimizer steps: accumulation cycles, when gradients are freed, which optimizers step.

A Runtime's ``step`` counts the batches of an optimizer: every ``grad_accum`` ``step`` calls end its
cycle, the last of them really steps, and the backward before it is the one that reduces its model's
gradients over the ranks (each model's own optimizer says when, so the two models of a GAN each reduce
on their own cycle's last batch); the run's step count is the steps taken. The gradients a step used
are freed right after it on CUDA, and just before the next backward elsewhere
(as late as the plain loop frees them). The first backward after a step starts from no gradients on
any set-up model, as a plain loop's ``zero_grad()`` on each optimizer before its backward: a GAN's
generator loss, back-propagated through the discriminator after the discriminator stepped, leaves
gradients there that are not the discriminator's next step's to take. Only an optimizer that
``setup`` returned may step: setup may rebuild the one it was given (fused, or over the shards under
FSDP), and the user's own then trains nothing of the set-up model, or trains it with a second,
separate state. Nor may one that a later setup of its model replaced (a second phase's optimizer): a
checkpoint holds the model's latest optimizer alone, and the replaced one's state would be lost. Under
``redline launch --hang-timeout`` the cycle tells the hang watchdog where the loop is: in a backward (its
gradient all-reduce), or between optimizer steps (the user's data, forward and loss).
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import nn
from torch.optim.lr_scheduler import LRScheduler

from redline.errors import ConfigError
from redline.parallel.env import DistEnv, process_group_store
from redline.parallel.watchdog import Watchdog
from redline.plan.optimizer import schedulers_of
from redline.runtime.weak_hook import WeakHook

log = logging.getLogger("redline")
_TOO_FAST = (
    "the LR scheduler %s stepped %d times over one optimizer step: with grad_accum=%d, rt.step(optimizer) steps the "
    "optimizer once every %d calls, so a scheduler stepped after each call runs its schedule %d times too fast\n"
    "hint: step it when the optimizer stepped: `if rt.step(optimizer): scheduler.step()` (unless its schedule counts "
    "batches, not optimizer steps)"
)


class Cycle:
    """The batch and step count of one Runtime, with the optimizers its ``setup`` returned."""

    def __init__(self, grad_accum: int, *, zero_after_step: bool) -> None:
        self.grad_accum = grad_accum
        self.zero_after_step = zero_after_step
        self._steps = 0  # optimizer steps taken: not backwards counted, which a batch of two losses has two of
        self._micro_steps: dict[int, int] = {}
        self._pending_zero: dict[int, torch.optim.Optimizer] = {}
        self._freed: set[int] = set()  # optimizers whose gradients were freed after a step since the last backward
        self._round_over = False  # an optimizer stepped since the last backward
        self._set_up: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        # each optimizer a later setup of its model replaced, with the name of the one that replaced it
        self._replaced: weakref.WeakKeyDictionary[torch.optim.Optimizer, str] = weakref.WeakKeyDictionary()
        self._trains: dict[int, tuple[nn.Module, torch.optim.Optimizer]] = {}  # each set-up model, its optimizer
        self.watchdog: Watchdog | None = None  # set while a launched job with --hang-timeout runs
        self._paces: dict[int, list[tuple[weakref.ref[LRScheduler], int]]] = {}  # each scheduler's last step seen
        self._pace_warned = False
        self.closed = False  # the Runtime was closed: no more training calls
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []  # on the set-up optimizers: removed at close
        # amid a cycle, with gradients at their last step call: each gradient's identity and version, which
        # optimizer.zero_grad(set_to_none=False) changes (it zeroes them in place) as surely as freeing them
        self._holding: dict[int, tuple[torch.optim.Optimizer, list[tuple[int, int]]]] = {}
        # set by setup: told, before the forward of each model's next backward, whether that backward reduces
        self.expect_sync: Callable[[nn.Module, bool], None] | None = None
        # set by setup: told when a set-up optimizer steps outside rt.step (the loop's own optimizer.step())
        self.direct_step: Callable[[], None] | None = None
        self._stepping = False  # rt.step is stepping an optimizer now

    def close(self) -> None:
        """Refuse training calls from now on, and take the hooks off the set-up optimizers: a notebook that builds a
        Runtime again on the same optimizer would pile up one per run."""
        self.closed = True
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    def adopt(self, optimizer: torch.optim.Optimizer, model: nn.Module | None = None) -> None:
        """Record ``optimizer`` as one that ``setup`` returned (for ``model``: the latest setup's optimizer is its, and
        the one an earlier setup gave it steps no more)."""
        if optimizer not in self._set_up:  # held weakly: a copy of the optimizer's state carries no Runtime
            self._hooks.append(optimizer.register_step_pre_hook(WeakHook(self, "_optimizer_step")))
        self._set_up.add(optimizer)
        if model is not None:
            _, before = self._trains.get(id(model), (model, optimizer))
            if before is not optimizer:
                self._set_up.discard(before)
                self._replaced[before] = type(optimizer).__name__
                self._micro_steps.pop(id(before), None)  # its cycle under way is not the run's any more
                self._holding.pop(id(before), None)
            self._trains[id(model)] = (model, optimizer)
            self._expect(optimizer)

    def ends(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``optimizer``'s next ``step`` call really steps: the batch before it ends its cycle."""
        return self._micro_steps.get(id(optimizer), 0) == self.grad_accum - 1

    def syncs(self, optimizer: torch.optim.Optimizer | None = None) -> list[tuple[nn.Module, bool]]:
        """Each set-up model (``optimizer``'s alone, if given) and whether its next backward reduces its gradients.

        Each model's own optimizer says, not the batches counted over all models: a GAN's discriminator and
        generator each take ``grad_accum`` backwards a cycle, and one count of both would reduce the gradients of
        one of them only in the backwards of the other.
        """
        return [(m, self.ends(o)) for m, o in self._trains.values() if optimizer is None or o is optimizer]

    def _expect(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Tell ``expect_sync`` whether the next backward of ``optimizer``'s model (of every model) reduces: the
        user's forward runs before ``backward``, and DDP decides there."""
        if self.expect_sync is None:
            return
        for model, sync in self.syncs(optimizer):
            self.expect_sync(model, sync)

    @property
    def steps(self) -> int:
        """Whole steps so far, as the optimizer took them: a cycle's gradients are not state."""
        return self._steps

    @property
    def accumulated(self) -> int:
        """The batches counted towards the step under way (0 at a step's end): gradients a checkpoint does not hold."""
        return max(self._micro_steps.values(), default=0)

    @property
    def current_step(self) -> int:
        """The step the last counted batch belongs to, from 1."""
        return self._steps + 1

    def next_batch(self, called: str = "backward") -> bool:
        """Ready a backward (``called`` by rt.backward or rt.train_step); return whether it ends a set-up optimizer's
        cycle (every model's backward then reduces)."""
        self._check_open(called)
        if not len(self._set_up):  # nothing set up: no precision, accumulation or sync would apply to it
            raise ConfigError(
                f"rt.{called}() was called before rt.setup(): the Runtime back-propagates through the models it set "
                "up, scaled and accumulated for their optimizers\nhint: `model, optimizer = rt.setup(model, "
                f"optimizer)` first, then rt.{called}(...) and rt.step(optimizer)"
            )
        self._stepping = False
        self._check_kept()
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
        if self.watchdog is not None:
            self.watchdog.beat(self.current_step, "backward (gradient all-reduce)")
        return any(ends for _, ends in self.syncs())

    def _check_open(self, called: str) -> None:
        """Refuse a training call on a closed Runtime: its process-wide settings are put back, its checks let go."""
        if self.closed:
            raise ConfigError(
                f"rt.{called}() was called on a closed Runtime: its precision, process settings and checks are "
                "let go, so the step would not run as its Plan says\nhint: train inside `with Runtime(...) as rt:` "
                "(or before rt.close()); for more training, build a new Runtime and rt.load the last checkpoint"
            )

    def fresh(self) -> bool:
        """Whether no set-up optimizer holds gradients: nothing accumulated before the batch ``next_batch`` readied."""
        return not any(_has_gradients(optimizer) for optimizer in self._set_up)

    def check_set_up(self, optimizer: torch.optim.Optimizer, called: str = "step") -> None:
        """Refuse an optimizer that setup did not return: a step on it, or a clip of its gradients, would do nothing
        to the set-up model (the one setup was given was rebuilt fused on CUDA, or over the shards under FSDP)."""
        if isinstance(optimizer, nn.Module):
            raise ConfigError(
                f"rt.{called}() got a model ({type(optimizer).__name__}), not an optimizer: it steps (and clips) the "
                f"optimizer rt.setup() returned\nhint: `model, optimizer = rt.setup(model, optimizer)`, then "
                f"rt.{called}(optimizer)"
            )
        if not len(self._set_up):  # nothing set up: no loss scale, accumulation or sync would apply to its step
            raise ConfigError(
                f"rt.{called}() was called before rt.setup(): the Runtime steps (and clips) the optimizers it set "
                "up, with their model\nhint: `model, optimizer = rt.setup(model, optimizer)` first, then pass that "
                f"optimizer to rt.{called}()"
            )
        if optimizer in self._replaced:
            raise ConfigError(
                f"rt.{called}() got an optimizer ({type(optimizer).__name__}) that a later rt.setup() of its model "
                f"replaced with another ({self._replaced[optimizer]}): a checkpoint holds the latest setup's "
                "optimizer alone, so this one's state (its momentum, its step count) would be lost\nhint: to train "
                "parts of one model with different options, build one optimizer with parameter groups, "
                "`torch.optim.SGD([{'params': weights}, {'params': biases, 'lr': 0.01}])`, and set the model up once; "
                "for a second phase (layers unfrozen), step only the optimizer the latest rt.setup() returned"
            )
        if optimizer not in self._set_up:
            raise ConfigError(
                f"rt.{called}() got an optimizer ({type(optimizer).__name__}) that rt.setup() did not return: setup "
                "may rebuild the one it is given (fused, or over the shards under FSDP), and only the one it "
                "returns trains the set-up model\nhint: keep what setup returns: "
                f"`model, optimizer = rt.setup(model, optimizer)`, and pass that to rt.{called}()"
            )

    def due(self, optimizer: torch.optim.Optimizer) -> bool:
        """Count a ``step`` call for ``optimizer``; return whether it ends the optimizer's cycle."""
        self._check_open("step")
        self.check_set_up(optimizer)
        if self.grad_accum == 1:
            self._stepping = True
            return True
        key = id(optimizer)
        count = self._micro_steps.get(key, 0) + 1
        self._micro_steps[key] = count % self.grad_accum
        if count < self.grad_accum and _has_gradients(optimizer):
            self._holding[key] = (optimizer, _marks(optimizer))
        else:
            self._holding.pop(key, None)
        self._expect(optimizer)
        self._stepping = count == self.grad_accum
        return self._stepping

    def stepped(self, optimizer: torch.optim.Optimizer) -> None:
        """Free the gradients ``optimizer`` just stepped on, now or before the next backward."""
        self._stepping = False
        self._round_over = True
        self._steps += 1
        self._check_pace(optimizer)
        if self.zero_after_step:
            optimizer.zero_grad(set_to_none=True)
            self._freed.add(id(optimizer))
        else:
            self._pending_zero[id(optimizer)] = optimizer
        if self.watchdog is not None:
            self.watchdog.beat(self.steps + 1, "the loop between optimizer steps (data, forward, loss)")

    @contextlib.contextmanager
    def steps_of_torch(self) -> Iterator[None]:
        """Within, an optimizer step is not the loop's own: torch's state-dict functions (FSDP's get_state_dict and
        set_state_dict) step an optimizer that has no state yet once, at lr=0, to give it some."""
        was, self._stepping = self._stepping, True
        try:
            yield
        finally:
            self._stepping = was

    def _optimizer_step(self, optimizer: torch.optim.Optimizer, args: object, kwargs: object) -> None:
        if not self._stepping and self.direct_step is not None:  # the loop's own optimizer.step(), not rt.step's
            self.direct_step()

    def _check_kept(self) -> None:
        """Refuse a backward after the gradients an optimizer amid its cycle had accumulated were freed.

        A loop ported from one without ``grad_accum`` calls ``optimizer.zero_grad()`` before each batch: under
        accumulation that drops the cycle's earlier batches, and the step would take the last one alone.
        """
        for key, (optimizer, marks) in self._holding.items():
            if _marks(optimizer) != marks:
                raise ConfigError(
                    f"the gradients of the first {self._micro_steps.get(key, 0)} batches of this accumulation cycle "
                    f"(grad_accum={self.grad_accum}) were freed or zeroed before this backward: optimizer.zero_grad() "
                    "(or setting .grad to None, or zeroing it) mid-cycle leaves its step the last batch alone\nhint: "
                    "drop optimizer.zero_grad() from the loop: rt.step frees the gradients itself after each real step"
                )
        self._holding.clear()

    def _check_pace(self, optimizer: torch.optim.Optimizer) -> None:
        """Warn, once, of an LR scheduler that steps more than once per step of ``optimizer`` under accumulation.

        A loop ported from one without ``grad_accum`` steps its scheduler after every ``rt.step``, which steps
        the optimizer once every ``grad_accum`` calls: the schedule would run ``grad_accum`` times too fast. Its
        schedulers are looked for once torch's mark of one (each group's ``initial_lr``) appears.
        """
        if self.grad_accum == 1 or self._pace_warned:
            return
        paces = self._paces.get(id(optimizer))
        if paces is None:
            if any("initial_lr" in group for group in optimizer.param_groups):
                paced = [s for s in schedulers_of(optimizer) if isinstance(getattr(s, "last_epoch", None), int)]
                self._paces[id(optimizer)] = [(weakref.ref(s), s.last_epoch) for s in paced]  # a chain has none
            return
        for i, (ref, last) in enumerate(paces):
            scheduler = ref()
            now = getattr(scheduler, "last_epoch", None)
            if isinstance(now, int):
                paces[i] = (ref, now)
                if now - last > 1:
                    self._pace_warned = True
                    log.warning(_TOO_FAST, type(scheduler).__name__, now - last, *[self.grad_accum] * 3)
                    return

    def restart(self, step: int) -> None:
        """Start a fresh cycle after ``step`` whole steps: a cycle begun before a load is dropped."""
        self._steps = step  # steps go on counting from the loaded state's
        self._micro_steps.clear()
        self._pending_zero.clear()
        self._freed.clear()
        self._paces.clear()  # the schedulers' loaded states jump: their pace is measured afresh
        self._holding.clear()  # a load frees the gradients of the cycle it drops
        self._round_over = False
        self._expect()


def _has_gradients(optimizer: torch.optim.Optimizer) -> bool:
    return any(p.grad is not None for group in optimizer.param_groups for p in group["params"])


def _marks(optimizer: torch.optim.Optimizer) -> list[tuple[int, int]]:
    """Each gradient's identity and in-place version: what a backward adding to them finds unchanged."""
    grads = (p.grad for group in optimizer.param_groups for p in group["params"])
    return [(id(g), g._version) if g is not None else (0, -1) for g in grads]


def hang_watchdog(
    env: DistEnv, out_dir: Path | None, timeout_s: float | None = None, start_timeout_s: float | None = None
) -> Watchdog | None:
    """The hang watchdog of a distributed run given ``timeout_s``, or of a launched job given --hang-timeout
    (REDLINE_HANG_TIMEOUT), not yet entered; else None. ``start_timeout_s`` (else --hang-start-timeout,
    REDLINE_HANG_START_TIMEOUT): the allowance for the set-up and first step."""
    timeout_s = timeout_s or env.hang_timeout_s
    start_timeout_s = start_timeout_s or env.hang_start_timeout_s or None
    store = process_group_store() if env.distributed and timeout_s else None
    if store is None:
        return None
    return Watchdog(store, env.rank, env.world_size, timeout_s, out_dir, start_timeout_s=start_timeout_s)
