"""The Trainer on CPU: exact resume after SIGKILL, corrupt checkpoints, SIGTERM, NaN, early stopping."""

import csv
import dataclasses
import json
import math
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from torch.utils.data import TensorDataset

import redline
from redline import checkpoint as ckpt
from redline.errors import ConfigError
from redline.train.callbacks import EarlyStopping
from redline.train.failures import check_finite
from redline.train.trainer import Trainer, TrainingError

JOB = Path(__file__).with_name("trainer_job.py")
STEPS = 20


def run_job(out: Path, *args: str, steps: int = STEPS) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(JOB), str(out), str(steps), *args], capture_output=True, text=True, timeout=240
    )


def weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(out / "model.safetensors")


def assert_bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), f"{name} differs by {(a[name] - b[name]).abs().max():.3g}"


@pytest.fixture(scope="module")
def unbroken(tmp_path_factory) -> dict[str, torch.Tensor]:
    out = tmp_path_factory.mktemp("unbroken")
    result = run_job(out)
    assert result.returncode == 0, result.stderr
    return weights(out)


@pytest.mark.parametrize(
    "kill",
    [
        ["--kill-at-step", "7"],  # between steps, mid-epoch, after the checkpoint of step 6
        ["--kill-at-step", "14"],  # the step after an epoch boundary (13 batches an epoch)
        ["--kill-in-checkpoint", "12"],  # between checkpoint 12's manifest and its rename: 12 is put in place
    ],
    ids=["between-steps", "after-epoch-boundary", "during-checkpoint-write"],
)
def test_sigkill_then_resume_is_bitwise_equal_to_the_unbroken_run(tmp_path, kill, unbroken):
    killed = run_job(tmp_path, *kill)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert not (tmp_path / "model.safetensors").exists()
    resumed = run_job(tmp_path, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert f"done steps={STEPS}" in resumed.stdout
    assert_bitwise_equal(weights(tmp_path), unbroken)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["resumed_from"] and "from checkpoint step" in summary["plan"]["precision"]["reason"]
    steps = [int(row["step"]) for row in csv.DictReader((tmp_path / "metrics.csv").read_text().splitlines())]
    assert steps == list(range(1, STEPS + 1)), "the log should read as one unbroken run"


def test_a_corrupt_checkpoint_is_reported_and_the_previous_one_used(tmp_path, unbroken):
    assert run_job(tmp_path, "--kill-at-step", "13").returncode == -signal.SIGKILL
    newest = ckpt.find_checkpoints(tmp_path / "checkpoints")[-1]
    assert newest.step == 12
    blob = bytearray((newest.path / "optimizer.pt").read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    (newest.path / "optimizer.pt").write_bytes(bytes(blob))
    resumed = run_job(tmp_path, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert "corrupt" in resumed.stderr and "step-00000012" in resumed.stderr
    assert json.loads((tmp_path / "summary.json").read_text())["resumed_from"].endswith("step-00000009")
    assert_bitwise_equal(weights(tmp_path), unbroken)


def test_a_checkpoint_directory_without_its_manifest_is_no_checkpoint_and_not_resumed_past(tmp_path):
    root = tmp_path / "checkpoints"
    (root / "step-00000099").mkdir(parents=True)  # an interrupted copy, say: files without the manifest
    (root / "step-00000099" / "model.safetensors").write_bytes(b"partial")
    (root / ".tmp-step-00000100-123").mkdir()
    assert ckpt.find_checkpoints(root) == []  # listing and pruning leave it alone
    with pytest.raises(ckpt.CheckpointError, match=r"\(1 tried\)[^\n]*\n  .*step-00000099: not a committed"):
        ckpt.open_checkpoint("auto", root)  # the only one: a new run among it would lose that run
    assert ckpt.open_checkpoint("auto", tmp_path / "empty") is None  # no checkpoint at all: a new run


def test_resume_from_an_explicit_corrupt_path_fails_clearly(tmp_path):
    assert run_job(tmp_path, "--kill-at-step", "4").returncode == -signal.SIGKILL
    only = ckpt.find_checkpoints(tmp_path / "checkpoints")[-1]
    blob = bytearray((only.path / "model.safetensors").read_bytes())
    blob[-1] ^= 0xFF  # the size unchanged: only the checksum can tell
    (only.path / "model.safetensors").write_bytes(bytes(blob))
    with pytest.raises(ckpt.CheckpointError, match="checksum"):
        ckpt.open_checkpoint(str(only.path), tmp_path / "checkpoints")


def test_sigterm_finishes_the_step_writes_a_checkpoint_and_exits_cleanly(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, str(JOB), str(tmp_path), "100000", "--sleep", "0.05"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 120
    while not (tmp_path / "checkpoints").is_dir() and time.monotonic() < deadline:
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr
    assert "stopped=signal SIGTERM" in stdout
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["checkpoint"].endswith(f"step-{summary['steps']:08d}")
    assert ckpt.find_checkpoints(tmp_path / "checkpoints")[-1].step == summary["steps"]


def tiny_task(**overrides) -> redline.Task:
    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 4, generator=gen), torch.randint(0, 2, (64,), generator=gen))
    fields = {
        "model": lambda: nn.Linear(4, 2),
        "loss_fn": nn.functional.cross_entropy,
        "train_data": data,
        "val_data": data,
        "batch_size": 8,
        "epochs": 50,
        "metric": lambda out, y: (out.argmax(-1) == y).float().mean().item(),
    }
    return redline.Task(**{**fields, **overrides})


def quiet(task: redline.Task, **kwargs) -> Trainer:
    return Trainer(task, runtime=redline.RuntimeOptions(devices="cpu", seed=0), progress=False, **kwargs)


def test_a_nan_loss_stops_with_the_step_and_the_last_good_checkpoint(tmp_path):
    calls = {"n": 0}

    def loss_fn(out, y):
        # Count training steps only: the FLOP count runs the loss on meta tensors, evaluation without grad.
        calls["n"] += out.device.type != "meta" and torch.is_grad_enabled()
        loss = nn.functional.cross_entropy(out, y)
        return loss * float("nan") if calls["n"] == 9 else loss

    trainer = quiet(tiny_task(loss_fn=loss_fn), max_steps=30, checkpoint_every=4, log_every=5, out_dir=tmp_path)
    with pytest.raises(TrainingError, match=r"step 9: the loss is nan") as err:
        trainer.fit()
    assert "step-00000008" in str(err.value)  # the checkpoint at 8 was written before the NaN
    assert [c.step for c in ckpt.find_checkpoints(tmp_path / "checkpoints")] == [4, 8]
    # The window of the NaN is logged (once, though the failure flushes it again): the report shows the divergence
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(1, 11))
    assert [math.isnan(row["loss"]) for row in rows[7:]] == [False, True, True]
    assert "lower the learning rate, or clip gradients (--clip-grad-norm 1.0)" in str(err.value)


def test_a_nan_loss_at_the_first_step_points_at_the_data_not_the_learning_rate():
    """Before, every NaN said "lower the learning rate": at step 1 no update has run; the batch or the loss did it."""
    gen = torch.Generator().manual_seed(0)
    inputs = torch.randn(64, 4, generator=gen)
    inputs[:, 1] = math.nan  # a feature missing in every record, as a bad join leaves it
    data = TensorDataset(inputs, torch.randint(0, 2, (64,), generator=gen))
    with pytest.raises(TrainingError, match=r"step 1: the loss is nan") as err:
        quiet(tiny_task(train_data=data, val_data=None, metric=None), max_steps=3, log_every=1).fit()
    said = str(err.value)
    assert "hint: no optimizer step ran before it, so the learning rate is not the cause: look for NaN or inf" in said
    assert "the first batch's inputs or targets, and at task.loss_fn" in said
    assert "lower the learning rate" not in said


@pytest.mark.parametrize("precision", ["fp16-mixed", "bf16-mixed", "fp32"])
@pytest.mark.parametrize("step", [1, 9])
def test_a_nan_hint_names_bf16_only_for_an_fp16_run(step, precision):
    with pytest.raises(TrainingError) as err:
        check_finite([0.5, math.inf], step - 1, None, precision=precision)
    said = str(err.value)
    assert said.startswith(f"step {step}: the loss is inf; training stopped (no checkpoint was written yet)\nhint: ")
    assert ("lower the learning rate" in said) == (step > 1)
    assert ("first batch's inputs or targets" in said) == (step == 1)
    assert ("; or use bf16-mixed instead of fp16-mixed" in said) == (precision == "fp16-mixed")
    assert ("fp16" in said) == (precision == "fp16-mixed")


def test_callbacks_the_loop_could_not_call_are_refused_before_training():
    class OnStepOnly:  # duck-typed, with one hook of four: the first evaluation would fail mid-run
        def on_step(self, trainer, step, loss):
            pass

    class EveryHook(OnStepOnly, redline.Callback):
        pass

    class Unbound(redline.Callback):  # a hook that leaves out the trainer: before, a TypeError at the first log
        def on_step(self, step, loss):
            pass

    refused = {
        "a function": ([lambda *args: None], r"one is function, with no on_step, on_evaluate, on_checkpoint"),
        "one hook": ([OnStepOnly()], r"one is OnStepOnly, with no on_evaluate, on_checkpoint, on_fit_end"),
        "no list": (EveryHook(), r"expected a list of Callback objects\nhint: pass callbacks=\[EveryHook\(\.\.\.\)\]"),
        # a generator of them: the hint was callbacks=[generator(...)]
        "a generator": ((c for c in [EveryHook()]), r"Callback objects\nhint: pass callbacks=list\(\.\.\.\)$"),
        # a number: the hint was callbacks=[int(...)]
        "a number": (5, r"Callback objects\nhint: pass callbacks=\[MyCallback\(\)\], instances of redline\.Callback"),
        # the class itself: before, accepted, then every hook a TypeError mid-run
        "a class": (
            [EveryHook],
            r"one is the class EveryHook itself\nhint: pass an instance: callbacks=\[EveryHook\(\)\]",
        ),
        "a signature": (
            [Unbound()],
            r"Unbound.on_step: on_step cannot be called with 3 arguments(.|\n)*"
            r"hint: define it as def on_step\(self, trainer, step, loss\)",
        ),
    }
    for callbacks, said in refused.values():
        with pytest.raises(ConfigError, match=said):
            quiet(tiny_task(), max_steps=2, callbacks=callbacks)
    assert quiet(tiny_task(), max_steps=2, callbacks=(EveryHook(),)).fit().steps == 2


def test_a_failing_on_checkpoint_runs_once_and_the_error_names_the_checkpoint_it_left(tmp_path):
    """Before, the hook ran twice for one step, the checkpoint was written twice, and the error named none."""
    calls = []

    class Upload(redline.Callback):
        def on_checkpoint(self, trainer, step, path):
            calls.append(step)
            raise ValueError("upload failed")

    trainer = quiet(tiny_task(val_data=None), max_steps=6, checkpoint_every=4, out_dir=tmp_path, callbacks=[Upload()])
    with pytest.raises(TrainingError, match=r"callback Upload\.on_checkpoint raised ValueError: upload failed") as err:
        trainer.fit()
    assert calls == [4]
    assert f"the steps so far are saved in {tmp_path / 'checkpoints' / 'step-00000004'}" in str(err.value)


def test_early_stopping_stops_when_the_metric_stops_improving():
    frozen = tiny_task(optimizer=lambda params: torch.optim.SGD(params, lr=0.0))
    summary = quiet(frozen, eval_every=2, callbacks=[EarlyStopping(monitor="val_loss", patience=2)]).fit()
    assert summary.stopped == "early stopping"
    assert summary.steps == 6  # evals at 2 (best), 4 and 6 without improvement


def test_a_batch_of_the_wrong_shape_names_the_step_and_the_shapes():
    wrong = TensorDataset(torch.randn(16, 5), torch.randint(0, 2, (16,)))
    with pytest.raises(TrainingError, match=r"(?s)step 1: .*inputs Tensor\(8, 5\) float32.*hint"):
        quiet(tiny_task(train_data=wrong, val_data=None), max_steps=2).fit()


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_a_broken_collective_is_named_as_such_not_as_a_bad_batch(where):
    class PeerDies(torch.autograd.Function):  # what a rank meets when another died: NCCL's error
        @staticmethod
        def forward(ctx, x):
            if where == "forward":
                raise torch.distributed.DistBackendError("NCCL communicator was aborted on rank 0")
            return x

        @staticmethod
        def backward(ctx, grad):
            raise torch.distributed.DistBackendError("NCCL communicator was aborted on rank 0")

    class Model(nn.Linear):
        def forward(self, x):
            out = super().forward(x)
            return PeerDies.apply(out) if not out.is_meta and torch.is_grad_enabled() else out

    with pytest.raises(TrainingError, match=r"(?s)step 1: a collective with the other ranks failed.*another") as err:
        quiet(tiny_task(model=lambda: Model(4, 2), val_data=None), max_steps=2).fit()
    assert "shaped as the model expects" not in str(err.value)


@pytest.mark.parametrize(
    ("inputs", "targets", "says"),
    [
        (torch.float32, torch.int32, "expected target dtype to be Long"),  # labels of NumPy's int32
        (torch.float64, torch.int64, "mat1 and mat2 must have the same dtype"),  # inputs of NumPy's float64
    ],
)
def test_a_batch_of_the_wrong_dtype_gets_the_cast_to_make_not_a_hint_of_shapes(inputs, targets, says):
    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(
        torch.randn(16, 4, generator=gen).to(inputs), torch.randint(0, 2, (16,), generator=gen).to(targets)
    )
    with pytest.raises(TrainingError, match=rf"step 1: the model or loss raised RuntimeError: {says}") as err:
        quiet(tiny_task(train_data=data, val_data=None), max_steps=1, trial="off").fit()
    assert "\nhint: a dtype does not fit (the batch above shows each): cast in the dataset's __getitem__" in str(
        err.value
    )
    assert "shaped as the model expects" not in str(err.value)


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(1, 2, 3, bias=False)  # a convolution without bias: torch's other words for it

    def forward(self, x):
        return self.conv(x.unsqueeze(1)).mean(-1)


@pytest.mark.parametrize(
    ("build", "cast", "said"),
    [
        (lambda: nn.Linear(4, 2), "double", "float64 (a .double() model)"),
        (lambda: nn.Linear(4, 2), "half", "float16 (a .half() model)"),
        (ConvNet, "double", "float64 (a .double() model)"),
    ],
)
def test_a_model_cast_to_another_dtype_is_named_not_the_float32_inputs(build, cast, said):
    # The hint said to cast the inputs .float() "to match the model's float32 weights": they were float32 already.
    task = tiny_task(model=lambda: getattr(build(), cast)(), val_data=None)
    with pytest.raises(TrainingError, match=r"step 1: the model or loss raised RuntimeError: ") as err:
        quiet(task, max_steps=1, trial="off").fit()
    assert f"\nhint: the inputs are float32 and the model's weights are {said}: build the model in float32" in str(
        err.value
    )
    assert "a dtype does not fit" not in str(err.value)


ONEDNN = "could not create a primitive descriptor for the LSTM forward propagation primitive"  # a CPU's LSTM in fp16


@pytest.mark.parametrize(
    ("said", "precision", "told"),
    [
        (ONEDNN, "bf16-mixed", True),  # oneDNN's refusal under autocast: the precision's
        ("\"addmm_impl_cpu_\" not implemented for 'Half'", "fp32", True),  # named: half inputs in an fp32 run too
        (ONEDNN, "fp32", False),  # oneDNN refuses other things in fp32 too: not blamed on a precision
    ],
)
def test_an_op_without_a_kernel_for_the_reduced_precision_is_told_to_run_in_another_not_to_fix_the_data(
    said, precision, told
):
    class NoHalfKernel(nn.Linear):  # as a CPU's LSTM under fp16-mixed raised, whatever this machine's kernels take
        def forward(self, x):
            if not x.is_meta:
                raise RuntimeError(said)
            return super().forward(x)

    task = tiny_task(model=lambda: NoHalfKernel(4, 2), val_data=None)
    with pytest.raises(TrainingError, match=r"step 1: the model or loss raised RuntimeError: ") as err:
        runtime = redline.RuntimeOptions(devices="cpu", seed=0, precision=precision)
        Trainer(task, runtime=runtime, progress=False, max_steps=1, trial="off").fit()
    hint = "\nhint: an op of the model has no kernel for the reduced precision it ran in on this device"
    assert (hint in str(err.value)) is told
    assert ("run it with --precision fp32 (precision='fp32')" in str(err.value)) is told
    assert "a dtype does not fit" not in str(err.value)


def test_a_val_data_the_model_refuses_is_named_in_the_hint_not_the_dataset_the_steps_ran_on():
    gen = torch.Generator().manual_seed(0)
    narrower = TensorDataset(torch.randn(16, 3, generator=gen), torch.randint(0, 2, (16,), generator=gen))
    # found after the first step, in val_data's first batch: not at the evaluation of step 2
    with pytest.raises(
        TrainingError, match=r"val_data's first batch, after step 1: the model or loss raised Runt"
    ) as err:
        quiet(tiny_task(val_data=narrower), max_steps=2, eval_every=2, trial="off").fit()
    assert (
        "\nhint: check that val_data's items are (inputs, targets) shaped as train_data's, on which the steps ran"
        in (str(err.value))
    )


def test_a_checkpoint_of_a_users_own_loop_is_refused_clearly(tmp_path):
    with redline.Runtime(devices="cpu") as rt:
        rt.setup(nn.Linear(4, 2), lambda params: torch.optim.SGD(params, lr=0.1))
        rt.save(tmp_path / "step-00000003", extra={"epoch": 1}, step=3)
    trainer = quiet(tiny_task(), max_steps=4, resume=tmp_path / "step-00000003")
    with pytest.raises(ckpt.CheckpointError, match="not written by the Trainer"):
        trainer.fit()


def test_scheduler_steps_with_the_optimizer_and_each_row_has_the_lr_its_step_used(tmp_path):
    warmup = tiny_task(
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
        scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4)),
    )
    quiet(warmup, max_steps=6, log_every=3, out_dir=tmp_path).fit()
    rows = list(csv.DictReader((tmp_path / "metrics.csv").read_text().splitlines()))
    # step 1 trains at the warmup's first rate (0.1 / 4), not at the rate the scheduler sets for step 2
    assert [float(r["lr"]) for r in rows] == pytest.approx([0.025, 0.05, 0.075, 0.1, 0.1, 0.1])


