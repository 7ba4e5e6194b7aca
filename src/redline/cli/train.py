"""`redline train`: train a Task with the Trainer and print the Plan and the summary.

Every option but the task's own comes from an options dataclass (TrainerConfig, RuntimeOptions,
EarlyStopping, LaunchConfig): the flags are derived from their fields (cli/options.py).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shlex
import signal
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.text import Text

from redline.checkpoint import CheckpointError, find_checkpoints, load_plan, read_checkpoint
from redline.cli.options import TaskArgs, TaskSpec, build, command, flags, said_by_flags, spellings, values
from redline.cli.signals import terminate_as_interrupt
from redline.cli.task_args import check_given_task, load_given_task
from redline.errors import ConfigError, StoppedBySignal, interrupting_signal
from redline.hardware.device import probe_accelerators
from redline.launch.stopped import LaunchStopped
from redline.launch.torchrun import LaunchConfig, launch
from redline.parallel.env import is_launched, launcher_interrupted
from redline.plan.device import resolve_device
from redline.render.console import key_value_table, output_console, plan_table, print_uncut, result_out
from redline.runtime.options import RuntimeOptions
from redline.runtime.sampling import check_split
from redline.runtime.seed import seed_everything
from redline.train.callbacks import Callback, EarlyStopping
from redline.train.config import TrainerConfig
from redline.train.lock import refuse_if_held
from redline.train.output import check_run_files
from redline.train.run_dir import refuse_before_launch
from redline.train.signals import ResultsSkipped
from redline.train.summary import TrainSummary
from redline.train.throughput import NOT_COUNTED, UNTIMED
from redline.train.trainer import Trainer
from redline.train.tuned import TUNE_COMMAND

log = logging.getLogger("redline")
# The options that start the workers (on one machine); each worker runs the rest of the command.
LAUNCH_FIELDS = ("nproc", "max_restarts", "hang_timeout_s", "hang_start_timeout_s")
EARLY_STOPPING = "early_stopping_"


def _train(
    task: TaskSpec,
    task_arg: TaskArgs = None,
    json_output: Annotated[bool, typer.Option("--json", help="Print the summary as JSON on stdout.")] = False,
    **parsed: Any,
) -> None:
    """Train a Task with every automatic choice explained, and print the summary."""
    launching = {name: parsed[name] for name in _LAUNCH_PARAMS}
    set_for_workers = [flag.name for flag in _LAUNCH if launching[flag.parameter.name] is not None]
    if set_for_workers and launching["nproc"] is None:
        raise ConfigError(
            f"{set_for_workers[0]} concerns the worker processes that --nproc starts, and --nproc was not given\n"
            f"hint: add --nproc N (1 for one process under the launcher), or drop {set_for_workers[0]}"
        )
    # Checked before the workers start or the task loads, so a mistyped value fails at once, once.
    stopping = values(EarlyStopping, parsed, prefix=EARLY_STOPPING, optional=True)  # the flags given
    callbacks = [build(EarlyStopping, parsed, prefix=EARLY_STOPPING, optional=True)] if stopping else []
    config = build(TrainerConfig, parsed, runtime=build(RuntimeOptions, parsed))
    with said_by_flags(devices="--devices"):  # a GPU asked of a machine without one, too
        resolve_device(config.runtime.devices, probe_accelerators())
    if launching["nproc"] is not None and not launched_worker(os.environ):  # not yet a worker: start the workers
        _launch_workers(config, build(LaunchConfig, launching, optional=True), task, task_arg)
        return
    seed = stored_seed(config)  # a resumed run's: its data split is its own
    seed = parsed["seed"] if seed is None else seed
    if seed is not None:  # a factory that builds its model or data draws from it too
        seed_everything(seed)
    loaded = load_given_task(task, task_arg, stdout_kept=json_output)
    last = LastCheckpoint()
    # what the run refuses later (a batch that does not split across the ranks), said by its flag too
    flagged = said_by_flags(**spellings(TrainerConfig), **spellings(RuntimeOptions))
    watched = [*callbacks, last]
    with (
        setting_up_signals(os.environ),
        flagged,
        spec_named(task, task_arg),
        Trainer(loaded, config, callbacks=watched) as trainer,
    ):
        try:
            summary = trainer.fit()
        except KeyboardInterrupt as exc:  # a second Ctrl-C as the run stopped (or one before it trained): what is saved
            finishing = isinstance(exc, ResultsSkipped)
            if trainer.env.launched and launcher_interrupted(finishing=finishing):  # it says what was saved, once
                raise typer.Exit(128 + signal.SIGINT) from None
            signum = interrupting_signal(exc)
            raise aborted(last, config.out_dir, second=trainer.signalled, finishing=finishing, signum=signum) from None
    by_signal = summary.stopped.startswith("signal") and trainer.signalled  # not a stored summary's
    if not trainer.env.is_main:
        return  # rank 0 reports for the job
    if json_output:
        print(strict_json(summary.to_dict()), file=result_out())
    else:
        console = output_console()
        print_uncut(console, plan_table(summary.plan))
        print_uncut(console, key_value_table(summary_rows(summary), title=f"Trained {summary.task}"))
        if summary.sample:
            console.print("[bold]sample[/bold]", Text(summary.sample), sep="\n")  # generated text, not markup
    if by_signal and not trainer.env.launched:  # under the launcher, the launcher exits with the signal
        raise stopped_early(summary)


_LAUNCH = flags(LaunchConfig, only=LAUNCH_FIELDS, optional=True)
_LAUNCH_PARAMS = [flag.parameter.name for flag in _LAUNCH]
LAUNCH_OPTIONS = tuple(flag.name for flag in _LAUNCH)
train = command(
    _train,
    flags(TrainerConfig),
    flags(RuntimeOptions),
    flags(EarlyStopping, prefix=EARLY_STOPPING, optional=True, said_defaults=True),
    _LAUNCH,
)


def _launch_workers(config: TrainerConfig, launch_config: LaunchConfig, task: TaskSpec, task_arg: TaskArgs) -> None:
    """Start the workers of `redline train --nproc N` (this process is the launcher), checking first what would fail in
    every one of them; a stop names the newest checkpoint under --out, the one a resume goes on from."""
    check_given_task(task, task_arg)  # once here, not once in every worker
    with said_by_flags(**spellings(TrainerConfig)):
        if not launch_config.node_rank:  # rank 0 is started here: its out_dir must be free (once, not per restart)
            refuse_if_held(config.out_dir)
            # another run's checkpoints under --out: a restarted worker would go on from them
            refuse_before_launch(config.out_dir / "checkpoints" if config.out_dir else None, config.resume)
            if config.out_dir is not None:  # the user's own files there, refused by each worker otherwise
                check_run_files(config.out_dir)
        if isinstance(launch_config.nproc, int) and config.batch_size is not None:  # not after the workers start
            check_split(config.batch_size, launch_config.nproc * launch_config.nnodes)
    if launch_config.max_restarts and config.out_dir is None:  # said before the hours a restart would repeat
        log.warning(
            "--max-restarts %d without --out: a restarted worker finds no checkpoint to go on from, so it trains "
            "from the start again\nhint: add --out DIR", launch_config.max_restarts,
        )  # fmt: skip
    try:
        launch(launch_config, ["redline", *without_launch_options(sys.argv[1:])], module=True)
    except LaunchStopped as stopped:
        raise launch_stopped(stopped, config.out_dir, launch_config.node_rank) from None


def launch_stopped(stopped: LaunchStopped, out_dir: Path | None, node_rank: int | None) -> StoppedBySignal:
    """The error `redline train --nproc N` exits with when a signal stopped its workers (``stopped``): on the machine
    that holds rank 0's ``out_dir``, naming the checkpoint a resume goes on from; without --out, that nothing was
    saved, as one process says it (--resume auto is refused there)."""
    if stopped.aborted and (out_dir is None or not node_rank):  # a second Ctrl-C: in the words of one process
        return aborted(newest_checkpoint(out_dir), out_dir, second=True, finishing=stopped.aborted == "finishing")
    if out_dir is None:
        return stopped.unsaved()
    if node_rank:  # another machine's --out holds the checkpoints
        return stopped
    found = find_checkpoints(out_dir / "checkpoints")
    return stopped.named((found[-1].step, found[-1].path) if found else None)


def setting_up_signals(environ: Mapping[str, str]) -> contextlib.AbstractContextManager[None]:
    """How a SIGTERM before the run takes signals itself (the model built, the trial) is met: as a Ctrl-C there,
    said and exited 143, in a process of its own; a launched worker leaves it to its launcher, which stopped the
    job (it reads a worker the signal ended as stopped, and says so once)."""
    return contextlib.nullcontext() if is_launched(environ) else terminate_as_interrupt()


def stored_seed(config: TrainerConfig) -> int | None:
    """The seed of the checkpoint a run resumes (None: none found, or it had none): the factory is built under it,
    so a train/val split it draws is the one the run was trained on (the new --seed split it anew, and the data
    position went on over other data). The Trainer says what is wrong with a checkpoint that does not read."""
    if config.resume is None:
        return None
    root = config.out_dir / "checkpoints" if config.out_dir is not None else None
    try:
        if config.resume == "auto":
            found = find_checkpoints(root)[-1:] if root is not None else []
        else:
            found = [read_checkpoint(Path(str(config.resume)))]
        value = load_plan(found[0]).get("seed", {}).get("value") if found else None
    except (CheckpointError, OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def launched_worker(environ: Mapping[str, str]) -> bool:
    """Whether this process is a worker a launcher started (``is_launched``): it runs as that worker whatever
    --nproc says.

    A RANK alone (left exported, or copied from another job) is refused: it would make the run one
    process of a job that does not exist, and quietly not the N processes --nproc asks for.
    """
    if "RANK" not in environ:
        return False
    if is_launched(environ):
        return True
    stray = [name for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE") if name in environ]
    raise ConfigError(
        f"--nproc starts the worker processes, but RANK={environ['RANK']} is set in the environment as in a worker "
        "a launcher started, with no launcher's MASTER_ADDR beside it\n"
        f"hint: unset {' '.join(stray)} and run the command again"
    )


def stopped_early(summary: TrainSummary) -> StoppedBySignal:
    """The error a one-process run stopped by a signal exits with (128 + its number), saying how to go on."""
    signum = signal.SIGINT if "SIGINT" in summary.stopped else signal.SIGTERM  # "signal SIGTERM": the two it stops on
    if summary.checkpoint is None:
        return StoppedBySignal(
            signum,
            f"stopped by {signum.name} at step {summary.steps}; nothing was saved: the run has no --out\n"
            "hint: pass --out DIR to write a checkpoint there that the run can continue from (--resume auto)",
        )
    return StoppedBySignal(
        signum,
        f"stopped by {signum.name} at step {summary.steps}, its checkpoint written to {summary.checkpoint}\n"
        "hint: run the same command again with --resume auto to continue from it",
    )


class LastCheckpoint(Callback):
    """Remember the newest checkpoint the run committed (rank 0 is told), for the message of an aborted run."""

    def __init__(self) -> None:
        self.step: int | None = None
        self.path: str | None = None

    def on_checkpoint(self, trainer: Trainer, step: int, path: str) -> None:
        self.step, self.path = step, path


def newest_checkpoint(out_dir: Path | None) -> LastCheckpoint:
    """The newest checkpoint under ``out_dir``, as the workers' run left it (none without one)."""
    last, found = LastCheckpoint(), find_checkpoints(out_dir / "checkpoints") if out_dir is not None else []
    if found:
        last.step, last.path = found[-1].step, str(found[-1].path)
    return last


