"""docs/errors.md quotes the refusals and warnings as a loop of one's own and the commands give them.

Each case makes one mistake the page lists and checks that one of the page's quoted messages (a
`**`...`**` heading, its `...` standing for what varies) is what redline says.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed.run
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from typer.testing import CliRunner

import redline
from redline.cli.main import app

ROOT = Path(__file__).resolve().parents[2]
OPTIONS = {"devices": "cpu", "precision": "fp32", "compile": "off"}


def quoted_messages() -> list[str]:
    """Every message the page quotes in a heading, `warning: ` dropped."""
    page = (ROOT / "docs/errors.md").read_text(encoding="utf-8")
    return [quote.removeprefix("warning: ") for quote in re.findall(r"\*\*`(.+?)`\*\*", page)]


def quotes(quote: str, message: str) -> bool:
    """Whether ``quote``'s parts between its ``...`` appear in ``message`` in order."""
    at = 0
    for part in (p.strip() for p in quote.split("...")):
        found = message.find(part, at)
        if found < 0:
            return False
        at = found + len(part)
    return True


def sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def closed_runtime(tmp_path: Path) -> None:
    runtime = redline.Runtime(**OPTIONS)
    runtime.start()
    runtime.close()
    runtime.start()


def save_before_setup(tmp_path: Path) -> None:
    with redline.Runtime(**OPTIONS) as rt:
        rt.save(tmp_path / "ckpt")


def save_two_models(tmp_path: Path) -> None:
    with redline.Runtime(**OPTIONS) as rt:
        rt.setup(nn.Linear(2, 2), sgd)
        rt.setup(nn.Linear(2, 2), sgd)
        rt.save(tmp_path / "ckpt")


def dataset_for_a_loader(tmp_path: Path) -> None:
    with redline.Runtime(**OPTIONS) as rt:
        rt.setup_loader(TensorDataset(torch.randn(4, 2)))


def a_none_loss(tmp_path: Path) -> None:
    with redline.Runtime(**OPTIONS) as rt:
        rt.setup(nn.Linear(2, 2), sgd)
        rt.backward(None)  # type: ignore[arg-type]


def zero_grad_mid_cycle(tmp_path: Path) -> None:
    loader = DataLoader(TensorDataset(torch.randn(8, 2), torch.randn(8, 1)), batch_size=2)
    with redline.Runtime(grad_accum=2, **OPTIONS) as rt:
        model, optimizer = rt.setup(nn.Linear(2, 1), sgd)
        for inputs, targets in rt.setup_loader(loader):
            optimizer.zero_grad()
            rt.backward(nn.functional.mse_loss(model(inputs), targets))
            rt.step(optimizer)


def step_a_replaced_optimizer(tmp_path: Path) -> None:
    with redline.Runtime(**OPTIONS) as rt:
        model, first = rt.setup(nn.Linear(2, 2), sgd)
        model, _ = rt.setup(model, lambda params: torch.optim.Adam(params))
        rt.backward(model(torch.randn(3, 2)).sum())
        rt.step(first)


def a_half_model_under_bf16(tmp_path: Path) -> None:
    with redline.Runtime(**{**OPTIONS, "precision": "bf16-mixed"}) as rt:
        rt.setup(nn.Linear(2, 2).half(), sgd)


def backward_before_setup(tmp_path: Path) -> None:
    with redline.Runtime(**OPTIONS) as rt:
        rt.backward(nn.Linear(2, 2)(torch.randn(3, 2)).sum())


def step_a_model(tmp_path: Path) -> None:
    with redline.Runtime(**OPTIONS) as rt:
        model, _ = rt.setup(nn.Linear(2, 2), sgd)
        rt.backward(model(torch.randn(3, 2)).sum())
        rt.step(model)  # type: ignore[arg-type]


def scheduler_each_call() -> None:
    loader = DataLoader(TensorDataset(torch.randn(16, 2), torch.randn(16, 1)), batch_size=2)
    with redline.Runtime(grad_accum=2, **OPTIONS) as rt:
        model, optimizer = rt.setup(nn.Linear(2, 1), sgd)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)
        for inputs, targets in rt.setup_loader(loader):
            rt.backward(nn.functional.mse_loss(model(inputs), targets))
            rt.step(optimizer)
            scheduler.step()


RAISED: dict[str, Callable[[Path], None]] = {
    "closed": closed_runtime,
    "no model": save_before_setup,
    "two models": save_two_models,
    "dataset": dataset_for_a_loader,
    "None loss": a_none_loss,
    "zero_grad": zero_grad_mid_cycle,
    "replaced optimizer": step_a_replaced_optimizer,
    "half model": a_half_model_under_bf16,
    "backward before setup": backward_before_setup,
    "a model to step": step_a_model,
}


@pytest.mark.parametrize("case", RAISED)
def test_errors_md_quotes_the_runtime_refusal(case, tmp_path):
    with pytest.raises(redline.RedlineError) as raised:
        RAISED[case](tmp_path)
    said = str(raised.value).split("\nhint:")[0]
    assert any(quotes(quote, said) for quote in quoted_messages()), f"docs/errors.md quotes no part of: {said}"


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)`")
def test_errors_md_quotes_the_scheduler_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="redline"):
        scheduler_each_call()
    said = [r.getMessage().split("\nhint:")[0] for r in caplog.records if "LR scheduler" in r.getMessage()]
    assert len(said) == 1, "warned once"
    assert any(quotes(quote, said[0]) for quote in quoted_messages()), f"docs/errors.md quotes no part of: {said}"


def test_a_quote_matches_only_its_own_message():
    assert quotes("a ... c", "a b c") and not quotes("c ... a", "a b c")


TINY_TASK = """\
import torch
import torch.distributed.run
from torch import nn
from torch.utils.data import TensorDataset
import redline


def make():
    x, y = torch.randn(64, 8), torch.randint(0, 2, (64,))
    return redline.Task(model=lambda: nn.Linear(8, 2), loss_fn=nn.functional.cross_entropy,
                        train_data=TensorDataset(x, y), batch_size=8, name="tiny")
"""

REFUSED = {
    "a script that is not there": ["launch", "train.py"],
    "-m of a module that is not there": ["launch", "-m", "myproject.train"],
    "--master-addr beside --rdzv-endpoint": ["launch", "--master-addr", "127.0.0.1", "--rdzv-endpoint", "h:1", "t.py"],
    "--nnodes without a rendezvous": ["launch", "--nnodes", "2", "tasks.py"],
    "--max-restarts without --nproc": ["train", "--task", "tasks.py:make", "--max-restarts", "2"],
    "grad_accum past the epochs": ["train", "--task", "tasks.py:make", "--grad-accum", "20", "--epochs", "1"],
    "--measure with --batch-size": ["memory", "--task", "tasks.py:make", "--measure", "--batch-size", "8"],
    "a batch larger than the data": ["bench", "--task", "tasks.py:make", "--batch-size", "100", "--devices", "cpu"],
}


def never_start(args: object) -> None:
    raise AssertionError("the launch started workers where it should have refused")


@pytest.mark.parametrize("case", REFUSED)
def test_errors_md_quotes_the_command_refusal(case, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tasks.py").write_text(TINY_TASK)
    monkeypatch.setattr(torch.distributed.run, "run", never_start)  # each is refused before any worker starts
    result = CliRunner().invoke(app, REFUSED[case])
    assert isinstance(result.exception, redline.RedlineError), result.output
    said = str(result.exception).split("\nhint:")[0]
    assert any(quotes(quote, said) for quote in quoted_messages()), f"docs/errors.md quotes no part of: {said}"