def test_evaluate_and_predict():
    trainer = quiet(tiny_task(), max_steps=10)
    summary = trainer.fit()
    metrics = trainer.evaluate()
    assert metrics["val_loss"] == pytest.approx(summary.val_loss)
    outputs = trainer.predict(tiny_task().train_data)
    assert outputs.shape == (64, 2) and outputs.device.type == "cpu"
    with pytest.raises(ConfigError, match=r"(?s)len\(data\)=0 is not allowed.*hint"):
        trainer.predict(TensorDataset(torch.randn(0, 4)))


def test_summary_reports_throughput_and_mfu_na_on_cpu():
    summary = quiet(tiny_task(), max_steps=12, log_every=4).fit()
    assert summary.samples_per_s > 0 and summary.steps == 12
    assert summary.mfu is None  # a CPU has no datasheet peak: n/a, never a guess
    assert summary.flops_per_step == 2 * (2 * 8 * 4 * 2)  # forward and weight-gradient matmuls of Linear(4, 2)


def test_bad_options_are_refused():
    with pytest.raises(ConfigError, match="max_steps"):
        quiet(tiny_task(), max_steps=0)
    with pytest.raises(ConfigError, match="out_dir"):
        quiet(tiny_task(), resume="auto")


def test_tensorboard_logger_writes_events_tensorboard_can_read(tmp_path):
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    quiet(tiny_task(), max_steps=6, log_every=3, out_dir=tmp_path, loggers=("csv", "tensorboard")).fit()
    events = event_accumulator.EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("loss")] == [1, 2, 3, 4, 5, 6]
    assert "val/loss" in events.Tags()["scalars"]