def aborted(
    last: LastCheckpoint, out_dir: Path | None, *, second: bool, finishing: bool = False, signum: int = signal.SIGINT
) -> StoppedBySignal:
    """The error a run a SIGINT aborted exits with (130), naming the last checkpoint committed, or none; a SIGTERM
    (``signum``) while the run set up, before its own handler took the signal, exits so with 143.

    ``second``: a second SIGINT, while the run stopped on the first; else one outside the loop (setting up).
    ``finishing``: the second came once the steps were done, as the run wrote its results (``ResultsSkipped``).
    """
    name = signal.Signals(signum).name
    what = f"aborted by a second {name} while the run was stopping" if second else f"interrupted by {name}"
    resume = "hint: run the same command again with --resume auto to continue from it"
    if finishing:
        what = "aborted by a second SIGINT after the run's last step, before its results were written"
        resume = (
            "hint: run the same command again with --resume auto to write them from it (the final evaluation, "
            "summary.json and model.safetensors)"
        )
    if out_dir is None:
        return StoppedBySignal(
            signum,
            f"{what}; nothing was saved: the run has no --out\nhint: pass --out DIR to write checkpoints there that "
            "the run can continue from (--resume auto)",
        )
    if last.path is not None:
        saved = f"its last checkpoint is {last.path} (step {last.step})"
        return StoppedBySignal(signum, f"{what}; {saved}\n{resume}")
    found = find_checkpoints(out_dir / "checkpoints")  # none written by this run: the one it resumed from, if any
    if found:
        return StoppedBySignal(
            signum, f"{what}, before it wrote a checkpoint; the newest there is {found[-1].path}\n{resume}"
        )
    return StoppedBySignal(
        signum,
        f"{what}, before its first checkpoint: nothing was saved under {out_dir}\nhint: "
        + (
            "one Ctrl-C stops the run after the step or evaluation under way, with a checkpoint of its steps; wait for "
            "it to be written"
            if second
            else "once it trains, one Ctrl-C stops the run after its step with a checkpoint; wait for it to be written"
        ),
    )


