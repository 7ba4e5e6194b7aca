"""The precision `redline memory` weighs a step in: auto's is the one a trial measured on this machine, where one is
cached, as `redline train` runs it; an estimate itself runs no trial (it is made before a step is known to fit)."""

import json

import torch
from torch import nn
from torch.utils.data import TensorDataset
from typer.testing import CliRunner

import redline
from devices import H100
from redline.cli.main import app
from redline.hardware.device import probe_device
from redline.memory.fit import fit_choices
from redline.parallel.env import DistEnv
from redline.runtime.measure import measure_auto, recall_auto
from redline.runtime.options import RuntimeOptions
from redline.runtime.tuned import Candidate, TunedPlan, store_tuned


def small_task() -> redline.Task:
    data = TensorDataset(torch.randn(32, 8), torch.randn(32, 1))
    return redline.Task(model=lambda: nn.Linear(8, 1), loss_fn=nn.functional.mse_loss, train_data=data, batch_size=8)


def test_auto_here_is_a_cached_measurement_else_the_rule_said_so_and_no_trial_runs(bf16_measured_faster):
    cpu = probe_device(torch.device("cpu"))
    before = fit_choices(small_task(), "auto", "auto", cpu, here=True, batch_size=None).precision
    assert before.value == "fp32" and "not measured: an estimate runs no trial" in before.reason  # the CPU's rule
    assert bf16_measured_faster == []
    measure_auto(small_task(), RuntimeOptions(devices="cpu"), 8, 1, DistEnv(), trial="on")  # as a run measures it
    here = fit_choices(small_task(), "auto", "auto", cpu, here=True, batch_size=8).precision
    assert here.value == "bf16-mixed" and here.reason.startswith("measured: bf16-mixed ran 1.43x fp32")
    assert "cached from" in here.reason
    afar = fit_choices(small_task(), "auto", "auto", H100, here=False, batch_size=None).precision
    assert afar.value == "bf16-mixed" and afar.reason.endswith(
        "not measured: a trial runs on this machine's own device only"
    )
    assert fit_choices(small_task(), "fp32", "auto", cpu, here=True, batch_size=None).precision.reason == "requested"
    assert bf16_measured_faster == [["bf16-mixed"]]  # the one trial the run made; the estimates ran none


def test_the_memory_command_weighs_the_step_in_the_measured_precision(bf16_measured_faster, tmp_path):
    (tmp_path / "small.py").write_text(
        "import torch\nfrom torch import nn\nfrom torch.utils.data import TensorDataset\nimport redline\n\n\n"
        "def task():\n    data = TensorDataset(torch.randn(32, 8), torch.randn(32, 1))\n"
        "    return redline.Task(model=lambda: nn.Linear(8, 1), loss_fn=nn.functional.mse_loss, train_data=data, "
        "batch_size=8)\n"
    )
    spec = f"{tmp_path / 'small.py'}:task"
    first = CliRunner().invoke(app, ["memory", "--task", spec, "--json"])
    assert first.exit_code == 0, first.output
    said = " ".join(first.stderr.split())  # the console wraps its line
    assert "(fp32: " in said and "an estimate runs no trial" in said
    measured = CliRunner().invoke(app, ["memory", "--task", spec, "--measure", "--max-batch-size", "8", "--json"])
    assert measured.exit_code == 0, measured.output
    again = CliRunner().invoke(app, ["memory", "--task", spec, "--json"])
    assert "(bf16-mixed: measured: bf16-mixed ran 1.43x fp32" in " ".join(again.stderr.split()), again.stderr
    assert json.loads(again.stdout)["rows"][0]["estimate"]["precision"] == "bf16-mixed"


def test_the_memory_command_weighs_the_attention_kernel_asked_for():
    """Math attention keeps the (batch, heads, seq, seq) weights for backward, which the CPU's flash kernel (torch's
    pick without dropout) does not: a step weighed on math holds more, and the table's title says the kernel."""
    base = ["memory", "--task", "example:chargpt", "--task-arg", "n_layer=1", "--task-arg", "max_chars=20000"]
    weighed = {}
    for kernel in ("auto", "math"):
        result = CliRunner().invoke(app, [*base, "--attention", kernel, "--json"])
        assert result.exit_code == 0, result.output
        weighed[kernel] = json.loads(result.stdout)["rows"][0]["estimate"]
        assert weighed[kernel]["attention"] == kernel
    heads, block, batch = 4, 64, 32  # chargpt's defaults: one fp32 (batch, heads, block, block) matrix
    assert weighed["math"]["activations"] > weighed["auto"]["activations"] + batch * heads * block * block * 4 // 2
    table = CliRunner().invoke(app, [*base, "--attention", "math"])
    assert "one training step at batch 32, fp32, math attention" in " ".join(table.stdout.split())
    assert "math attention: requested: math for every call" in " ".join(table.stderr.split())