def test_a_resumed_run_keeps_the_accumulation_its_checkpoint_was_written_with(tmp_path):
    def losses(out: Path) -> list[float]:
        return [float(row["loss"]) for row in csv.DictReader((out / "metrics.csv").read_text().splitlines())]

    accumulating = redline.RuntimeOptions(devices="cpu", seed=0, grad_accum=2)
    unbroken = tmp_path / "unbroken"
    Trainer(tiny_task(), runtime=accumulating, progress=False, max_steps=6, log_every=1, out_dir=unbroken).fit()
    resumed = tmp_path / "resumed"
    Trainer(tiny_task(), runtime=accumulating, progress=False, max_steps=4, log_every=1, out_dir=resumed).fit()
    summary = quiet(
        tiny_task(), max_steps=6, log_every=1, out_dir=resumed, resume="auto"
    ).fit()  # grad_accum not repeated
    assert summary.plan.grad_accum.value == 2 and summary.steps == 6
    assert losses(resumed) == losses(unbroken)  # the step's mean loss, not the sum of its micro-batches


def test_a_run_that_ended_on_its_last_epoch_is_left_as_it_was_when_rerun(tmp_path):
    quiet(tiny_task(), max_epochs=2, out_dir=tmp_path).fit()  # stops on the last step, before its epoch count moves on
    files = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    again = quiet(tiny_task(), max_epochs=2, out_dir=tmp_path, resume="auto").fit()
    assert again.to_dict() == json.loads(files["summary.json"])  # not a summary of a rerun that trained nothing
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()} == files  # no second eval row
    assert quiet(tiny_task(), max_epochs=3, out_dir=tmp_path, resume="auto").fit().steps == 24  # more epochs train on


