"""The state one fit() works with: where the run stands, and what it gathers between log points."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from redline.checkpoint import Checkpoint, CheckpointError, load_plan
from redline.errors import ConfigError
from redline.parallel.collectives import StopVote, all_reduce_sum
from redline.parallel.watchdog import Watchdog
from redline.runtime.loading import DeviceLoader
from redline.runtime.runtime import Runtime
from redline.runtime.sampling import EpochSampler
from redline.task import Task, task_origin
from redline.train.data import StreamShard
from redline.train.logs import Loggers
from redline.train.progress import Progress
from redline.train.schedule import Schedule
from redline.train.step_start import StepStart, draws_here
from redline.train.throughput import Throughput

if TYPE_CHECKING:
    from redline.train.best import BestWeights

log = logging.getLogger("redline")


class Stateful(Protocol):
    """What a checkpoint keeps of a callback: its state (EarlyStopping's)."""

    def state_dict(self) -> dict[str, Any]: ...


_DATA = ("train_samples", "task")  # a Position's fields saved apart from the rest: see Position.to_state
_HASHES = "data_hashes"  # saved apart from _DATA too: a redline from before it builds Position(**data), no more
_OPTIONS = "task_options"  # apart too, for the same reason


def _unseeded(found: Checkpoint) -> bool:
    """Whether the run that wrote ``found`` had no seed (its Plan's seed is None), so its data drawn at random cannot
    be drawn again; False where its Plan cannot be read."""
    try:
        return load_plan(found).get("seed", {}).get("value", 0) is None
    except (CheckpointError, OSError, ValueError, AttributeError):
        return False


def option_texts(task: Task) -> dict[str, str] | None:
    """The options that loaded ``task`` (``--task-arg``), each as its repr; None for a Task built in Python."""
    origin = task_origin(task)
    return {key: repr(value) for key, value in origin[1].items()} if origin is not None else None


def changed_options(then: dict[str, str] | None, now: dict[str, str] | None) -> str:
    """The options that differ between a checkpoint's run and this one ("seed=1 (the run began with seed=0)"); ""
    where they agree, or either side's are unknown."""
    if then is None or now is None:
        return ""
    said = []
    for key in sorted(then.keys() | now.keys()):
        if key not in then:
            said.append(f"{key}={now[key]} (the run began without it: the factory's default)")
        elif key not in now:
            said.append(f"{key} left to the factory's default (the run began with {key}={then[key]})")
        elif then[key] != now[key]:
            said.append(f"{key}={now[key]} (the run began with {key}={then[key]})")
    return ", ".join(said)


@dataclass
class Position:
    """Where the run stands; saved in every checkpoint."""

    step: int = 0
    epoch: int = 0
    batches_in_epoch: int = 0
    samples: int = 0
    batch_size: int = 0  # what the loader's batches held; 0 in checkpoints from before it was saved
    train_samples: int | None = None  # the training set's length; None for a stream without one, or an older checkpoint
    task: str = ""  # the task's name; "" in checkpoints from before it was saved
    # a hash of a few items of the task's train_data and val_data (``data_digests``); {} in older checkpoints
    data_hashes: dict[str, str] = field(default_factory=dict)
    # the options the task was loaded with (--task-arg), each as its repr; None for a Task built in Python, or older
    task_options: dict[str, str] | None = None

    def to_state(self) -> dict[str, dict[str, Any]]:
        """The checkpoint's entries for this position: where the run stands ("position"), and what it trains on
        ("data", "data_hashes"), kept apart so that a redline from before each was saved reads the rest it knows."""
        known = vars(self).copy()
        hashes, options = known.pop(_HASHES), known.pop(_OPTIONS)
        return {
            "data": {name: known.pop(name) for name in _DATA},
            _HASHES: hashes,
            _OPTIONS: options,
            "position": known,
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Position:
        """The position a checkpoint's extra state holds (``to_state``'s entries; "data" and "data_hashes" are absent
        from older ones)."""
        options = state.get(_OPTIONS)
        return cls(
            **state["position"], **(state.get("data") or {}), data_hashes=dict(state.get(_HASHES) or {}),
            task_options=dict(options) if isinstance(options, dict) else None,
        )  # fmt: skip

    @contextlib.contextmanager
    def next_epoch(self) -> Iterator[None]:
        """At the next epoch's start for what runs inside (the epoch's evaluation); where that fails, back at this
        epoch's last batch, so the checkpoint of the steps so far resumes into the evaluation again."""
        ended = (self.epoch, self.batches_in_epoch)
        self.epoch, self.batches_in_epoch = self.epoch + 1, 0
        try:
            yield
        except BaseException:
            self.epoch, self.batches_in_epoch = ended
            raise

    def check_resume(
        self,
        found: Checkpoint | None,
        *,
        batch_size: int,
        split: int,
        world_size: int,
        task: Task | str,
        train_samples: int | None,
        data_hashes: dict[str, str],
    ) -> None:
        """Refuse to continue this position (of checkpoint ``found``; None for a new run) where the batches or the
        training set differ (``check_batch_size``, ``check_data``), then hold this run's task (its name and the
        options it was loaded with; a name alone says no options), length and hashes."""
        name, options = (task, None) if isinstance(task, str) else (task.name, option_texts(task))
        self.check_batch_size(batch_size, found, split=split, world_size=world_size)
        self.check_data(name, train_samples, found, data_hashes, options)
        self.task, self.train_samples, self.data_hashes = name, train_samples, dict(data_hashes)
        if found is None or self.task_options is None:  # a resumed run began with its checkpoint's: they drew this data
            self.task_options = options

    def check_data(
        self,
        task: str,
        train_samples: int | None,
        found: Checkpoint | None,
        data_hashes: dict[str, str],
        options: dict[str, str] | None = None,
    ) -> None:
        """Refuse to continue this position (of checkpoint ``found``) on a training set of another length, or of other
        items (``data_hashes``, this run's ``data_digests``, differ in train_data's); warn where the validation set's
        items differ alone, or the task has another name.

        The data position counts batches into an epoch of this many samples: on another set it would land elsewhere
        (past the end, or in another epoch), and a validation split moved by a task option would hold trained samples.
        A checkpoint from before these were saved, a stream without a length, or a set whose items are not read
        (``items_digest``), is not checked.
        """
        if found is None:
            return
        named = f" of task {self.task!r}" if self.task else ""
        changed = changed_options(self.task_options, options)
        if self.train_samples is not None and train_samples is not None and self.train_samples != train_samples:
            differ = f" (and the task's options differ from that run's: {changed})" if changed else ""
            raise ConfigError(
                f"{found.path} was written training on {self.train_samples} samples{named}, and this run's "
                f"train_data holds {train_samples}{differ}: the data position counts batches into its epochs, so a "
                "resumed run would skip or repeat samples (and a validation split moved would hold trained ones)"
                "\nhint: resume with the task and --task-arg options the run began with; to train on this data, "
                "start a new run (another --out)"
            )
        moved = [name for name, digest in self.data_hashes.items() if data_hashes.get(name, digest) != digest]
        if "train_data" in moved and changed:  # the options the run began with draw its data again: refused, named
            raise ConfigError(
                f"{found.path} was written training on other samples{named} than this run's train_data holds (a "
                f"hash of a few of their items differs), and the task's options differ from that run's: {changed}; "
                "resumed, the run would train on other samples, and validate on some it trained on\nhint: resume "
                "with the --task-arg values the run began with; to train on this data, start a new run (another --out)"
            )
        if "train_data" in moved and _unseeded(found):  # no command could draw that run's data again: said, not refused
            log.warning(
                "resuming %s, written training on other samples than this run's train_data holds (a hash of a few of "
                "their items differs): that run had no seed, so a task drawing its data at random drew other samples "
                "here; the run goes on training on these, and may validate on samples it trained on\nhint: give "
                "--seed (in Python: RuntimeOptions(seed=...), the Task's data drawn under it) to a run you mean to "
                "resume", found.path,
            )  # fmt: skip
            moved = []  # its validation samples too: said with them
        if "train_data" in moved:  # as long, other items: a split drawn by another seed, say
            raise ConfigError(
                f"{found.path} was written training on other samples{named} than this run's train_data holds: as "
                "many, but a hash of a few of their items differs, as where a --task-arg moves the validation split "
                "(another seed, say); resumed, the run would train on other samples, and validate on some it trained "
                "on\nhint: resume with the same --task-arg values as the run it resumes (in Python: the Task built "
                "as it was, a split drawn at random under the same seed); to train on this data, start a new run "
                "(another --out)"
            )
        if moved:
            log.warning(
                "resuming %s, written validating on other samples than this run's val_data holds (a hash of a few of "
                "their items differs): its evaluations from here are not comparable with its earlier ones, which "
                "early stopping and --keep-best compare them with\nhint: resume with the same --task-arg values as "
                "the run it resumes; to validate on this data throughout, start a new run (another --out)", found.path,
            )  # fmt: skip
        if self.task and task != self.task:
            log.warning(
                "resuming %s, written by task %r, with task %r: the weights and the data position go on as if it "
                "were the same task\nhint: resume with the task the run began with; for another, start a new run "
                "(another --out)", found.path, self.task, task,
            )  # fmt: skip

    def check_batch_size(
        self, batch_size: int, found: Checkpoint | None, *, split: int = 1, world_size: int = 1
    ) -> None:
        """Refuse to continue this position (of checkpoint ``found``) with batches of another size, or in a number of
        processes (``world_size``) its batches do not split across.

        The data position counts batches, so a resumed epoch at another size would repeat samples or skip them.
        ``split``: the micro-batches a tuned run splits the ``--batch-size`` batch into (the hint's flag is the whole).
        """
        if found is None or not self.batch_size:
            return
        if self.batch_size % world_size:  # the batch cannot change, the processes can (whatever batch this run asks
            batch_size = self.batch_size  # for: --batch-size of the stored one would be refused as unsplittable)
            counts = [n for n in range(1, batch_size + 1) if batch_size % n == 0]
            near = [str(n) for n in sorted(sorted(counts, key=lambda n: abs(n - world_size))[:3])]
            told = f"{', '.join(near[:-1])} or {near[-1]} processes" if len(near) > 1 else "1 process"
            raise ConfigError(
                f"{found.path} was written with batches of {batch_size}, which do not split across {world_size} "
                "processes, and a resumed run keeps its batch size (the data position counts batches)\nhint: resume "
                f"in {told} (--nproc); or start a new run (another --out) at a batch size they split"
            )
        if self.batch_size == batch_size:
            return
        raise ConfigError(
            f"{found.path} was written with batches of {self.batch_size}, and this run's are {batch_size}: "
            "the data position counts batches, so resuming at another size would repeat or skip samples\nhint: resume "
            f"with --batch-size {self.batch_size * split}; to use less memory, keep it and add --micro-batch auto"
        )


@dataclass
class Window:
    """Per-step values gathered on the device between two logging points."""

    losses: list[torch.Tensor] = field(default_factory=list)
    lrs: list[float] = field(default_factory=list)
    epochs: list[int] = field(default_factory=list)  # the epoch each step ran in
    start: float = field(default_factory=time.perf_counter)  # paces the stop vote; the rates are the meter's
    checkpointed_at: float = field(default_factory=time.perf_counter)  # the clock of --checkpoint-minutes
    excluded_s: float = 0.0  # the meter's evaluation and checkpoint seconds when the window started
    logged: bool = False  # its rows are in the logs (a window whose loss is not finite is read twice)


@dataclass
class Run:
    """Everything one fit() works with: built once in ``_start``, updated by the loop."""

    rt: Runtime
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Schedule
    sampler: EpochSampler | StreamShard  # sets the epoch (and the resumed position) of the data
    batches: DeviceLoader
    pos: Position
    total: float
    loggers: Loggers
    progress: Progress
    meter: Throughput
    vote: StopVote
    resumed: Checkpoint | None
    last_ckpt: Checkpoint | None
    start: float = field(default_factory=time.perf_counter)  # when fit() began setting up: the run's end-to-end time
    trial_seconds: float | None = None  # the precision trial's where one ran (not read from the cache), else None
    checkpointed_at: float = field(default_factory=time.perf_counter)  # the clock of --checkpoint-minutes
    window: Window = field(default_factory=Window)
    micro_loss: torch.Tensor | None = None  # the step's micro-batches' summed loss, until the step completes
    step_start: Position | None = None  # the position when the step under way began
    in_optimizer_step: bool = False
    losses: list[float] = field(default_factory=list)
    metrics: dict[str, float | None] = field(default_factory=dict)
    stopped: str = ""
    watchdog: Watchdog | None = None
    owed_eval: bool = False  # the resumed step's evaluation, due and failed: run before the first step
    val_checked: bool = False  # whether val_data's first batch was evaluated (train/evaluation.py check_val_data)
    # what an epoch's evaluation moves, as it stood before: the schedule, early stopping and best's checkpoint
    # entries, and the optimizer's hyperparameters (the learning rate ReduceLROnPlateau sets); kept while it runs,
    # and to the end of a step whose micro-batches span the epoch's end, for a checkpoint the resume evaluates from
    before_eval: tuple[dict[str, Any], list[dict[str, Any]]] | None = None
    held_back: dict[str, Any] | None = None  # before_eval's entries, once the run is put back to before it

    keeps_steps: bool = False  # a failure checkpoints the steps so far (out_dir): a failed step is put back first
    step_start_state: StepStart | None = None  # what the step under way moves besides the weights, as at its start

    def step_batches(self) -> Iterator[Any]:
        """This epoch's batches, each step's start marked (``begin_step``) before its first batch is read: reading
        may draw random numbers (an augmentation), which a step redone on resume draws again."""
        batches = iter(self.batches)
        while True:
            if self.micro_loss is None:
                self.begin_step()
            self.beat("reading the next batch (train_data, collate_fn, loader workers)")  # after this step: a rank
            # stuck reading at an epoch's end is not ahead of one evaluating that step
            try:
                batch = next(batches)
            except StopIteration:
                return
            yield batch

    def begin_step(self) -> None:
        """Mark where the step now beginning starts: its position, and, where a failure keeps the steps before it,
        the random streams and running statistics its forwards move (``StepStart``)."""
        self.step_start = dataclasses.replace(self.pos)
        if not self.keeps_steps:
            return
        if self.step_start_state is None:
            draws = draws_here(self.batches.loader)  # whether reading the batches may draw from Python's or NumPy's
            self.step_start_state = StepStart(self.model, self.rt.device, host_streams=draws)
        self.step_start_state.keep()

    @property
    def step_under_way(self) -> bool:
        """Whether a step has begun (its first batch being read, or read) and not completed."""
        return self.step_start is not None and self.step_start.step == self.pos.step

    def hold_before_eval(self, states: dict[str, Any]) -> None:
        """Keep ``states`` (``eval_states``) and the optimizer's hyperparameters, before an epoch's evaluation."""
        groups = [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        self.before_eval = states, groups

    def back_to_step_start(self) -> None:
        """Put the run back to the start of the step under way, its micro-batches dropped: a checkpoint now holds the
        step's start (redone whole on resume), with what an epoch's evaluation inside the step moved as it stood
        before (the resumed run evaluates that epoch's end again, as the unbroken run did once)."""
        assert self.step_start is not None
        self.pos = self.step_start
        self.rt.drop_cycle()
        if self.step_start_state is not None:  # the dropped forwards drew and moved them: redone, they do again
            self.step_start_state.put_back()
        self.put_back_evaluation()

    def put_back_evaluation(self) -> None:
        """Put back what an epoch's evaluation moved, as ``hold_before_eval`` kept it (if it did): a checkpoint now
        holds it as it stood before (``held_back``), with the optimizer's hyperparameters, for a resumed run that
        evaluates that epoch's end again."""
        if self.before_eval is None:
            return
        self.held_back, groups = self.before_eval
        for group, before in zip(self.optimizer.param_groups, groups, strict=True):
            group.update(before)

    @contextlib.contextmanager
    def optimizer_step(self) -> Iterator[None]:
        """Mark a step's update under way (optimizer and schedule); a failure inside leaves the mark: half updated."""
        self.in_optimizer_step = True
        yield
        self.in_optimizer_step = False

    def read_window(self, *, distributed: bool, world_size: int) -> tuple[list[float], list[dict[str, Any]]]:
        """Read the window's losses (one device sync; where ``distributed``, averaged over the ``world_size`` ranks)
        and return them with the log's row of each of its steps."""
        window = self.window
        stacked = torch.stack(window.losses).float()
        if distributed:  # the step time rides along: every rank paces its stop vote by the same mean
            excluded = self.meter.excluded_s - window.excluded_s  # an evaluation or a checkpoint inside
            queued = time.perf_counter() - window.start - excluded  # the host's time, before the device catches up
            step_s = torch.tensor([queued / len(window.losses)], device=stacked.device)
            *losses, mean_step_s = all_reduce_sum(torch.cat([stacked, step_s]) / world_size).tolist()
            self.vote.pace(mean_step_s)
        else:
            losses = stacked.tolist()
        first = self.pos.step - len(losses) + 1
        rates = self.meter.window()  # after the sync above: the window's steps have run
        rows = [
            {"step": first + i, "epoch": window.epochs[i], "loss": value, "lr": window.lrs[i], **rates}
            for i, value in enumerate(losses)
        ]
        return losses, rows

    def beat(self, where: str, step: int | None = None) -> None:
        """Tell the hang watchdog where this rank is (costs well under a microsecond)."""
        if self.watchdog is not None:
            self.watchdog.beat(self.pos.step if step is None else step, where)


def eval_states(scheduler: Schedule, early_stopping: Stateful | None, best: BestWeights | None) -> dict[str, Any]:
    """A checkpoint's entries that evaluations move: the schedule (ReduceLROnPlateau's), early stopping, best; copies,
    which later evaluations leave as they are."""
    return copy.deepcopy(
        {
            "scheduler": scheduler.state_dict(),
            "early_stopping": early_stopping.state_dict() if early_stopping else None,
            "best": best.to_dict() if best else None,
        }
    )