GPT_TASK = """
import torch
from torch import nn
from torch.utils.data import TensorDataset
import redline
from redline.examples.gpt import GPT, GPTConfig


def model():
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=32, block_size=16, n_layer=1, n_head=2, n_embd=16))


def task():
    tokens = torch.randint(0, 32, (64, 17), generator=torch.Generator().manual_seed(0))
    loss = lambda logits, y: nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
    return redline.Task(model=model, loss_fn=loss, train_data=TensorDataset(tokens[:, :-1], tokens[:, 1:]),
                        batch_size=8, name="gpt")
"""


TUNED_REASONS = {"precision": "tuned: 1.3x less time", "attention": "tuned: 1.3x less time", "grad_accum": "tuned"}


def tuned_gpt(
    tmp_path, best: Candidate, reasons=TUNED_REASONS, unmeasured=(), samples: int = 64
) -> tuple[str, redline.Task, TunedPlan]:
    """The small GPT task written as a file (its spec, the task; ``samples`` of them), with ``best`` cached as its
    tuned Plan at batch 8."""
    (tmp_path / "gpt_task.py").write_text(GPT_TASK.replace("(64, 17)", f"({samples}, 17)"))
    spec = f"{tmp_path / 'gpt_task.py'}:task"
    task = redline.load_task(spec)
    plan = TunedPlan(task="gpt", device="cpu", batch_size=8, planned_steps=100, measured_at="2026-12-05",
                     best=best, reasons=reasons, trials=(), unmeasured=unmeasured)  # fmt: skip
    store_tuned(task.fingerprint(), probe_device(torch.device("cpu")), plan, model=task.build_model())
    return spec, task, plan


def test_a_tuned_plan_is_weighed_as_plan_auto_runs_it_its_kernel_and_micro_batches_too(tmp_path):
    """`redline train --plan auto` runs a cached tune's precision, kernel and micro-batches; so the estimate weighs
    them, and says where they came from. An axis asked for leaves the tune out, as it does for a run."""
    spec, _, _ = tuned_gpt(tmp_path, Candidate(precision="bf16-mixed", attention="math", grad_accum=2))
    result = CliRunner().invoke(app, ["memory", "--task", spec, "--json"])
    assert result.exit_code == 0, result.output
    estimate = json.loads(result.stdout)["rows"][0]["estimate"]
    assert (estimate["precision"], estimate["attention"], estimate["batch_size"]) == ("bf16-mixed", "math", 4)
    said = " ".join(result.stderr.split())
    assert "(bf16-mixed: tuned: 1.3x less time (tuned 2026-12-05 for 100 steps)" in said, said
    assert "note: the tuned Plan (tuned 2026-12-05 for 100 steps) splits each batch of 8 into 2 micro-batches" in said
    fit = json.loads(result.stdout)
    assert any("each step is 2 micro-batches of 4" in note for note in fit["notes"])  # in the JSON too
    assert estimate["grad_accum"] == 2
    asked = CliRunner().invoke(app, ["memory", "--task", spec, "--attention", "flash", "--json"])
    assert asked.exit_code == 0, asked.output
    estimate = json.loads(asked.stdout)["rows"][0]["estimate"]
    assert (estimate["precision"], estimate["attention"], estimate["batch_size"]) == ("fp32", "flash", 8)


def test_a_tuned_split_a_run_would_leave_out_is_not_weighed(tmp_path):
    """60 samples in micro-batches of 4 are 15 a epoch: split in two, the last would complete no step (or step with
    the next epoch's first), so `redline train` runs the tune's batch of 8 whole (tuned_run.whole_where_split_differs).
    The estimate weighs that."""
    spec, _, _ = tuned_gpt(tmp_path, Candidate(precision="bf16-mixed", attention="math", grad_accum=2), samples=60)
    result = CliRunner().invoke(app, ["memory", "--task", spec, "--json"])
    assert result.exit_code == 0, result.output
    estimate = json.loads(result.stdout)["rows"][0]["estimate"]
    assert (estimate["precision"], estimate["attention"], estimate["batch_size"]) == ("bf16-mixed", "math", 8)
    assert estimate["grad_accum"] == 1
    said = " ".join(result.stderr.split())
    assert (
        "the tune's 2 micro-batches per step of batch 8 not taken" in said and "ends in a batch of 4, not 8" in said
    ), said
    assert "splits each batch" not in said