def strict_json(data: dict[str, Any]) -> str:
    """``data`` as indented JSON, a NaN or infinity written as null, as summary.json holds it (NaN is no JSON)."""
    finite = json.loads(json.dumps(data), parse_constant=lambda _: None)
    return json.dumps(finite, indent=2, allow_nan=False)


def without_launch_options(argv: list[str]) -> list[str]:
    """Return ``argv`` less the options that start the workers (each worker runs the rest)."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg in LAUNCH_OPTIONS:
            skip = True
        elif not arg.startswith(tuple(f"{name}=" for name in LAUNCH_OPTIONS)):
            out.append(arg)
    return out


@contextlib.contextmanager
def spec_named(task: str, task_arg: list[str] | None) -> Iterator[None]:
    """Say the `redline tune` a refusal asks for with the task and its arguments as typed, not SPEC."""
    try:
        yield
    except ConfigError as error:
        if TUNE_COMMAND not in str(error):
            raise
        typed = " ".join(["--task", shlex.quote(task), *(f"--task-arg {shlex.quote(a)}" for a in task_arg or [])])
        raise ConfigError(str(error).replace("--task SPEC", typed)) from error.__cause__


def _spent(summary: TrainSummary) -> str:
    """What of the run's time went to the precision trial, evaluation and checkpoints (left out of samples/s); a
    trial under ``TRIAL_SAID_S`` is not said."""
    trial = summary.trial_seconds if summary.trial_seconds and summary.trial_seconds >= TRIAL_SAID_S else None
    spent = {"in the precision trial": trial, "evaluating": summary.eval_seconds,
             "checkpointing": summary.checkpoint_seconds}  # fmt: skip
    parts = [
        f"{seconds:.2g} s {what}" if seconds >= 0.01 else f"<0.01 s {what}"
        for what, seconds in spent.items()
        if seconds
    ]
    if not parts:
        return ""
    head = ", ".join(parts[:-1])
    return f", of which {head} and {parts[-1]}" if head else f", of which {parts[0]}"


TRIAL_SAID_S = 0.05  # the least trial seconds the summary says: fewer are no share of a run worth a word


def _share(ratio: float) -> str:
    """``ratio`` as a percentage; one that rounds to 0.0% (a small model's) is said as under 0.1%, not as none."""
    return f"{ratio:.1%}" if ratio >= 0.0005 or ratio <= 0 else "<0.1%"


def _matmul_peak_row(summary: TrainSummary, no_mfu: str) -> list[tuple[str, str]]:
    """The share of the measured matmul peak, where one was measured; why not, where the step's FLOPs could not be
    counted (said, not left out: a missing row reads as a figure forgotten)."""
    if summary.measured_peak_ratio is not None:
        return [("of measured matmul peak", _share(summary.measured_peak_ratio))]
    uncounted = summary.flops_per_step is None and NOT_COUNTED in (summary.mfu_note or "")
    return [("of measured matmul peak", no_mfu)] if uncounted else []


def summary_rows(summary: TrainSummary) -> list[tuple[str, str]]:
    """Return the summary's figures as (name, text) rows for a table."""
    if summary.epochs is None:
        epochs = "streamed, "
    else:
        epochs = f"{summary.epochs:g} epoch{'' if summary.epochs == 1 else 's'}, "
    # A resumed run's rates and times are its last stretch's: the process that wrote the summary timed only those.
    stretch = f" since the resume from {Path(summary.resumed_from).name}" if summary.resumed_from else ""
    rows = [
        ("device", summary.device),
        ("steps", f"{summary.steps} ({epochs}{summary.samples} samples; stopped: {summary.stopped})"),
        ("final loss", "n/a" if summary.final_loss is None else f"{summary.final_loss:.4f} (mean of the last steps)"),
        (
            "samples/s",
            f"n/a ({summary.mfu_note or UNTIMED})"  # the note of a run without rates says why (an older one's: none)
            if summary.samples_per_s is None
            else f"{summary.samples_per_s:,.0f} (training steps after the first{stretch})",
        ),
    ]
    if summary.tokens_per_s:
        rows.append(("tokens/s", f"{summary.tokens_per_s:,.0f}"))
    no_mfu = f"n/a ({summary.mfu_note})" if summary.mfu_note else "n/a"  # a summary.json from before the note: none
    rows.append(("MFU", f"{_share(summary.mfu)} of {summary.mfu_peak_tflops:g} TFLOP/s" if summary.mfu else no_mfu))
    rows += _matmul_peak_row(summary, no_mfu)
    rows.append(("train time", f"{summary.train_seconds:.1f} s end to end{stretch}{_spent(summary)}"))
    if summary.compile_seconds is not None:
        rows.append(("compile time", f"{summary.compile_seconds:.1f} s{stretch}"))
    if summary.skipped_steps:
        rows.append(("fp16 steps skipped", str(summary.skipped_steps)))
    if summary.oom_recoveries:
        halvings = ", ".join(
            f"{e['from_size']} -> {e['to_size']}{' with activation checkpointing' if e.get('checkpointing') else ''} "
            f"at step {e['step']}"
            for e in summary.oom_recoveries
        )
        rows.append(("out-of-memory recoveries", f"{len(summary.oom_recoveries)} (micro-batch {halvings})"))
    if summary.val_loss is not None:
        rows.append(("val loss", f"{summary.val_loss:.4f}"))
    if summary.val_metric is not None:
        rows.append(("val metric", f"{summary.val_metric:.4f}"))
    if summary.checkpoint:  # the one resumed from, where this run wrote none (no --out): its later steps are unsaved
        since = " (the one resumed from: none written since)" if summary.checkpoint == summary.resumed_from else ""
        rows.append(("checkpoint", summary.checkpoint + since))
    if summary.best:
        best = summary.best
        rows.append(("best weights", f"{best['path']} ({best['monitor']} {best['value']:.4f} at step {best['step']})"))
    if summary.resumed_from:
        rows.append(("resumed from", summary.resumed_from))
    return rows
