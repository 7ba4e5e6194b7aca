"""One framework entry of benchmarks/frameworks.py: train a Task for N steps in this process, print one RESULT line.

Every entry seeds 0 before building the model, uses the Task's optimizer factory and batch size,
shuffles the data, and stops after exactly N optimizer steps. The same Clock times them all: a
forward pre-hook on the model marks the start (its first forward) and a global optimizer
step-post hook counts steps, with a device sync only at the start, at the end of the first 10% of
steps and at the last step, so a GPU is not synchronised every step.

    python benchmarks/framework_runners.py --framework plain --task example:digits --steps 600 [--device cpu]
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import inspect
import itertools
import json
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.data import DataLoader

import redline

LOSS_WINDOW = 20  # the final loss is the mean of the last 20 steps' losses, as redline's TrainSummary reports it


class NotAvailable(Exception):
    """The entry cannot run here (a peer not installed, a redline feature this version lacks)."""


class Clock:
    """Time one model's training: first forward to last optimizer step, and the steps after the first 10%."""

    def __init__(self, steps: int, device: torch.device) -> None:
        self.steps, self.device = steps, device
        self.mark = max(1, steps // 10)  # steady state: the steps after this many
        register_optimizer_step_post_hook(lambda optimizer, args, kwargs: self._stepped())
        self.model: nn.Module | None = None
        self.last_losses: collections.deque[torch.Tensor] = collections.deque(maxlen=LOSS_WINDOW)

    def watch(self, model: nn.Module) -> nn.Module:
        """Time ``model`` from now on; the latest model watched is the one timed (a trial's models come first)."""
        self.model, self.count, self.samples = model, 0, 0
        self.begin = self.at_mark = self.end = 0.0
        self.init_checksum = ""
        clock = self

        def forward_pre_hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            # a plain function, not a bound method: a deep copy of the model (redline's trial) shares it,
            # and the identity test below ignores the copy
            if module is not clock.model:
                return
            if not clock.begin:
                clock.init_checksum = f"{sum(float(p.detach().double().sum()) for p in module.parameters()):.6f}"
                clock.begin = clock._now()
            if clock.mark <= clock.count < clock.steps:
                clock.samples += args[0].shape[0]

        model.register_forward_pre_hook(forward_pre_hook)
        return model

    def loss(self, loss: torch.Tensor) -> None:
        """Keep a step's loss (on the device: no sync) for the final loss."""
        self.last_losses.append(loss.detach())

    def final_loss(self) -> float:
        return float(torch.stack(list(self.last_losses)).float().mean())

    def _stepped(self) -> None:
        if self.model is None or not self.begin:
            return  # a step before the timed model's first forward: not this run's
        self.count += 1
        if self.count == self.mark:
            self.at_mark = self._now()
        elif self.count == self.steps:
            self.end = self._now()

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def figures(self) -> dict[str, Any]:
        if self.count != self.steps:
            raise RuntimeError(f"counted {self.count} optimizer steps of the timed model, expected {self.steps}")
        return {
            "steps": self.count,
            "loop_s": self.end - self.begin,
            "steady_samples_per_s": self.samples / (self.end - self.at_mark),
            "init_checksum": self.init_checksum,
        }


def batches(loader: Iterable[Any], steps: int) -> Iterator[Any]:
    """``steps`` batches from ``loader``, epoch after epoch (each epoch reshuffled)."""
    return itertools.islice(itertools.chain.from_iterable(itertools.repeat(loader)), steps)


def shuffled(task: redline.Task) -> DataLoader[Any]:
    return DataLoader(task.train_data, batch_size=task.batch_size, shuffle=True)


def run_plain(task: redline.Task, clock: Clock, steps: int, device: torch.device) -> dict[str, Any]:
    """The tutorial loop: eager fp32, .to(device), zero_grad, backward, step."""
    torch.manual_seed(0)
    model = clock.watch(task.build_model()).to(device)
    optimizer = task.optimizer(model.parameters())
    for inputs, targets in batches(shuffled(task), steps):
        inputs, targets = inputs.to(device), targets.to(device)
        loss = task.loss_fn(model(inputs), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        clock.loss(loss)
    return {"precision": "fp32", "compile": False}


def run_accelerate(precision: str) -> Callable[..., dict[str, Any]]:
    def run(task: redline.Task, clock: Clock, steps: int, device: torch.device) -> dict[str, Any]:
        """Accelerate's documented loop: prepare, then zero_grad, forward, accelerator.backward, step."""
        accelerate = _import("accelerate")
        from accelerate.utils import set_seed

        accelerator = accelerate.Accelerator(mixed_precision=precision, cpu=device.type == "cpu")
        set_seed(0)
        model = clock.watch(task.build_model())
        model, optimizer, loader = accelerator.prepare(model, task.optimizer(model.parameters()), shuffled(task))
        for inputs, targets in batches(loader, steps):
            optimizer.zero_grad()
            loss = task.loss_fn(model(inputs), targets)
            accelerator.backward(loss)
            optimizer.step()
            clock.loss(loss)
        ran = {"no": "fp32", "bf16": "bf16-mixed"}.get(accelerator.mixed_precision, accelerator.mixed_precision)
        return {"precision": ran, "compile": False, "version": accelerate.__version__}

    return run


def run_fabric(precision: str | None) -> Callable[..., dict[str, Any]]:
    def run(task: redline.Task, clock: Clock, steps: int, device: torch.device) -> dict[str, Any]:
        """Fabric's documented loop: setup, setup_dataloaders, then zero_grad, forward, fabric.backward, step."""
        lightning = _import("lightning")
        kwargs = {"precision": precision} if precision else {}  # None: Fabric's own default
        fabric = lightning.Fabric(accelerator=device.type, devices=1, **kwargs)
        fabric.seed_everything(0, verbose=False)
        model = clock.watch(task.build_model())
        model, optimizer = fabric.setup(model, task.optimizer(model.parameters()))
        for inputs, targets in batches(fabric.setup_dataloaders(shuffled(task)), steps):
            optimizer.zero_grad()
            loss = task.loss_fn(model(inputs), targets)
            fabric.backward(loss)
            optimizer.step()
            clock.loss(loss)
        ran = _lightning_precision(fabric.strategy.precision.precision)
        return {"precision": ran, "compile": False, "version": lightning.__version__}

    return run


def run_lightning_trainer(precision: str | None) -> Callable[..., dict[str, Any]]:
    def run(task: redline.Task, clock: Clock, steps: int, device: torch.device) -> dict[str, Any]:
        """The Lightning Trainer with logging, checkpoints, progress bar and model summary off."""
        lightning = _import("lightning")

        class Module(lightning.LightningModule):
            def __init__(self, model: nn.Module) -> None:
                super().__init__()
                self.model = model

            def training_step(self, batch: Any, index: int) -> torch.Tensor:
                inputs, targets = batch
                loss = task.loss_fn(self.model(inputs), targets)
                clock.loss(loss)
                return loss

            def configure_optimizers(self) -> torch.optim.Optimizer:
                return task.optimizer(self.parameters())

        lightning.seed_everything(0, verbose=False)
        module = Module(clock.watch(task.build_model()))
        kwargs = {"precision": precision} if precision else {}
        trainer = lightning.Trainer(
            accelerator="gpu" if device.type == "cuda" else device.type, devices=1, max_steps=steps,
            enable_checkpointing=False, logger=False, enable_progress_bar=False, enable_model_summary=False, **kwargs,
        )  # fmt: skip
        trainer.fit(module, shuffled(task))
        ran = _lightning_precision(str(trainer.precision))
        return {"precision": ran, "compile": False, "version": lightning.__version__}

    return run


def run_redline_trainer(task: redline.Task, clock: Clock, steps: int, device: torch.device) -> dict[str, Any]:
    """redline.Trainer with default options (seed 0), training only: no validation, no sample, no out_dir."""
    watched = dataclasses.replace(task, model=lambda: clock.watch(task.build_model()), val_data=None, sample=None)
    options = redline.RuntimeOptions(devices=device.type, seed=0)
    with redline.Trainer(watched, runtime=options, max_steps=steps, progress=False) as trainer:
        summary = trainer.fit()
    plan = summary.plan
    return {
        "precision": plan.precision.value,
        "compile": bool(plan.compile and plan.compile.value),
        "final_loss": summary.final_loss,
        "why": plan.precision.reason,
        "graphs_why": _graphs_why(plan, device),
    }


def _graphs_why(plan: Any, device: torch.device) -> str | None:
    """The CUDA graphs axis's reason on a CUDA device (what the run's first steps measured), where the Plan has it."""
    graphs = getattr(plan, "cuda_graphs", None)
    return graphs.reason if graphs is not None and device.type == "cuda" else None


def run_redline_runtime(**tuned: str) -> Callable[..., dict[str, Any]]:
    def run(task: redline.Task, clock: Clock, steps: int, device: torch.device) -> dict[str, Any]:
        """The README's Runtime loop, every option on auto (seed 0, planned_steps N)."""
        if tuned and not _runtime_takes("plan"):
            raise NotAvailable("not available in this version: Runtime(plan='tuned') does not exist yet")
        with redline.Runtime(devices=device.type, seed=0, planned_steps=steps, **tuned) as rt:
            model, optimizer = rt.setup(clock.watch(task.build_model()), task.optimizer)
            for inputs, targets in batches(rt.setup_loader(shuffled(task)), steps):
                with rt.autocast():
                    loss = task.loss_fn(model(inputs), targets)
                rt.backward(loss)
                rt.step(optimizer)
                clock.loss(loss)
            plan = rt.explain()
        compiled = bool(plan.compile and plan.compile.value)
        why, graphs = plan.precision.reason, _graphs_why(plan, device)
        return {"precision": plan.precision.value, "compile": compiled, "why": why, "graphs_why": graphs}

    return run


RUNNERS: dict[str, Callable[..., dict[str, Any]]] = {
    "plain": run_plain,
    "accelerate": run_accelerate("no"),  # Accelerator()'s default
    "accelerate-bf16": run_accelerate("bf16"),
    "fabric": run_fabric(None),
    "fabric-bf16": run_fabric("bf16-mixed"),
    "lightning": run_lightning_trainer(None),
    "lightning-bf16": run_lightning_trainer("bf16-mixed"),
    "redline-trainer": run_redline_trainer,
    "redline-runtime": run_redline_runtime(),
    "redline-tuned": run_redline_runtime(plan="tuned"),
}


def _import(name: str) -> Any:
    try:
        return __import__(name)
    except ImportError as exc:
        raise NotAvailable(f"not installed: {name} ({exc})") from exc


def _runtime_takes(name: str) -> bool:
    """Whether this redline's Runtime takes ``name``: as its own parameter or as one of RuntimeOptions' fields."""
    fields = {f.name for f in dataclasses.fields(redline.RuntimeOptions)}
    return name in inspect.signature(redline.Runtime).parameters or name in fields


def _lightning_precision(name: str) -> str:
    return {"32-true": "fp32", "32": "fp32"}.get(name, name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--framework", required=True, choices=sorted(RUNNERS))
    parser.add_argument("--task", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    task = redline.load_task(args.task)
    clock = Clock(args.steps, device)
    try:
        ran = RUNNERS[args.framework](task, clock, args.steps, device)
        final = {} if "final_loss" in ran else {"final_loss": clock.final_loss()}
        result = {"status": "ok", **ran, **final, **clock.figures()}
    except NotAvailable as exc:
        result = {"status": str(exc)}
    result |= {"threads": torch.get_num_threads(), "torch": torch.__version__}
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