def test_accumulation_that_does_not_divide_an_epoch_still_trains_every_epoch():
    accumulating = redline.RuntimeOptions(devices="cpu", seed=0, grad_accum=3)  # 8 batches an epoch
    summary = Trainer(tiny_task(), runtime=accumulating, progress=False, max_epochs=2).fit()
    assert (summary.steps, summary.samples) == (5, 120)  # 16 batches: 5 full cycles, not 2 x (8 // 3) = 4 steps
    with pytest.raises(ConfigError, match=r"(?s)grad_accum=20 needs 20 batches.*never step.*hint"):
        too_many = redline.RuntimeOptions.build(accumulating, grad_accum=20)
        Trainer(tiny_task(), runtime=too_many, progress=False, max_epochs=2).fit()


def test_logged_step_times_leave_out_the_evaluation_at_an_epochs_end(tmp_path):
    def slow_metric(out, y):
        time.sleep(0.2)  # 8 validation batches: 1.6 s an evaluation
        return (out.argmax(-1) == y).float().mean().item()

    quiet(tiny_task(metric=slow_metric), max_epochs=3, log_every=16, out_dir=tmp_path).fit()  # a window spans an epoch
    rows = list(csv.DictReader((tmp_path / "metrics.csv").read_text().splitlines()))
    assert len(rows) == 24
    # with the evaluation counted, a step of a 16-step window would take at least 1600 / 16 = 100 ms; a step
    # of this tiny model takes a few, and the margin leaves room for a machine loaded by other work
    assert max(float(r["step_time_ms"]) for r in rows) < 60


