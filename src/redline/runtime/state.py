"""The Runtime's state and checkpoints: what ``rt.state_dict``, ``rt.save`` and ``rt.load`` write and read.

The set-up model and optimizer are held as the strategy wrapped them; the strategy writes them (whole from one
process, or each rank its shards), and the Runtime adds its loss scaling, random streams, step and Plan.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import operator
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from redline.checkpoint import Checkpoint, open_verified
from redline.checkpoint.whole import plain_module
from redline.errors import ConfigError, invalid
from redline.parallel.collectives import gather_objects, peers_said
from redline.parallel.env import DistEnv
from redline.plan import Choice, Plan
from redline.plan.micro_batch import found_size
from redline.runtime.cycle import Cycle
from redline.runtime.micro import MicroBatcher, OomEvent
from redline.runtime.optimizer import changed_options, group_options, loaded_options, match_state_layout
from redline.runtime.options import RuntimeOptions, stored_reason
from redline.runtime.precision import Precision
from redline.runtime.seed import capture_rng, restore_rng
from redline.runtime.strategy import Strategy

log = logging.getLogger("redline")


class RunState:
    """The Runtime's state and checkpoint methods, over the set-up model and optimizer it holds."""

    strategy: Strategy | None
    model: nn.Module | None
    optimizer: torch.optim.Optimizer | None
    precision: Precision
    env: DistEnv
    device: torch.device
    explain: Callable[[], Plan]
    _cycle: Cycle
    _models: list[nn.Module]
    _built_options: list[dict[str, Any]]  # the set-up optimizer's groups' options as built, before any step
    _plan: Plan
    _micro: MicroBatcher
    options: RuntimeOptions
    _closed: bool
    _tuned_workers: tuple[int, str] | None = None  # a tune's worker count and reason, for the loader set up later

    def adopt_reasons(self, stored: Mapping[str, Mapping[str, Any]], note: str) -> None:
        """Carry a stored Plan's reasons over to the axes whose values it fixed (a resumed run, or a tuned Plan's),
        each after ``note``; a checkpoint's note replaces the one an earlier resume put there."""

        def reason(old: Mapping[str, Any]) -> str:
            return f"{note}: {stored_reason(old.get('reason', ''))}"  # the notes of earlier resumes: the latest

        changes = {}
        for axis, current in self._plan.to_dict().items():
            old = stored.get(axis)
            if old is not None and old.get("value") == current["value"]:
                changes[axis] = Choice(getattr(self._plan, axis).value, reason(old))
        workers = stored.get("loader_workers")  # a tune's count: the loader row comes with setup_loader
        if workers is not None and isinstance(workers.get("value"), int):
            self._tuned_workers = (workers["value"], reason(workers))
        size = found_size(stored.get("micro_batch"))  # "auto" goes on from the size it had halved to
        if size is not None and self.options.micro_batch == "auto":
            changes["micro_batch"] = self._micro.resume(size, reason(stored["micro_batch"]))
        self._plan = dataclasses.replace(self._plan, **changes)

    def tuned_loader(self, chosen: Choice[Any]) -> Choice[Any]:
        """The loader's Plan row: with the tune's reason where it runs the worker count a tune chose."""
        if self._tuned_workers is not None and chosen.value.num_workers == self._tuned_workers[0]:
            return Choice(chosen.value, self._tuned_workers[1])
        return chosen

    def resumed_from(self, stored: Mapping[str, Mapping[str, Any]], step: int) -> None:
        """Carry the Plan of the checkpoint a run resumes from (written at ``step``) over, as ``adopt_reasons``."""
        self.adopt_reasons(stored, f"from checkpoint step {step}")

    @property
    def module(self) -> nn.Module:
        """The user's module inside the set-up model (its parameter names as the user wrote them, compiled or not)."""
        return self.unwrap(self._prepared()[1])

    def unwrap(self, model: nn.Module) -> nn.Module:
        """Return the user's module inside ``model``, one of the models ``setup`` returned (a GAN's two as well): DDP's
        wrapper taken off, the names the user wrote (compiled or not), as a state dict saved from it should hold."""
        for known in self._models:
            inner = cast(Strategy, self.strategy).module(known)
            if model is known or model is inner or model is plain_module(inner):
                return plain_module(inner)
        raise invalid("unwrap(model)", type(model).__name__, "a model that rt.setup() returned", "set it up first")

    def state_dict(self) -> dict[str, Any]:
        """Return the run's state: model and optimizer (as the strategy holds them), loss scaling, RNG.

        Like torch's own ``state_dict()``, it holds the live tensors: ``copy.deepcopy`` it to keep a snapshot.
        """
        strategy, model, optimizer = self._prepared()
        with self._cycle.steps_of_torch():  # FSDP's may step a fresh optimizer once at lr=0
            state = strategy.state_dict(model, optimizer)
        steps = self._cycle.steps
        return {**state, "precision": self.precision.state_dict(), "rng": capture_rng(), "step": steps}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Load what ``state_dict()`` returned into the set-up model, optimizer, loss scaling and RNG."""
        strategy, model, optimizer = self._prepared()
        if not isinstance(state, Mapping) or not {"model", "optimizer"} <= state.keys():
            shown = sorted(map(str, state))[:4] if isinstance(state, Mapping) else type(state).__name__
            raise invalid(
                "load_state_dict(state)",
                shown,
                "what rt.state_dict() returned: a dict with 'model' and 'optimizer'",
                "to load a model's weights alone: rt.unwrap(model).load_state_dict(state)",
            )
        with self._cycle.steps_of_torch():  # FSDP's may step a fresh optimizer once at lr=0
            strategy.load_state_dict(model, optimizer, {"model": state["model"], "optimizer": state["optimizer"]})
        match_state_layout(optimizer)  # a state saved in another layout than the model's now
        self._restart_cycle(int(state.get("step") or 0))
        self.precision.load_state_dict(dict(state.get("precision") or {}))
        if state.get("rng") is not None:
            restore_rng(state["rng"])

    def save(self, path: str | Path, *, extra: Mapping[str, Any] | None = None, step: int | None = None) -> Checkpoint:
        """Write a checkpoint directory at ``path`` atomically: weights, optimizer, loss scaling, RNGs, the Plan.

        ``extra`` is the caller's own state (tensors and plain values), returned by ``load``; ``step`` defaults to
        the steps taken. Whole from one process (one device, DDP), or each rank its shards (FSDP). Collective.
        """
        strategy, model, optimizer = self._prepared(collective="rt.save")
        if not isinstance(extra, Mapping | None):
            raise invalid(
                "extra", type(extra).__name__, "a dict of your own state (or None)", 'e.g. extra={"epoch": 3}'
            )
        if self._cycle.accumulated:  # a cycle's gradients are not state: a resume from here goes on without them
            log.warning(
                "rt.save at %d of the %d batches of a step (grad_accum): the checkpoint holds the weights of step %d, "
                "not the gradients of the %d batch(es) since\nhint: save once rt.step(optimizer) returns True; "
                "resumed from this one, go on from the batch after step %d's last", self._cycle.accumulated,
                self.options.grad_accum, self._cycle.steps, self._cycle.accumulated, self._cycle.steps,
            )  # fmt: skip
        step = self._cycle.steps if step is None else _whole_step(step)  # a load goes on counting from it
        with _collective(f"writing the checkpoint {path}", "rt.save"), self._cycle.steps_of_torch():
            runtime_state = {
                "precision": self.precision.state_dict(), "rng": gather_objects(capture_rng()),
                "optimizer_options": self._built_options, "oom_events": [_event_state(e) for e in self._micro.events],
                "optimizer_fused": [self.device.type, _fused(optimizer)],  # how it stepped, where: a resume holds it
            }  # fmt: skip
            plan = self.explain().to_dict()
            return strategy.save(
                Path(path), model, optimizer, runtime_state=runtime_state, extra=dict(extra or {}), plan=plan, step=step
            )

    def load(self, checkpoint: str | Path | Checkpoint) -> dict[str, Any]:
        """Load a checkpoint that ``save`` wrote into the set-up model and optimizer; return its ``extra``.

        Either format loads under any strategy and any number of processes. A path is verified
        against its manifest first (a ``Checkpoint`` from ``open_checkpoint`` was already); the
        checkpoint of another model (a tensor's name or shape differs) is refused before anything
        loads, with a CheckpointError that names a few of the differences. With the same number of
        processes each rank continues its own random streams; otherwise all take rank 0's.
        Collective under several processes.
        """
        strategy, model, optimizer = self._prepared(collective="rt.load")
        if not isinstance(checkpoint, str | Path | Checkpoint):
            raise invalid("checkpoint", type(checkpoint).__name__, "a path (str or Path), or a Checkpoint")
        loading = _collective(f"loading the checkpoint {getattr(checkpoint, 'path', checkpoint)}", "rt.load")
        with loading, self._cycle.steps_of_torch():  # FSDP's load may step a fresh optimizer once at lr=0
            if not isinstance(checkpoint, Checkpoint):
                checkpoint = open_verified(Path(checkpoint))
            runtime_state, extra = strategy.load(checkpoint, model, optimizer)
        match_state_layout(optimizer)  # a state saved in another layout than the model's now
        saved = runtime_state.get("optimizer_options")  # none in a checkpoint of an earlier redline
        if saved:  # the optimizer's options now: what this run's checkpoints record, and a later resume is held against
            now = loaded_options(self._built_options, saved, group_options(optimizer))
            if self.env.is_main:
                _warn_options(checkpoint.path, type(optimizer).__name__, self._built_options, now, saved)
            self._built_options = now
        stepped = runtime_state.get("optimizer_fused")  # none in a checkpoint of an earlier redline
        if self.env.is_main and stepped == [self.device.type, not _fused(optimizer)]:
            _warn_implementation(checkpoint.path, optimizer, self._plan.optimizer, fused=stepped[1])
        self._restart_cycle(checkpoint.step)
        self._micro.events = [_event(e) for e in runtime_state.get("oom_events") or []]  # the run's recoveries so far
        self.precision.load_state_dict(dict(runtime_state.get("precision") or {}))
        per_rank = runtime_state.get("rng") or []
        if per_rank:
            restore_rng(per_rank[self.env.rank] if len(per_rank) == self.env.world_size else per_rank[0])
        return extra

    def drop_cycle(self) -> None:
        """Drop the batches of a step under way (a loop that gives that step up, to redo it whole on resume): a save
        then holds the whole steps without the warning meant for a save amid a cycle."""
        self._restart_cycle(self._cycle.steps)

    def _restart_cycle(self, step: int) -> None:
        """Start a fresh accumulation cycle after ``step`` whole steps: a cycle begun before a load is dropped."""
        self._cycle.restart(step)
        for model in self._models:  # gradients accumulated before the load belong to the old weights
            model.zero_grad(set_to_none=True)

    def save_weights(self, path: str | Path) -> None:
        """Write the whole weights as one safetensors file that loads into the plain model. Collective."""
        strategy, model, _ = self._prepared(collective="rt.save_weights")
        with _collective(f"writing the weights {path}", "rt.save_weights"):
            strategy.save_weights(Path(path), model)

    def _prepared(
        self, *, models: bool = True, collective: str | None = None
    ) -> tuple[Strategy, nn.Module, torch.optim.Optimizer]:
        """The set-up strategy, model and optimizer, refused where there are none (or several models); ``collective``:
        the call that needs every rank, refused on a closed Runtime of several processes, which left their group."""
        if collective is not None and self._cycle.closed and self.env.world_size > 1:
            raise ConfigError(
                f"{collective} on a closed Runtime of {self.env.world_size} processes: it left the process group, so "
                "each rank would write alone, at once, into one checkpoint\nhint: call it inside the `with` block (or "
                "before rt.close()), on every rank"
            )
        if self.strategy is None or self.model is None or self.optimizer is None:
            raise ConfigError(
                "the Runtime has no model yet: its state, checkpoints, weights and train_step are the set-up model's\n"
                "hint: call rt.setup(model, optimizer) first"
            )
        if models and len(self._models) > 1:  # only a setup that succeeded counts
            raise ConfigError(
                f"this Runtime set up {len(self._models)} models; its state, checkpoints and weights are one model's\n"
                "hint: save each model's rt.unwrap(model).state_dict() yourself, or use one Runtime per model you save"
            )
        return self.strategy, self.model, self.optimizer


def _warn_options(
    path: Path, name: str, built: list[dict[str, Any]], now: list[dict[str, Any]], saved: list[dict[str, Any]]
) -> None:
    """Say the options in which this run's optimizer (``name``) as ``built`` differs from the checkpoint's (``saved``):
    those the load restored, and those the optimizer set back to its own as it loaded (``now``: what it goes on
    with; AdamW's decoupled_weight_decay from an Adam's checkpoint)."""
    restored, own = changed_options(built, now), changed_options(now, saved)
    said = [f"has {'; '.join(restored)}, and goes on with the checkpoint's: loading restores the optimizer as it was "
            "saved"] if restored else []  # fmt: skip
    if own:
        said.append(
            f"{'' if restored else 'has '}{'; '.join(own)}: {name} sets its own as it loads, and goes on with it"
        )
    if said:
        log.warning(
            "%s: this run's optimizer %s\nhint: to train on with other options, set them in optimizer.param_groups "
            "after loading, or start a new run (with redline train, another --out)", path, "; ".join(said),
        )  # fmt: skip


def _fused(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` steps with torch's fused kernel (its groups' ``fused`` flag)."""
    return any(bool(group.get("fused")) for group in optimizer.param_groups)


def _warn_implementation(path: Path, optimizer: torch.optim.Optimizer, now: Choice[str] | None, *, fused: bool) -> None:
    """Say where this run steps ``optimizer`` otherwise than the checkpoint's run did (``fused`` or not) on the same
    kind of device: the two round differently, so the resumed run does not end as the unbroken one. The Trainer
    takes the checkpoint's where it can; a loop of one's own builds the optimizer so."""
    name, why = type(optimizer).__name__, f" ({now.value}: {now.reason})" if now is not None else ""
    then, this = ("fused", "unfused") if fused else ("unfused", "fused")
    log.warning(
        "%s: its run stepped %s %s, and this run steps it %s%s: the two round differently, so the resumed run will "
        "not end exactly as the unbroken one would\nhint: to resume it exactly, build the optimizer with fused=%s, "
        "as that run did", path, name, then, this, why, fused,
    )  # fmt: skip


def _event_state(event: OomEvent) -> dict[str, Any]:
    """An out-of-memory recovery as a checkpoint holds it: plain values."""
    return {**dataclasses.asdict(event), "snapshot": str(event.snapshot) if event.snapshot else None}


def _event(state: Mapping[str, Any]) -> OomEvent:
    snapshot = state.get("snapshot")
    return OomEvent(**{**state, "snapshot": Path(snapshot) if snapshot else None})


def _whole_step(step: object) -> int:
    """``step`` as an int (numpy's and torch's integers too), or a ConfigError naming it: a fraction or a text
    would have been written as step 0, and a load would count from there."""
    try:
        number = operator.index(step)  # type: ignore[arg-type]
    except TypeError:
        number = -1
    if isinstance(step, bool) or number < 0:
        raise invalid("step", step, "an integer >= 0, or None for the steps taken", "leave it out for the steps taken")
    return number


def _collective(doing: str, call: str) -> contextlib.AbstractContextManager[None]:
    """Inside, a collective that breaks is a TrainingError naming what the ranks were ``doing`` together."""
    return peers_said(
        doing, f"another rank stopped first (its log says why), or did not call {call}: it is collective, so in a "
        f"loop of your own every rank calls it",
    )  # fmt: skip