def test_the_measured_search_runs_its_steps_as_the_tuned_plan_does_but_whole(tmp_path, monkeypatch):
    """`redline memory --measure` answers for the run `redline train --plan auto` makes: a cached tune's precision
    and kernel; not its micro-batches, since the search finds the batch one step holds, which a note says."""
    from redline.memory import search as search_module

    spec, _, _ = tuned_gpt(tmp_path, Candidate(precision="bf16-mixed", attention="math", grad_accum=2))
    probed: list[RuntimeOptions] = []
    probe_init = search_module._Probe.__init__

    def spy(self, task, options, measured, size, order=None):
        probed.append(options)
        probe_init(self, task, options, measured, size, order)

    monkeypatch.setattr(search_module._Probe, "__init__", spy)
    result = CliRunner().invoke(app, ["memory", "--task", spec, "--measure", "--max-batch-size", "8", "--json"])
    assert result.exit_code == 0, result.output
    search = json.loads(result.stdout)
    assert search["precision"] == "bf16-mixed" and search["largest"] == 8
    assert search["precision_reason"] == "tuned 2026-12-05 for 100 steps: tuned: 1.3x less time"
    assert probed and all((o.precision, o.attention, o.grad_accum) == ("bf16-mixed", "math", 1) for o in probed)
    tuned_note = next(note for note in search["notes"] if "tuned Plan" in note)
    assert "precision bf16-mixed, attention math" in tuned_note and "not its 2 micro-batches a step" in tuned_note
    probed.clear()
    asked = CliRunner().invoke(app, ["memory", "--task", spec, "--measure", "--max-batch-size", "8", "--json",
                                     "--precision", "fp32"])  # fmt: skip
    assert asked.exit_code == 0, asked.output
    assert all((o.precision, o.attention) == ("fp32", "auto") for o in probed)  # an axis given: the tune is left out
    assert not any("tuned Plan" in note for note in json.loads(asked.stdout)["notes"])


def test_a_precision_the_tune_left_unmeasured_is_the_trials_at_its_micro_batch_its_kernel_and_split_stay(
    bf16_measured_faster, tmp_path
):
    """A tune whose budget ran out before precision leaves it to the run's auto: `redline train --plan auto` then
    measures it by a trial of the tuned run, at its micro-batch. The estimate weighs that, and still the tune's kernel
    and micro-batches."""
    best, reasons = Candidate(precision="fp32", attention="math", grad_accum=2), {"attention": "t", "grad_accum": "t"}
    _, task, plan = tuned_gpt(tmp_path, best, reasons, unmeasured=("precision",))
    cpu = probe_device(torch.device("cpu"))
    before = fit_choices(task, "auto", "auto", cpu, here=True, batch_size=8)
    assert (before.precision.value, before.attention.value, before.micro_batch) == ("fp32", "math", 4)
    assert "not measured: an estimate runs no trial" in before.precision.reason
    tuned_run = plan.apply(RuntimeOptions(devices="cpu"))  # precision auto, math attention, 2 micro-batches
    assert (tuned_run.precision, tuned_run.attention, tuned_run.grad_accum) == ("auto", "math", 2)
    measure_auto(task, tuned_run, 4, 1, DistEnv(), trial="on")  # as the tuned run measures it, at its micro-batch
    after = fit_choices(task, "auto", "auto", cpu, here=True, batch_size=8)
    assert (after.precision.value, after.attention.value, after.micro_batch) == ("bf16-mixed", "math", 4)
    assert after.precision.reason.startswith("measured: bf16-mixed ran 1.43x fp32")


def test_the_measured_search_measures_a_precision_the_tune_left_open_at_its_micro_batch(bf16_measured_faster, tmp_path):
    """`redline train --plan auto` measures a precision the tune left open by a trial of the tuned run at its
    micro-batch; `--measure` reads (or runs) that same trial, so the estimate and the run find it after."""
    best, reasons = Candidate(precision="fp32", attention="math", grad_accum=2), {"attention": "t", "grad_accum": "t"}
    spec, task, plan = tuned_gpt(tmp_path, best, reasons, unmeasured=("precision",))
    result = CliRunner().invoke(app, ["memory", "--task", spec, "--measure", "--max-batch-size", "8", "--json"])
    assert result.exit_code == 0, result.output
    search = json.loads(result.stdout)
    assert search["precision"] == "bf16-mixed" and search["precision_reason"].startswith("measured: bf16-mixed ran")
    note = next(note for note in search["notes"] if "tuned Plan" in note)
    assert "precision bf16-mixed, attention math" in note
    tuned_run = plan.apply(RuntimeOptions(devices="cpu"))
    assert recall_auto(task, tuned_run, 4, DistEnv())["precision"].value == "bf16-mixed"  # the tuned run's trial
    assert bf16_measured_faster == [["bf16-mixed"]]  # one trial, at the micro-batch; none at the whole batch