def test_a_second_fit_evaluates_its_own_final_model():
    trainer = quiet(tiny_task(), max_steps=6)  # ends mid-epoch: the final evaluation is the only one
    first, second = trainer.fit(), trainer.fit()
    assert second.val_loss is not None and second.val_loss == pytest.approx(first.val_loss)


def test_an_evaluation_that_raises_leaves_the_model_training():
    def broken_metric(out, y):
        raise ValueError("bad metric")

    trainer = quiet(tiny_task(metric=broken_metric), max_steps=2)
    with pytest.raises(TrainingError, match="bad metric"):
        trainer.evaluate()
    assert trainer.model is not None and trainer.model.training  # dropout and BatchNorm train as before


def test_a_signal_handler_writes_nothing_and_the_loop_reports_it_once(caplog):
    from redline.train.signals import StopOnSignal

    with StopOnSignal() as stop:
        signal.raise_signal(signal.SIGTERM)  # a write from the handler could interrupt one to the same stream
        assert stop.received == signal.SIGTERM and not caplog.records
        stop.announce()
        stop.announce()
    assert [r.getMessage() for r in caplog.records] == ["SIGTERM: stopping after this step, then writing a checkpoint"]


def test_a_signal_the_process_was_started_ignoring_stays_ignored_while_the_run_takes_the_others():
    # a shell's background job (`redline train ... &` in a script) ignores SIGINT, so that a Ctrl-C to the job in
    # front spares it; the run took SIGINT over and stopped
    from redline.train.signals import StopOnSignal

    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with StopOnSignal() as stop:
            assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
            signal.raise_signal(signal.SIGINT)
            assert stop.received is None
            signal.raise_signal(signal.SIGTERM)
            assert stop.received == signal.SIGTERM
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, before)


