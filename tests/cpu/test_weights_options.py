"""A run records the --task-arg values its Task was loaded with (summary.json's task_options), and weights that do
not fit the model served say them: the shapes alone ("wte.weight: [90, 128] in the checkpoint, [98, 128] in this
model") left the user to guess which option had changed."""

import json

import pytest
from safetensors.torch import save_model
from torch import nn

from redline import Trainer, TrainerConfig
from redline.errors import ConfigError
from redline.serve.weights import load_weights
from redline.task import load_task


def test_a_runs_summary_holds_the_options_its_task_was_loaded_with(tmp_path):
    task = load_task("example:chargpt", n_layer=1, n_embd=16, block_size=8, max_chars=2000)
    with Trainer(task, TrainerConfig(max_steps=1, out_dir=tmp_path / "run", progress=False)) as trainer:
        summary = trainer.fit()
    options = {"n_layer": "1", "n_embd": "16", "block_size": "8", "max_chars": "2000"}
    assert summary.task_options == options
    shown = repr(summary)  # a notebook's cell: one short line, not the whole Plan's reasons
    assert shown.startswith("TrainSummary(task='chargpt', device='cpu', steps=1, ") and len(shown) < 400, shown
    assert f"final_loss={summary.final_loss:.4g}" in shown and "axes: print(summary.plan)>)" in shown
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["task_options"] == options


@pytest.mark.parametrize("where", ["run", "file", "checkpoint"])
def test_weights_that_do_not_fit_name_the_task_options_of_the_run_that_wrote_them(tmp_path, where):
    run = tmp_path / "run"
    weights = run / "checkpoints" / "step-00000002" if where == "checkpoint" else run
    weights.mkdir(parents=True)
    save_model(nn.Linear(4, 2), str(weights / "model.safetensors"))
    summary = {"task": "mine", "task_options": {"width": "4", "name": "'wide'"}}
    (run / "summary.json").write_text(json.dumps(summary))
    given = weights / "model.safetensors" if where != "run" else run
    with pytest.raises(ConfigError) as refused:
        load_weights(nn.Linear(3, 2), given)
    message = str(refused.value)
    assert "shapes differ: weight ([2, 4] in the checkpoint, [2, 3] in this model)" in message
    assert message.endswith(
        f"hint: the run that wrote them ({run / 'summary.json'}) loaded its task 'mine' with --task-arg name='wide' "
        "--task-arg width=4: pass the same"
    )
    (run / "summary.json").write_text(json.dumps({"task": "mine", "task_options": None}))  # built in Python
    with pytest.raises(ConfigError, match="hint: pass the weights written by a run of this same model"):
        load_weights(nn.Linear(3, 2), given)
