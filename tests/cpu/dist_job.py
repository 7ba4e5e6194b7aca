"""A training job the distributed tests start under `redline launch` (or alone, as one process).

    python dist_job.py OUT STEPS [--resume] [--kill-rank R --kill-step S [--sleep SECONDS]] [--batch B]
                       [--checkpoint-every N] [--strategy auto|ddp|fsdp|single] [--term-launcher-step S]
                       [--log-every N] [--step-sleep SECONDS] [--evaluate] [--rank1-checkpoint-minutes M] [--keep K]

A small MLP without dropout or BatchNorm, so results must not depend on the number of processes.
--kill-rank/--kill-step: that rank SIGKILLs itself after that step, on the first attempt only
(torchrun's TORCHELASTIC_RESTART_COUNT is 0), to test --max-restarts.
--rank1-checkpoint-minutes: rank 1's checkpoint clock alone (rank 0 keeps 30 minutes), to test that the ranks agree.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path

# torch._dynamo first: torch imports it when the first optimizer is built, inside the hang watchdog's 'start',
# seconds on a loaded machine, which a test's short --hang-timeout would take for a hang
import torch
import torch._dynamo
from torch import nn
from torch.utils.data import TensorDataset

import redline
from redline.train.callbacks import Callback
from redline.train.trainer import Trainer


def make_task(batch: int, term_step: int = 0, step_sleep: float = 0.0) -> redline.Task:
    gen = torch.Generator().manual_seed(11)
    data = TensorDataset(torch.randn(96, 10, generator=gen), torch.randint(0, 4, (96,), generator=gen))
    val = TensorDataset(torch.randn(41, 10, generator=gen), torch.randint(0, 4, (41,), generator=gen))
    return redline.Task(
        model=lambda: signal_launcher_at(
            nn.Sequential(nn.Linear(10, 24), nn.Tanh(), nn.Linear(24, 4)), term_step, step_sleep
        ),
        loss_fn=nn.functional.cross_entropy,
        train_data=data,
        val_data=val,
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-2),
        metric=lambda out, y: (out.argmax(-1) == y).float().mean().item(),
        batch_size=batch,
        epochs=100,
        name="dist-job",
    )


TRAINER: Trainer | None = None


def signal_launcher_at(model: nn.Module, step: int, step_sleep: float = 0.0) -> nn.Module:
    """Rank 0 sends SIGTERM to the launcher in the forward of a step, as a scheduler preempting the job would.

    A forward hook, not a callback: callbacks run at log points, and the stop must not wait for one.
    Rank 0 then waits until the launcher has passed the signal back to it, so where the ranks stop
    depends on the machine's load as little as it can. ``step_sleep`` slows every training forward
    (on every rank) to give steps a length the stop vote paces itself by.
    """
    if not step and not step_sleep:
        return model
    calls = [0]

    def hook(module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        if not module.training or args[0].is_meta:
            return  # (the Trainer counts FLOPs on a meta-device copy of the first step)
        time.sleep(step_sleep)
        calls[0] += 1
        if calls[0] == step and os.environ.get("RANK", "0") == "0":
            os.kill(os.getppid(), signal.SIGTERM)
            deadline = time.monotonic() + 30
            while (TRAINER is None or TRAINER._signals.received is None) and time.monotonic() < deadline:
                time.sleep(0.01)

    model.register_forward_pre_hook(hook)
    return model


class KillAt(Callback):
    def __init__(self, rank: int, step: int, sleep_s: float = 0.0) -> None:
        self.rank, self.step, self.sleep_s = rank, step, sleep_s

    def on_step(self, trainer: Trainer, step: int, loss: float) -> None:
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if first_attempt and trainer.env.rank == self.rank and step == self.step:
            if self.sleep_s:
                time.sleep(self.sleep_s)  # a stalled rank: the hang watchdog must name it
            else:
                os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("steps", type=int)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--kill-rank", type=int, default=-1)
    parser.add_argument("--kill-step", type=int, default=0)
    parser.add_argument("--sleep", type=float, default=0.0, help="with --kill-rank/--kill-step: sleep instead")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--checkpoint-every", type=int, default=4)
    parser.add_argument("--strategy", default="auto")
    parser.add_argument("--term-launcher-step", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=1)
    parser.add_argument("--step-sleep", type=float, default=0.0)
    parser.add_argument("--evaluate", action="store_true", help="after fit, evaluate again and count the samples")
    parser.add_argument("--rank1-checkpoint-minutes", type=float, default=30.0, help="rank 1's clock alone")
    parser.add_argument("--keep", type=int, default=3, help="checkpoints kept")
    args = parser.parse_args()
    torch.set_num_threads(1)
    callbacks: list[Callback] = [KillAt(args.kill_rank, args.kill_step, args.sleep)] if args.kill_rank >= 0 else []
    global TRAINER
    TRAINER = trainer = Trainer(
        make_task(args.batch, args.term_launcher_step, args.step_sleep),
        runtime=redline.RuntimeOptions(devices="cpu", seed=5, strategy=args.strategy),
        max_steps=args.steps,
        checkpoint_every=args.checkpoint_every,
        checkpoint_minutes=args.rank1_checkpoint_minutes if os.environ.get("RANK") == "1" else 30.0,
        keep_checkpoints=args.keep,
        eval_every=args.steps,
        log_every=args.log_every,
        out_dir=args.out,
        progress=False,
        callbacks=callbacks,
        resume="auto" if args.resume else None,
    )
    with trainer:
        summary = trainer.fit()
        if args.evaluate:
            seen = [0]

            def count(module: nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
                seen[0] += 0 if module.training else len(inputs[0])

            assert trainer.rt is not None
            trainer.rt.module.register_forward_pre_hook(count)
            val_loss = trainer.evaluate()["val_loss"]
            # a file per rank: two ranks' lines can interleave in the launcher's shared stdout
            result = {"samples": seen[0], "val_loss": val_loss}
            (Path(args.out) / f"evaluate-rank{trainer.env.rank}.json").write_text(json.dumps(result))
    print(
        f"rank {trainer.env.rank} done steps={summary.steps} val_loss={summary.val_loss!r} stopped={summary.stopped}",
        flush=True,
    )


if __name__ == "__main__":
    main()
