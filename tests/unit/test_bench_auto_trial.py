"""benchmarks/auto_trial.py: the trial's cost is the median of a cold-cache run in every round, not one difference."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))

import auto_trial  # the benchmarks folder is not a package


def test_every_round_runs_auto_with_an_empty_cache_and_the_cost_is_their_median(monkeypatch):
    ran: list[str] = []
    walls = {"auto": iter([10.0, 11.0, 10.0]), "fp32": iter([12.0] * 3), "cold": iter([13.0, 30.0, 12.0])}

    def train(spec, extra, cache, *flags):
        name = "fp32" if flags else "cold" if cache is None else "auto"
        if len(ran) or name != "auto":
            ran.append(name)
        else:
            ran.append("first")
            return {"samples_per_s": 1.0, "plan": {"precision": {"value": "fp32", "reason": "measured: fp32 kept"}}}, 0
        return {"samples_per_s": 1.0}, next(walls[name])

    published: list[list[str]] = []
    monkeypatch.setattr(auto_trial, "train", train)
    monkeypatch.setattr(auto_trial, "RUNS", {"example:digits": []})
    monkeypatch.setattr(auto_trial.environment, "publish", lambda name, title, body: published.append(body))
    monkeypatch.setattr(sys, "argv", ["auto_trial.py", "--pairs", "3"])
    auto_trial.main()
    assert ran == ["first", "auto", "fp32", "cold", "cold", "fp32", "auto", "auto", "fp32", "cold"]
    row = next(line for line in published[0] if line.startswith("| example:digits"))
    assert row.endswith("| 3.0 (2.0 to 19.0) |")  # cold less warm per round: 3, 19, 2