def test_the_workers_a_signal_reaches_together_say_so_once_and_without_out_promise_no_checkpoint(
    caplog, tmp_path, monkeypatch
):
    from redline.errors import SAID_ERRORS_ENV
    from redline.train.signals import StopOnSignal

    monkeypatch.setenv(SAID_ERRORS_ENV, str(tmp_path))  # as the launcher sets it for the workers of a machine
    for _ in range(2):  # two workers, the launcher's SIGTERM passed to each
        with StopOnSignal() as stop:
            signal.raise_signal(signal.SIGTERM)
            stop.announce(checkpointing=False)
    said = [r.getMessage() for r in caplog.records]
    assert said == ["SIGTERM: stopping after this step, without a checkpoint (the run has no --out, out_dir)"]


def test_early_stopping_at_an_epochs_end_is_in_the_checkpoint_of_that_step(tmp_path):
    frozen = tiny_task(optimizer=lambda params: torch.optim.SGD(params, lr=0.0))  # 8 steps an epoch

    def stopping() -> list[EarlyStopping]:
        return [EarlyStopping(monitor="val_loss", patience=2)]

    class Told(redline.Callback):
        def __init__(self) -> None:
            self.steps: list[int] = []

        def on_checkpoint(self, trainer, step, path):
            self.steps.append(step)

    told = Told()
    first = quiet(frozen, checkpoint_every=4, out_dir=tmp_path, callbacks=[*stopping(), told]).fit()
    assert (first.steps, first.stopped) == (24, "early stopping")  # a checkpoint was due at 24 before the evaluation
    assert told.steps == [4, 8, 12, 16, 20, 24]  # step 24's written again to hold the stop, and told of once
    files = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    again = quiet(frozen, checkpoint_every=4, out_dir=tmp_path, resume="auto", callbacks=stopping()).fit()
    assert again.to_dict() == json.loads(files["summary.json"])
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()} == files  # not evaluated again


