"""A compile that captures no graph (torch.compile cannot trace an LSTM, so the whole forward is one graph break) is
a compile that failed, said so: the run's Plan said `compiled 1 time(s) in 0.1 s`, and a bench row passed for
compiled, while every step ran the eager model."""

import logging

import torch
from torch import nn
from torch.utils.data import TensorDataset

import redline
from redline.bench.run import benchmark
from redline.runtime.compile import compile_module
from redline.train.trainer import Trainer


class LSTMNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.lstm, self.out = nn.Embedding(20, 16), nn.LSTM(16, 32, batch_first=True), nn.Linear(32, 20)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.lstm(self.emb(x))
        return self.out(h)


def lstm_task() -> redline.Task:
    seq = torch.randint(0, 20, (64, 13), generator=torch.Generator().manual_seed(0))
    return redline.Task(
        model=LSTMNet, loss_fn=lambda o, t: nn.functional.cross_entropy(o.reshape(-1, 20), t.reshape(-1)),
        train_data=TensorDataset(seq[:, :-1], seq[:, 1:]), batch_size=16, name="lstm",
    )  # fmt: skip


def test_a_compile_that_captures_no_graph_is_told_as_failed_and_the_model_runs_its_own_forward(caplog):
    model = LSTMNet()
    with caplog.at_level(logging.WARNING, logger="redline"):
        record = compile_module(model)
        out = model(torch.randint(0, 20, (4, 12)))
    assert out.shape == (4, 12, 20) and record.compiles == 0
    assert (
        record.fell_back == "torch.compile captured no graph of LSTMNet's forward: Attempted to wrap RNN, GRU, or LSTM"
    )
    assert "captured no graph of LSTMNet's forward" in caplog.text
    assert model.forward == record.eager  # its own from then on: no compiled call left to count


def test_a_run_asked_to_compile_an_lstm_says_the_compile_failed():
    with Trainer(
        lstm_task(), max_steps=2, progress=False, trial="off", runtime=redline.RuntimeOptions(compile="on")
    ) as t:
        plan = t.fit().plan
        assert plan.compile.value is False
        assert plan.compile.reason.startswith("compile failed, ran eagerly: torch.compile captured no graph")


def test_a_bench_row_asked_to_compile_an_lstm_fails_so_rather_than_pass_for_compiled():
    result = benchmark(lstm_task(), devices="cpu", precisions=["fp32"], compiles=[True], steps=4, window=2, auto=False)
    (row,) = [row for row in result.rows if row.kind == "explicit"]
    assert "torch.compile fell back to eager, so it would time the eager model" in row.error
    assert "captured no graph of LSTMNet's forward" in row.error


def test_a_compiled_mlp_still_counts_its_graph():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    record = compile_module(model)
    model(torch.randn(3, 4)).sum().backward()
    assert record.compiles == 1 and record.fell_back is None


def test_a_closed_runtime_gives_the_model_its_own_forward_back():
    # In a notebook, a model a Runtime compiled stayed compiled after it closed: called later with another batch,
    # it compiled again ("compiled DigitsCNN again") under a Runtime with compile off, whose Plan said off.
    from redline.runtime.compiler_facts import frames

    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    with redline.Runtime(devices="cpu", compile="on") as rt:
        compiled, optimizer = rt.setup(model, lambda params: torch.optim.SGD(params, lr=0.1))
        rt.backward(compiled(torch.randn(3, 4)).sum())
        rt.step(optimizer)
        assert "forward" in vars(model) and rt.compiles[0] == 1
    assert "forward" not in vars(model)  # the class's forward, as the user built it
    tried = frames("total")
    with redline.Runtime(devices="cpu", compile="off") as rt:
        again, optimizer = rt.setup(model, lambda params: torch.optim.SGD(params, lr=0.1))
        rt.backward(again(torch.randn(5, 4)).sum())  # another batch size: compiled, it would compile again
        rt.step(optimizer)
        assert rt.explain().compile.value is False
    assert frames("total") == tried
