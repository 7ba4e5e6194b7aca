"""Trainer: the training loop written for you, done right, and read top to bottom in ``fit()``.

    with redline.Trainer(task, max_steps=1000, out_dir="runs/digits", checkpoint_every=100) as trainer:
        summary = trainer.fit()      # resumable: Trainer(..., resume="auto").fit() continues it

Every step runs through the Runtime (device, precision, compile, loading). Losses stay on the
device and are read every ``log_every`` steps, never per step. Checkpoints are atomic and resume
bitwise-exactly on CPU (same thread count, deterministic dataset). SIGTERM or SIGINT finishes the
current step, writes a checkpoint and returns. The Trainer decides when to checkpoint and what
run position to store; the Runtime writes and reads the checkpoint (``Runtime.save`` / ``load``).
The process-wide settings the run needs stay applied until ``close()`` (or the end of ``with``).
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import default_collate

from redline import checkpoint
from redline.checkpoint import Checkpoint
from redline.errors import TrainingError
from redline.hardware.device import probe_accelerators
from redline.parallel.collectives import StopVote
from redline.parallel.env import join_process_group, mark_finished, read_env
from redline.plan.device import resolve_device
from redline.runtime.contract import count_tokens, split_batch, task_loss, user_code, users_failure
from redline.runtime.cycle import hang_watchdog
from redline.runtime.measure import FINGERPRINT_HINT, measure_run
from redline.runtime.options import RuntimeOptions
from redline.runtime.runtime import Runtime
from redline.runtime.samples import count_batch
from redline.runtime.snapshot import record_memory_history
from redline.task import Task, require_task
from redline.train import resume, run_dir
from redline.train.agreement import check_optimizers_agree, check_ranks_agree, data_digests
from redline.train.best import best_weights
from redline.train.callbacks import Callback, call_hooks, check_callbacks, warn_if_stopping_cannot_act
from redline.train.config import TrainerConfig
from redline.train.data import fixed_shapes, job_size, no_batch, plan_length, train_loader
from redline.train.evaluation import check_val_data, evaluate_model
from redline.train.failures import check_finite, keeping_steps, step_failure
from redline.train.inference import TrainedModel
from redline.train.lock import holding_out_dir
from redline.train.logs import TRAIN_COLUMNS as LOG_COLUMNS
from redline.train.output import prepare_out_dir, write_results
from redline.train.progress import Progress
from redline.train.schedule import Schedule
from redline.train.signals import StopOnSignal
from redline.train.state import Position, Run, Window, eval_states
from redline.train.summary import LOSS_WINDOW, TrainSummary, summarize, take_sample
from redline.train.throughput import Throughput
from redline.train.tuned import resumed_batch, resumed_choices, use_tuned

__all__ = ["LOG_COLUMNS", "Trainer", "TrainingError"]


class Trainer(TrainedModel):
    """Train a Task with checkpoints, exact resume, logs, progress, throughput and MFU.

    Pass a ``TrainerConfig`` or its fields as keywords (``Trainer(task, max_steps=100)``); the
    Runtime's options go in ``runtime=RuntimeOptions(...)``. ``callbacks`` hook into the loop; an
    ``EarlyStopping`` among them stops the run when its metric stops improving.
    """

    def __init__(
        self,
        task: Task,
        config: TrainerConfig | None = None,
        *,
        callbacks: Sequence[Callback] | None = (),
        **fields: Any,
    ) -> None:
        self.task = require_task(task)
        self.config = TrainerConfig.build(config, **fields)
        self.config.check_task(self.task)
        self.options = self.config.runtime
        self.max_epochs = self.config.epochs_for(self.task)
        self.batch_size = self.config.batch_size or task.batch_size
        self.out_dir = prepare_out_dir(self.config.out_dir) if self.config.out_dir is not None else None
        self.callbacks, self.early_stopping = check_callbacks(callbacks, self.task)
        self.seed = self.options.seed if self.options.seed is not None else 0
        self._signals = StopOnSignal()
        self.env = read_env()
        self._batches_per_epoch: int | None = 1  # None for a stream of unknown length
        self._evaluated_at: int | None = None
        self._owed_eval = False  # the resumed step's evaluation was due and failed: the resume runs it first
        self._stored_stop = ""  # why the run the resumed checkpoint belongs to ended, if it did
        self._stored_losses: list[float] = []  # its last steps' losses: the summary's final loss goes on from them
        self.best = best_weights(self.config.keep_best, self.out_dir)  # the best evaluation's weights, if kept
        self.rt: Runtime | None = None
        self.model: nn.Module | None = None
        self._group = contextlib.ExitStack()  # the launched job's process group, once joined

    @property
    def signalled(self) -> bool:
        """Whether SIGTERM or SIGINT reached this process while fit() trained (a rerun of an ended run trains not)."""
        return self._signals.received is not None

    def close(self) -> None:
        """Put back the process-wide settings the run applied and leave its process group (idempotent)."""
        if self.rt is not None:
            self.rt.close()
        self._group.close()

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- fit: the loop ---------------------------------------------------------------------------

    def fit(self) -> TrainSummary:
        """Train a fresh model from the task until max_steps, max_epochs, early stopping or a signal (or go on from
        the checkpoint ``resume`` names); return the summary."""
        self.env, self._began = read_env(), time.perf_counter()  # the fit's time end to end counts its setting up
        self._join_group()  # the ranks meet first: rank 0 holds out_dir for them all
        with holding_out_dir(self.out_dir):  # one run at a time writes there: a second is refused at once
            return self._fit()

    def _fit(self) -> TrainSummary:
        run = self._start()
        if isinstance(run, TrainSummary):  # a rerun of a run that had ended: left as it was
            mark_finished(self.env)
            call_hooks(self.callbacks, "on_fit_end", self, run)  # fit ended, as every fit does
            return run
        history = record_memory_history(run.rt.device) if self.config.memory_history else contextlib.nullcontext()
        config = self.config
        run.watchdog = hang_watchdog(self.env, self.out_dir, config.hang_timeout_s, config.hang_start_timeout_s)
        kept = keeping_steps(run, lambda: self._keep_steps(run), distributed=self.env.distributed)
        with self._signals, run.loggers, run.watchdog or contextlib.nullcontext(), history, kept:
            if run.owed_eval and self._evaluate(run):
                run.stopped = "early stopping"
            collate = self.task.collate_fn or default_collate  # what a batch that is no pair is blamed on
            while not run.stopped and run.pos.epoch < self.max_epochs:
                run.sampler.set_epoch(run.pos.epoch, skip=run.pos.batches_in_epoch * self.batch_size)
                for batch in run.step_batches():  # each step's start marked before its first batch is read
                    inputs, targets = split_batch(batch, "train_data", collate_fn=collate)
                    if self._train_step(run, inputs, targets):
                        run.stopped = self._after_step(run)
                        if run.stopped:
                            break
                else:
                    if run.pos.batches_in_epoch == 0:  # the steps before are kept: resumed, the run goes on
                        raise no_batch(run.pos.epoch, self.env.world_size)  # the steps before: kept by `kept`
                    with run.pos.next_epoch():
                        run.stopped = self._after_epoch(run)
            self._finish(run)
            run.progress.close()
            run.beat("summary and final weights (gathered under FSDP)")  # still watched: both are collective
            summary = summarize(self.task.name, run, self._batches_per_epoch, take_sample(self.task, run), self.best)
            if self.out_dir:
                write_results(run.rt, self.out_dir, summary.to_dict(), main=self.env.is_main)
        mark_finished(self.env, signalled=summary.stopped.startswith("signal"), received=self.signalled)  # 0 or 143
        call_hooks(self.callbacks, "on_fit_end", self, summary)
        return summary

    def _train_step(self, run: Run, inputs: Any, targets: Any) -> bool:
        """Run one micro-batch; return whether it completed an optimizer step."""
        try:
            return self._micro_step(run, inputs, targets)
        except Exception as exc:
            failure = step_failure(exc, run.pos.step + 1, run.rt.last_snapshot, in_optimizer=run.in_optimizer_step)
            if failure is None:
                raise
            raise failure from exc

    def _micro_step(self, run: Run, inputs: Any, targets: Any) -> bool:
        run.beat("forward and backward (gradient all-reduce)", step=run.pos.step + 1)
        # a one-element loss of shape (1,) is one number too: stacked as it came, the window's losses would nest
        loss = self._forward_backward(run.rt, run.model, inputs, targets, run.pos).detach().reshape(())
        run.micro_loss = loss if run.micro_loss is None else run.micro_loss + loss
        run.pos.batches_in_epoch += 1
        samples, tokens = count_batch(inputs, targets), count_tokens(targets)
        run.pos.samples += samples * self.env.world_size  # every rank takes an equal share of the global batch
        run.meter.count(samples, tokens)
        lr = float(run.optimizer.param_groups[0]["lr"])  # the rate this step applies, before the scheduler moves it
        with run.optimizer_step():  # a failure inside may leave the weights or the schedule half updated
            if not run.rt.step(run.optimizer):
                return False
            run.pos.step += 1
            run.scheduler.after_step(run.pos.step)
        run.window.losses.append(run.micro_loss / run.rt.options.grad_accum)  # the step's mean loss
        run.window.lrs.append(lr)
        run.window.epochs.append(run.pos.epoch)
        run.micro_loss = run.before_eval = None
        run.meter.first_step_done(inputs, targets, run.model)
        return True

    def _after_step(self, run: Run) -> str:
        """Log, evaluate and checkpoint when due (where the work is done, _finish does); return why the run stops."""
        step = run.pos.step
        period_s = 60 * self.config.checkpoint_period_minutes if self.out_dir else 0.0
        timed = bool(period_s) and time.perf_counter() - run.checkpointed_at >= period_s
        agreed = run.vote.vote(self._signals.received is not None, step, checkpoint=timed)  # the same on every rank
        stopped = run.stopped = self._stop_reason(step, run.total, agreed.stop)  # what steps kept from here hold
        if stopped in ("max_steps", "epochs"):  # as at an epoch's end: its checkpoint before the final evaluation
            return stopped
        self._signals.announce(checkpointing=self.out_dir is not None)
        due_ckpt = bool(self.config.checkpoint_every and step % self.config.checkpoint_every == 0) or agreed.checkpoint
        if step % self.config.log_every == 0 or stopped or due_ckpt:  # a checkpoint must not hold a NaN
            run.beat("logging (loss all-reduce)")
            self._flush(run)
        eval_due = self.config.eval_every and step % self.config.eval_every == 0 and self.task.val_data is not None
        if not (run.val_checked or eval_due or stopped):  # val_data's first batch after the run's first step (unless
            check_val_data(self.task, run, self.batch_size // self.env.world_size, self.env)  # it evaluates now)
        run.val_checked = True  # a mistake in it stops the run now, not at its first evaluation
        if eval_due and self._evaluate(run):
            stopped = stopped or "early stopping"
        elif eval_due and not stopped:  # a signal that came during the evaluation stops the run here
            stopped = run.stopped = self._signalled_in_eval(run)
        if self.out_dir and (due_ckpt or stopped):
            run.last_ckpt = self._checkpoint(run, stopped)
        if not run.window.losses:  # the next log window times steps, not this evaluation or checkpoint
            run.window.start, run.window.excluded_s = time.perf_counter(), run.meter.excluded_s
        return stopped

    def _after_epoch(self, run: Run) -> str:
        """Evaluate at an epoch's end unless evaluation runs every N steps; return why the run stops."""
        if self.config.eval_every or self.task.val_data is None:
            return ""
        # A failure inside keeps the steps before this evaluation (to the epoch's last step, or the start of a step
        # whose micro-batches span its end): the resumed run does it again, so what it moves is held as it stood
        inside = run.micro_loss is not None
        run.hold_before_eval(eval_states(run.scheduler, self.early_stopping, self.best))
        stop = self._evaluate(run)
        if not inside:  # evaluated: steps kept from here on hold what it moved (a step inside holds it to its end)
            run.before_eval = None
        if not stop:  # a signal that came during the evaluation stops the run here, at a step's end
            signalled = "" if inside else self._signalled_in_eval(run)
            if signalled and self.out_dir:  # the step's checkpoint (again, if one was due) holds its evaluation
                run.last_ckpt = self._checkpoint(run, signalled)
            return signalled
        if self.out_dir:  # the step's checkpoint (again, if one was due) holds the stop: a rerun finds it
            if run.window.losses:  # a checkpoint must not hold a NaN
                self._flush(run)
            if inside:  # stopped inside a step: its start is what a resume with more patience redoes
                run.back_to_step_start()
            run.last_ckpt = self._checkpoint(run, "early stopping")
        return "early stopping"

    def _signalled_in_eval(self, run: Run) -> str:
        """Why the run stops after an evaluation during which SIGTERM or SIGINT came to any rank (agreed by every rank
        at once), or "": else it would train one more step before a vote saw the signal, with nothing said."""
        if not run.vote.now(self._signals.received is not None):
            return ""
        self._signals.announce(checkpointing=self.out_dir is not None, after="this evaluation")
        if run.window.losses:  # a checkpoint must not hold a NaN
            self._flush(run)
        return self._signals.reason(self.env.distributed)

    def _keep_steps(self, run: Run) -> str | None:
        """Checkpoint the steps since the last checkpoint (all ranks together); return where they are."""
        if run.window.losses:  # a checkpoint must not hold a NaN
            self._flush(run)
        if run.pos.step:
            self._checkpoint_if_new(run, run.stopped)
        return str(run.last_ckpt.path) if run.last_ckpt else None

    def _checkpoint_if_new(self, run: Run, stopped: str) -> None:
        if self.out_dir and (run.last_ckpt is None or run.last_ckpt.step != run.pos.step):
            run.last_ckpt = self._checkpoint(run, stopped)

    def _finish(self, run: Run) -> None:
        """Log the last steps, write the final checkpoint, and evaluate the final model: from the checkpoint on, a
        signal is said at once, and a second Ctrl-C skips the results alone (``StopOnSignal.finishing``)."""
        run.vote.close()
        if run.window.losses:
            self._flush(run)
        run.stopped = run.stopped or "epochs"
        self._checkpoint_if_new(run, run.stopped)
        kept = str(run.last_ckpt.path) if self.out_dir and run.last_ckpt else None
        self._signals.finishing(kept, by_signal=run.stopped.startswith("signal"))
        if self.task.val_data is not None and self._evaluated_at != run.pos.step:
            self._evaluate(run)

    def _forward_backward(self, rt: Runtime, model: nn.Module, inputs: Any, targets: Any, pos: Position) -> Tensor:
        def loss_of(batch: tuple[Any, Any]) -> torch.Tensor:  # of the batch, or of a micro-batch (--micro-batch)
            # a failed collective and an out-of-memory pass through (FSDP gathers weights in the forward)
            with user_code(f"step {pos.step + 1}", *batch) as forward:
                forward.outputs = model(batch[0])
                return task_loss(self.task.loss_fn, forward.outputs, batch[1])

        return rt.train_step(loss_of, (inputs, targets))

    def _stop_reason(self, step: int, total: float, signalled: bool) -> str:
        """Why the run stops after ``step``, or "". A run whose work is done ends for that, signal or not."""
        if self.config.max_steps is not None and step >= self.config.max_steps:
            return "max_steps"
        if step >= total:
            return "epochs"
        return self._signals.reason(self.env.distributed) if signalled else ""

    # -- setup and resume -----------------------------------------------------------------------

    def _start(self) -> Run | TrainSummary:
        self._evaluated_at, self._stored_stop, self._stored_losses = None, "", []  # nothing of a first fit()'s
        if self.early_stopping is not None:  # nor does it watch the first's evaluations (a resumed run loads its own)
            self.early_stopping.reset()
        self.best = best_weights(self.config.keep_best, self.out_dir)
        resumed = self._find_resume()
        resume.warn_unsaved(resumed, self.out_dir, self.env, replaced=self.model)
        if self.out_dir is not None:  # no earlier run's checkpoints under a new run; no killed write's leftovers
            run_dir.prepare_checkpoint_dir(self._checkpoint_root(), self.env, resume=self.config.resume, found=resumed)
        options = resume.resumed_options(self.options, resumed, self.env)
        self.seed = options.seed if options.seed is not None else 0  # a resumed run's data order goes on as it was
        self.batch_size = resumed_batch(resumed, self.config.batch_size or self.task.batch_size)
        tuned = None if resumed else use_tuned(self.task, options, self.batch_size, self.env, config=self.config)
        if tuned is not None:  # the tuned settings, maybe the same batch as micro-batches
            options, self.batch_size = tuned.options, tuned.batch_size
        length = functools.partial(
            plan_length, self.task.train_data, batch_size=self.batch_size, world_size=self.env.world_size,
            grad_accum=options.grad_accum, max_epochs=self.max_epochs, max_steps=self.config.max_steps,
            warn=self.env.is_main,
        )  # fmt: skip
        total, self._batches_per_epoch = length()
        trial = "off" if resumed is not None else self.config.trial  # a resumed run keeps its stored Plan
        measured, trial_seconds = measure_run(self.task, options, self.batch_size, total, self.env, trial=trial)
        rt, model, optimizer, scheduler, pos = self._setup(options, resumed, int(total), measured)
        if tuned is not None:
            rt.adopt_reasons(tuned.tuning.reasons, tuned.tuning.note)
        ended, done = resume.ended_run(
            pos, self._stored_stop, total=total, max_epochs=self.max_epochs, max_steps=self.config.max_steps,
            out_dir=self.out_dir, env=self.env, stopping=self.early_stopping, found=resumed,
        ) if resumed else (None, "")  # fmt: skip
        if ended is not None:
            return ended
        split = (self.config.batch_size or self.task.batch_size) // self.batch_size  # a tuned run's micro-batches
        pos.check_resume(
            resumed, batch_size=self.batch_size, split=split, world_size=self.env.world_size, task=self.task,
            train_samples=job_size(self.task.train_data, self.env.world_size), data_hashes=data_digests(self.task),
        )  # fmt: skip
        compiled = rt.explain().compile  # a compiled model keeps one shape: a partial batch would compile again
        drop_last = fixed_shapes(self.task.train_data, self.batch_size, self.env, compiled=compiled, model=model)
        if drop_last:  # the epochs are a partial batch shorter
            total, self._batches_per_epoch = length(drop_last=True)
        if resumed is None and self.env.is_main:  # said once, before a new run trains
            warn_if_stopping_cannot_act(
                self.early_stopping, total, self._batches_per_epoch, eval_every=self.config.eval_every,
                grad_accum=options.grad_accum,
            )  # fmt: skip
        loader, sampler = train_loader(
            self.task.train_data, batch_size=self.batch_size, seed=self.seed, rank=self.env.rank,
            world_size=self.env.world_size, drop_last=drop_last, collate_fn=self.task.collate_fn, start_step=pos.step,
        )  # fmt: skip
        model.train()
        main = self.env.is_main
        loggers = resume.run_loggers(
            self.config, self.out_dir if main else None, pos if resumed else None, self._batches_per_epoch,
            validates=self.task.val_data is not None, evaluates_again=bool(done) or self._owed_eval,
            stopped=self._stored_stop, grad_accum=options.grad_accum,
        )  # fmt: skip
        return Run(
            rt=rt,
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            sampler=sampler,
            batches=rt.setup_loader(loader),
            pos=pos,
            total=total,
            loggers=loggers,
            owed_eval=resumed is not None and self._owed_eval,
            val_checked=resumed is not None and self._owed_eval,  # evaluated whole before the first step
            progress=Progress(int(total), enabled=self.config.progress and main, start_step=pos.step),
            meter=Throughput(rt, self.task, world_size=self.env.world_size),
            vote=StopVote(),
            resumed=resumed,
            last_ckpt=resumed,
            stopped=done,  # a resumed run with nothing left to train (its summary lost) writes its results again
            losses=list(self._stored_losses),
            keeps_steps=self.out_dir is not None,
            start=self._began,
            trial_seconds=trial_seconds,
        )

    def _setup(
        self, options: RuntimeOptions, found: Checkpoint | None, planned_steps: int, measured: Any = None
    ) -> tuple[Runtime, nn.Module, Any, Any, Position]:
        if self.rt is not None:  # a second fit (or evaluate, then fit) starts from a fresh Runtime
            self.rt.close()
        # Seeded before the model is built; the loop's own watchdog knows more phases. A resume steps as it stepped.
        measured = resumed_choices(found, measured, options, self.env)
        rt = Runtime(options, planned_steps=planned_steps, measured=measured, watch_hangs=False).start()
        rt.snapshot_dir, self.rt = self.out_dir, rt  # snapshot_dir: where an out-of-memory on CUDA leaves its snapshot
        with users_failure(f"task {self.task.name!r}: building the model", FINGERPRINT_HINT):
            built = self.task.build_model()
        check_ranks_agree(self.config, self.task, built, self.env)  # before DDP's wrap compares shapes its own way
        model, optimizer = rt.setup(built, self.task.optimizer)
        check_optimizers_agree(optimizer, self.env)  # before the ranks can train apart
        scheduler = Schedule.build(self.task, optimizer)
        pos = Position(batch_size=self.batch_size)
        if found is not None:
            state = resume.load_run(rt, found, self.task.name, scheduler, stopping=self.early_stopping, best=self.best)
            pos = Position.from_state(state)
            self._stored_stop = state.get("stopped") or ""
            self._stored_losses = [float(v) for v in state.get("recent_losses") or []]  # none in an older one
            self._owed_eval = resume.owes_evaluation(state, pos.step, self.config.eval_every, self.task.val_data)
        self.model = model
        return rt, model, optimizer, scheduler, pos

    def _find_resume(self) -> Checkpoint | None:
        """Join the launched job's process group, then find the checkpoint to resume from, all ranks together."""
        self._join_group()
        return resume.find_resume(self.config.resume, self._checkpoint_root() if self.out_dir else None, self.env)

    def _join_group(self) -> None:
        """Meet the other workers before anything they must agree on (the checkpoint to resume from)."""
        if self.env.distributed or self.env.launched:
            device = resolve_device(self.options.devices, probe_accelerators())
            self._group.enter_context(join_process_group(self.env, torch.device(device.value).type))

    def _checkpoint_root(self) -> Path:
        return self.out_dir / "checkpoints" if self.out_dir else Path(".")

    def _checkpoint(self, run: Run, stopped: str) -> Checkpoint:
        """Write the checkpoint of this step from every rank, keep the newest few, tell the callbacks on rank 0;
        ``stopped`` is why the run ends here ("" while it goes on): a rerun of an ended run knows it."""
        run.beat("checkpoint")
        pos, states = run.pos, run.held_back or eval_states(run.scheduler, self.early_stopping, self.best)
        extra = {
            **pos.to_state(),
            "stopped": stopped,
            "evaluated": self._evaluated_at == pos.step,  # False where this step's due evaluation failed
            "recent_losses": run.losses[-LOSS_WINDOW:],
            **states,  # put back to a step's start (held_back): as they were before its evaluation
        }
        root, last = self._checkpoint_root(), run.last_ckpt
        with run.meter.excluded("checkpoint"):  # the older ones' removal too: on a network disk it takes seconds
            written = run.rt.save(checkpoint.step_dir(root, pos.step), extra=extra, step=pos.step)
            run.last_ckpt = written  # before the hooks: one that raises leaves it committed, not to be written again
            if self.env.is_main:
                checkpoint.prune(root, self.config.checkpoints_kept, corrupt=run.resumed.skipped if run.resumed else ())
        run.checkpointed_at = time.perf_counter()
        # a step's checkpoint this run wrote again (to hold the epoch's early stop, _after_epoch) is told of once
        if self.env.is_main and (last is None or last is run.resumed or last.step != pos.step):
            with run.meter.excluded("callbacks"):
                call_hooks(self.callbacks, "on_checkpoint", self, pos.step, str(written.path))
        return written

    # -- logging, evaluation, summary ------------------------------------------------------------

    def _flush(self, run: Run) -> None:
        """Read the window's losses (one device sync; averaged over the ranks), check them, log a row per step."""
        window, pos = run.window, run.pos
        losses, rows = run.read_window(distributed=self.env.distributed, world_size=self.env.world_size)
        if not window.logged:  # a window that fails the check is flushed again (the steps kept): logged once
            run.loggers.log(rows)
        window.logged = True
        # after the log: the steps up to a NaN show in it
        check_finite(losses, rows[0]["step"], run.last_ckpt, precision=run.rt.precision.name)
        rates = rows[-1]  # the window's, on each of its rows
        run.progress.update(
            pos.step, loss=losses[-1], samples_per_s=rates["samples_per_s"], epoch=pos.epoch + 1,
            step_ms=rates["step_time_ms"], excluded_s=run.meter.excluded_s,
        )  # fmt: skip
        run.losses += losses
        run.window = Window(excluded_s=run.meter.excluded_s)
        with run.meter.excluded("callbacks"):  # inside the next window: its rates leave them out
            call_hooks(self.callbacks, "on_step", self, pos.step, losses[-1])  # after the window: its steps are kept

    def _evaluate(self, run: Run) -> bool:
        """Evaluate, log, judge, then tell callbacks; return whether early stopping says stop.

        Everything the evaluation moves (the schedule, early stopping's verdict, keep-best) is done before the
        callbacks: one that raises keeps the steps with it, and the resumed run stops where the unbroken one does.
        """
        run.beat("evaluate")
        where = f"evaluation at step {run.pos.step}"
        with run.meter.excluded("eval"):  # each rank in batches of its share of a training batch, as a step holds
            size = self.batch_size // self.env.world_size
            run.metrics = evaluate_model(self.task, run.model, run.rt, size, self.env, where=where)
        self._evaluated_at = run.pos.step
        run.scheduler.after_evaluation(run.metrics)  # a ReduceLROnPlateau steps on it
        run.loggers.log_eval(run.pos.step, run.metrics)
        stop = self.early_stopping is not None and self.early_stopping.should_stop(run.metrics)
        if stop:
            run.stopped = run.stopped or "early stopping"
        if self.best is not None:
            with run.meter.excluded("checkpoint"):  # written as a checkpoint is: left out of the rates
                self.best.offer(run.rt, run.metrics, run.pos.step, main=self.env.is_main)
        with run.meter.excluded("callbacks"):
            call_hooks(self.callbacks, "on_evaluate", self, run.pos.step, run.metrics)
        return stop

    def _ready(self) -> tuple[Runtime, nn.Module]:
        if self.rt is None or self.model is None:
            found = self._find_resume()  # a resumed Trainer evaluates the checkpoint's model
            self._setup(resume.resumed_options(self.options, found, self.env), found, planned_steps=1)
        assert self.rt is not None and self.model is not None
        return self.rt, self.model