@pytest.mark.parametrize("patience", [4, None], ids=["more-patience", "no-early-stopping"])
def test_a_run_early_stopping_ended_trains_on_when_rerun_with_more_patience_or_none(tmp_path, caplog, patience):
    frozen = tiny_task(optimizer=lambda params: torch.optim.SGD(params, lr=0.0))  # the val loss never improves

    def stopping(patience: int | None) -> list[EarlyStopping]:
        return [EarlyStopping(monitor="val_loss", patience=patience)] if patience else []

    first = quiet(frozen, eval_every=2, max_steps=10, out_dir=tmp_path, callbacks=stopping(2)).fit()
    assert (first.steps, first.stopped) == (6, "early stopping")  # evals at 2 (best), 4 and 6 without improvement
    with caplog.at_level("WARNING", logger="redline"):
        again = quiet(frozen, eval_every=2, max_steps=10, out_dir=tmp_path, resume="auto", callbacks=stopping(2))
        assert again.fit().steps == 6  # the same patience: the run stays as it ended
    assert "hint: to train it further, raise --early-stopping-patience, or drop early stopping" in caplog.text
    more = quiet(frozen, eval_every=2, max_steps=12, out_dir=tmp_path, resume="auto", callbacks=stopping(patience))
    summary = more.fit()  # patience 4 (two evaluations without improvement restored) stops again at 10
    expected = (10, "early stopping") if patience else (12, "max_steps")
    assert (summary.steps, summary.stopped) == expected
    rows = csv.DictReader((tmp_path / "metrics.csv").read_text().splitlines())
    assert [int(row["step"]) for row in rows] == list(range(1, expected[0] + 1))


def test_resuming_a_checkpoint_past_max_steps_says_the_count_includes_the_resumed_steps(tmp_path, caplog):
    first = quiet(tiny_task(), max_steps=5, out_dir=tmp_path / "first").fit()
    found = tmp_path / "first" / "checkpoints" / "step-00000005"
    with caplog.at_level("WARNING", logger="redline"):  # "3 more steps" meant: nothing trains, and the log says why
        summary = quiet(tiny_task(), max_steps=3, resume=found).fit()  # into an --out of its own: refused
    assert summary.steps == 5 and summary.final_loss == first.final_loss, "the checkpoint's last steps' loss"
    assert "resumed at step 5, past --max-steps 3: nothing to train" in caplog.text
    assert "hint: to train 3 more, pass --max-steps 8" in caplog.text


def test_a_run_resumed_at_an_epochs_end_logs_that_evaluation_once(tmp_path):
    quiet(tiny_task(), max_steps=8, out_dir=tmp_path).fit()  # 8 steps an epoch: evaluated after the last checkpoint
    quiet(tiny_task(), max_steps=12, out_dir=tmp_path, resume="auto").fit()  # evaluates step 8 again, at the epoch end
    for name in ("eval.csv", "eval.jsonl"):
        text = (tmp_path / name).read_text()
        rows = csv.DictReader(text.splitlines()) if name.endswith("csv") else map(json.loads, text.splitlines())
        assert [int(row["step"]) for row in rows] == [8, 12], name


def test_early_stopping_resumed_to_watch_another_metric_does_not_compare_it_with_the_old_best():
    stored = EarlyStopping(monitor="val_loss", patience=2)
    stored.should_stop({"val_loss": 0.7, "val_metric": 0.5})
    stored.should_stop({"val_loss": 0.8, "val_metric": 0.5})
    accuracy = EarlyStopping(monitor="val_metric", patience=2)
    accuracy.load_state_dict(stored.state_dict())  # a loss of 0.7 is no accuracy to beat
    assert (accuracy.best, accuracy.bad_evals) == (None, 0)
    assert not accuracy.should_stop({"val_loss": 0.9, "val_metric": 0.5}) and accuracy.best == 0.5
    same = EarlyStopping(monitor="val_loss", patience=2)
    same.load_state_dict(stored.state_dict())
    assert (same.best, same.bad_evals) == (0.7, 1)
    older = EarlyStopping(monitor="val_loss", patience=2)
    older.load_state_dict({"best": 0.7, "bad_evals": 1})  # a checkpoint from before the metric was saved
    assert (older.best, older.bad_evals) == (0.7, 1)


def test_early_stopping_on_a_nan_evaluation_says_the_model_diverged():
    stopping = EarlyStopping(monitor="val_metric")
    stopping.should_stop({"val_loss": 0.5, "val_metric": 0.9})
    with pytest.raises(TrainingError, match=r"(?s)watches val_metric, and the evaluation gave nan.*hint"):
        stopping.should_stop({"val_loss": 0.5, "val_metric": float("nan")})


