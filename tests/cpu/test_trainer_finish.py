"""The end of a run whose steps are done: a Ctrl-C in its final evaluation is said at once, and a second one skips
the results alone, every step kept for the resume that writes them."""

import json
import logging
import signal
import threading

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from torch.utils.data import TensorDataset

import redline
from redline.cli.train import summary_rows
from redline.errors import ConfigError
from redline.train.signals import ResultsSkipped
from redline.train.throughput import UNTRAINED
from redline.train.trainer import Trainer

RESUME = "then run the same command with --resume auto (in Python: resume='auto') to write them"


def ctrl_c_task(*at_calls: int, then: threading.Event | None = None) -> redline.Task:
    """A tiny task whose metric, called twice an evaluation, sends this process SIGINT (a Ctrl-C) at its
    ``at_calls``-th calls; at the call after the first, it waits for ``then`` (the warning, said at once)."""
    calls = [0]

    def metric(out: torch.Tensor, y: torch.Tensor) -> float:
        calls[0] += 1
        if calls[0] in at_calls:
            signal.raise_signal(signal.SIGINT)
        if then is not None and at_calls and calls[0] == at_calls[0] + 1:
            then.wait(5)  # set by the warning's log record: only where it is said while the evaluation runs
        return (out.argmax(-1) == y).float().mean().item()

    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(32, 4, generator=gen), torch.randint(0, 2, (32,), generator=gen))
    return redline.Task(
        model=lambda: nn.Linear(4, 2), loss_fn=nn.functional.cross_entropy, train_data=data,
        val_data=TensorDataset(*data[:16]), batch_size=8, metric=metric,
    )  # fmt: skip


def trainer(task: redline.Task, out, **kwargs) -> Trainer:
    """val_data's first batch after step 1 (the metric's call 1), evaluations at step 2 (its calls 2, 3) and at step 4,
    the last (its calls 4, 5)."""
    kwargs = {"max_steps": 4, "eval_every": 2, "out_dir": out, **kwargs}
    return Trainer(task, runtime=redline.RuntimeOptions(devices="cpu", seed=0), progress=False, **kwargs)


def same_weights(a, b) -> bool:
    first, second = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    return first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


def evaluated(out) -> list[int]:
    return [json.loads(line)["step"] for line in (out / "eval.jsonl").read_text().splitlines()]


def test_a_second_ctrl_c_in_the_last_steps_evaluation_keeps_every_step_for_the_resume_that_writes_the_results(
    tmp_path,
):
    # Evaluated before its checkpoint, and with the signal taken as one mid-run: steps 3 and 4 were lost
    unbroken = trainer(ctrl_c_task(), tmp_path / "unbroken").fit()
    run = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt) as second:  # a plain one would end the test session
        trainer(ctrl_c_task(4, 5), run).fit()
    assert isinstance(second.value, ResultsSkipped), "taken as a second Ctrl-C mid-run"
    assert (run / "checkpoints" / "step-00000004" / "manifest.json").is_file()
    assert not (run / "summary.json").exists() and not (run / "model.safetensors").exists()
    resumed = trainer(ctrl_c_task(), run, resume="auto").fit()
    assert (resumed.steps, resumed.stopped, resumed.val_loss) == (4, "max_steps", unbroken.val_loss)
    assert json.loads((run / "summary.json").read_text())["steps"] == 4
    assert same_weights(run, tmp_path / "unbroken")
    assert evaluated(run) == evaluated(tmp_path / "unbroken") == [2, 4]


def test_a_ctrl_c_in_the_last_steps_evaluation_is_said_at_once_and_the_run_writes_its_results(tmp_path):
    said = threading.Event()

    class Told(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "SIGINT" in record.getMessage():
                messages.append(record.getMessage())
                said.set()

    messages: list[str] = []
    handler = Told(logging.WARNING)
    logging.getLogger("redline").addHandler(handler)
    try:
        summary = trainer(ctrl_c_task(4, then=said), tmp_path).fit()
    finally:
        logging.getLogger("redline").removeHandler(handler)
    kept = tmp_path / "checkpoints" / "step-00000004"
    assert messages == [  # not after the evaluation, and not that the run stops after this step
        "SIGINT: the run has finished its steps and is writing its results (the final evaluation, sample, "
        f"summary.json and model.safetensors); a second Ctrl-C skips them; every step is kept in {kept}: {RESUME}"
    ]
    assert summary.stopped == "max_steps" and (tmp_path / "summary.json").is_file()


def test_a_finished_run_trained_further_logs_its_last_evaluation_once(tmp_path):
    trainer(ctrl_c_task(), tmp_path / "unbroken", max_steps=6).fit()
    trainer(ctrl_c_task(), tmp_path / "run").fit()  # checkpointed before its final evaluation, at step 4
    trainer(ctrl_c_task(), tmp_path / "run", max_steps=6, resume="auto").fit()  # evaluates step 4 again
    assert evaluated(tmp_path / "run") == evaluated(tmp_path / "unbroken") == [2, 4, 6]
    assert same_weights(tmp_path / "run", tmp_path / "unbroken")


@pytest.mark.parametrize("out", [True, False], ids=["out_dir", "no-out_dir"])
def test_a_second_ctrl_c_after_the_last_step_says_what_it_skipped_and_where_the_steps_are(tmp_path, out):
    # A script's traceback ended in a bare ResultsSkipped, without a word
    with pytest.raises(KeyboardInterrupt) as second:
        trainer(ctrl_c_task(4, 5), tmp_path if out else None).fit()
    kept = tmp_path / "checkpoints" / "step-00000004"
    assert str(second.value) == (
        "a second Ctrl-C after the run's last step skipped its results (the final evaluation, sample, summary.json "
        f"and model.safetensors); every step is kept in {kept}: {RESUME}"
        if out
        else "a second Ctrl-C after the run's last step skipped the final evaluation, sample and summary; nothing was "
        "saved: the run has no --out, out_dir"
    )


def test_a_run_whose_results_a_second_ctrl_c_skipped_is_told_to_resume_to_write_them(tmp_path):
    # It was refused as a finished run, "to train that run further, pass resume='auto' with a larger max_steps=N"
    with pytest.raises(KeyboardInterrupt):
        trainer(ctrl_c_task(4, 5), tmp_path).fit()
    with pytest.raises(ConfigError) as refused:
        trainer(ctrl_c_task(), tmp_path).fit()
    assert "(the newest at step 4, where it ended; stopped: max_steps) but not its results (no summary.json" in str(
        refused.value
    )
    assert "hint: to write them, pass resume='auto' with that run's settings (it trains no step); " in str(
        refused.value
    )
    written = trainer(ctrl_c_task(), tmp_path, resume="auto").fit()
    assert written.samples_per_s is None and written.mfu_note == UNTRAINED  # not "no step after the first"
    assert ("samples/s", f"n/a ({UNTRAINED})") in summary_rows(written)
