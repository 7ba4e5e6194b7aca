"""benchmarks/kernel_pick.py: the kernel the attention calls pick alone, set against a whole trial of every form."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))

import kernel_pick  # the benchmarks folder is not a package
from redline.runtime import trial


def test_one_trial_compares_the_calls_pick_with_whole_steps_on_the_same_batch(monkeypatch, tmp_path):
    monkeypatch.setenv("REDLINE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("REDLINE_CPU", "amx")  # bf16-mixed is a candidate on any CPU
    steps = {"fp32": 10.0, "bf16-mixed": 12.0, "bf16-mixed with math attention": 8.0}

    def whole(model, optimizer, loss_fn, batch, device, candidates, *, stop_early=True, **_):
        assert not stop_early  # every round, as the comparison needs
        return [trial.Measured(n, (steps[n] / 1e3,) * 12, (2.0, 1.9)) for n in ("fp32", *candidates)]

    monkeypatch.setattr(kernel_pick.trial, "run_trial", whole)
    found = kernel_pick.one("example:chargpt", {"batch_size": 4, "n_layer": 1, "n_embd": 32, "max_chars": 4000})
    assert found["forms"] == ["bf16-mixed with math attention"]  # the CPU flash kernel is torch's pick
    assert found["picked"] in ("bf16-mixed", "bf16-mixed with math attention")  # timed for real on this CPU
    assert found["fastest"] == "bf16-mixed with math attention" and found["whole_choice"] == found["fastest"]
    assert found["steps_ratio"]["bf16-mixed with math attention"] == 1.5
    expected = "bf16-mixed with math attention" if found["picked"] != "bf16-mixed" else "fp32"
    assert found["picked_choice"] == expected  # the picked form's own steps against fp32's, from the whole trial