def test_a_run_without_validation_or_sample_reports_no_time_spent_evaluating():
    from redline.cli.train import _spent

    summary = quiet(tiny_task(val_data=None, metric=None), max_steps=3).fit()
    assert summary.eval_seconds == 0.0  # nothing was evaluated: "of which 1.4e-05 s evaluating" said otherwise
    assert _spent(summary) == ""
    tiny = dataclasses.replace(summary, eval_seconds=1.4e-05, checkpoint_seconds=0.25)
    assert _spent(tiny) == ", of which <0.01 s evaluating and 0.25 s checkpointing"


def test_a_long_run_checkpoints_by_the_clock_without_checkpoint_every(tmp_path):
    """With --out and no --checkpoint-every, a crash loses at most --checkpoint-minutes of the run."""
    quiet(tiny_task(), max_steps=4, out_dir=tmp_path / "clock", checkpoint_minutes=1e-9, keep_checkpoints=10).fit()
    assert [c.step for c in ckpt.find_checkpoints(tmp_path / "clock" / "checkpoints")] == [1, 2, 3, 4]
    quiet(tiny_task(), max_steps=4, out_dir=tmp_path / "default", keep_checkpoints=10).fit()  # 30 minutes
    assert [c.step for c in ckpt.find_checkpoints(tmp_path / "default" / "checkpoints")] == [4]
    quiet(tiny_task(), max_steps=4, out_dir=tmp_path / "never", checkpoint_minutes=0, keep_checkpoints=10).fit()
    assert [c.step for c in ckpt.find_checkpoints(tmp_path / "never" / "checkpoints")] == [4]  # the last alone


def test_a_model_of_several_inputs_is_told_forward_takes_them_as_one_tuple():
    class TwoInputs(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 2), nn.Linear(4, 2)

        def forward(self, a, b):
            return self.a(a) + self.b(b)

    class Pairs(torch.utils.data.Dataset):
        def __len__(self):
            return 16

        def __getitem__(self, i):
            return (torch.randn(4), torch.randn(4)), i % 2

    with pytest.raises(TrainingError, match=r"missing 1 required positional argument: 'b'") as err:
        quiet(
            tiny_task(model=TwoInputs, train_data=Pairs(), val_data=None, metric=None), max_steps=1, trial="off"
        ).fit()
    assert (
        "hint: the model is called with the batch's inputs as one argument, model(inputs): a model of several "
        "inputs takes them as one tuple (def forward(self, inputs): a, b = inputs)" in str(err.value)
    )


def test_a_last_batch_of_one_sample_is_left_out_for_a_model_with_batch_norm(caplog):
    """17 items in batches of 16: the epoch's last batch of one failed in the batch norm, its hint to use batches of 2
    or more, which they were, and --resume auto failed the same way."""
    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(17, 4, generator=gen), torch.randint(0, 2, (17,), generator=gen))

    def normed() -> nn.Module:
        return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))

    with caplog.at_level("WARNING", logger="redline"):
        summary = quiet(tiny_task(model=normed, train_data=data, val_data=None, metric=None, batch_size=16, epochs=2),
                        trial="off").fit()  # fmt: skip
    assert summary.steps == 2  # one batch of 16 an epoch
    said = [r.getMessage() for r in caplog.records if "batch norm cannot train" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("train_data's 17 items leave a last batch of 1 per epoch"), said
    plain = quiet(tiny_task(train_data=data, val_data=None, metric=None, batch_size=16, epochs=2), trial="off").fit()
    assert plain.steps == 4  # no batch norm: every sample kept


def test_removing_older_checkpoints_counts_as_checkpointing_not_as_training_steps(tmp_path, monkeypatch):
    """Pruning ran outside the checkpoint's timing: its seconds lowered samples/s and were not in checkpoint_seconds."""
    pruned = []
    prune = ckpt.prune

    def slow_prune(*args, **kwargs):
        time.sleep(0.2)
        pruned.append(args[1])
        return prune(*args, **kwargs)

    monkeypatch.setattr(ckpt, "prune", slow_prune)
    summary = quiet(tiny_task(), max_steps=4, checkpoint_every=1, keep_checkpoints=1, out_dir=tmp_path / "run").fit()
    assert pruned == [1] * 4 and len(list((tmp_path / "run/checkpoints").glob("step-*"))) == 1
    assert summary.checkpoint_seconds is not None and summary.checkpoint_seconds >= 0.8
    assert summary.samples_per_s is not None and summary.samples_per_s > 100  # 24 samples in 0.6 s of pruning: 40/s
