"""A user's own loop misusing the Runtime gets a clear error or warning: training on after close, a checkpoint
taken amid an accumulation cycle, an ``extra`` or a checkpoint of the wrong kind; and the Plan tells the loader the
loop trains on."""

import logging

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import redline
from redline.errors import ConfigError


def loss_of(model: nn.Module, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(step)
    return nn.functional.mse_loss(model(torch.randn(8, 4, generator=gen)), torch.randn(8, 2, generator=gen))


def set_up(**options) -> tuple[redline.Runtime, nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    rt = redline.Runtime(devices="cpu", compile="off", precision="fp32", **options)
    model, optimizer = rt.setup(nn.Linear(4, 2), lambda params: torch.optim.SGD(params, lr=0.1))
    return rt, model, optimizer


def test_a_closed_runtime_refuses_to_train_on():
    # After close the loop trained on without a word, its precision and process settings already put back.
    rt, model, optimizer = set_up()
    rt.backward(loss_of(model, 0))
    rt.step(optimizer)
    rt.close()
    with pytest.raises(ConfigError, match=r"rt\.backward\(\) was called on a closed Runtime.*\nhint: train inside"):
        rt.backward(loss_of(model, 1))
    with pytest.raises(ConfigError, match=r"rt\.step\(\) was called on a closed Runtime"):
        rt.step(optimizer)
    with pytest.raises(ConfigError, match=r"rt\.train_step\(\) was called on a closed Runtime"):  # not "backward"
        rt.train_step(lambda batch: loss_of(model, 2), None)


def test_a_closed_runtime_leaves_no_hook_on_the_users_optimizer_and_runtimes_built_again_pile_none_up():
    # A notebook re-running its cell builds a Runtime again on the same optimizer: each one left a step hook on it.
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        with redline.Runtime(devices="cpu", compile="off", precision="fp32") as rt:
            trained, stepped = rt.setup(model, optimizer)
            rt.backward(loss_of(trained, step))
            rt.step(stepped)
            assert len(stepped._optimizer_step_pre_hooks) >= 1  # the run watches its optimizer's steps
        # the user's, or the one setup rebuilt fused from it (on a CPU where that stepped faster), which the next
        # Runtime rebuilds from the user's again
        assert len(optimizer._optimizer_step_pre_hooks) == len(stepped._optimizer_step_pre_hooks) == 0, step


def test_an_fp16_guard_stopped_amid_a_step_stops_refusing_once_its_runtime_closes():
    # Interrupted between rt.backward and rt.step (a notebook's Ctrl-C), a fp16 Runtime's guard stayed armed on the
    # user's optimizer for good: every later step, a plain loop's or the next Runtime's, was refused as unscaled.
    # fp16-mixed runs on CUDA; its Precision runs on a CPU grad scaler here, as the Runtime builds it.
    from redline.plan import Choice
    from redline.runtime.precision import Precision

    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    precision = Precision("fp16-mixed", "cpu")
    precision.guard(optimizer, Choice("fp16-mixed", "asked for"))
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(torch.randn(8, 4)).float().pow(2).mean()
    precision.backward(loss)
    with pytest.raises(ConfigError, match="called directly under fp16-mixed"):
        optimizer.step()  # armed while its Runtime lives
    precision.release()  # what Runtime.close does
    optimizer.step()
    with redline.Runtime(devices="cpu", compile="off", precision="fp32") as rt:
        trained, stepped = rt.setup(model, optimizer)
        rt.backward(loss_of(trained, 0))
        rt.step(stepped)


def test_a_backward_before_setup_and_a_model_given_to_step_are_refused_with_the_fix():
    # the backward ran, with no precision, accumulation or sync applied; step(model) spoke of "an optimizer (Linear)"
    rt = redline.Runtime(devices="cpu", compile="off", precision="fp32")
    model = nn.Linear(4, 2)
    with pytest.raises(ConfigError, match=r"(?s)rt\.backward\(\) was called before rt\.setup\(\).*hint: `model, "):
        rt.backward(loss_of(model, 0))
    assert model.weight.grad is None
    model, optimizer = rt.setup(model, lambda params: torch.optim.SGD(params, lr=0.1))
    rt.backward(loss_of(model, 0))
    with pytest.raises(ConfigError, match=r"rt\.step\(\) got a model \(Linear\), not an optimizer.*\nhint:"):
        rt.step(model)  # type: ignore[arg-type]
    assert rt.step(optimizer)
    rt.close()


def test_a_checkpoint_amid_an_accumulation_cycle_says_the_batches_since_the_last_step_are_not_in_it(tmp_path, caplog):
    rt, model, optimizer = set_up(grad_accum=2)
    with caplog.at_level(logging.WARNING, logger="redline"):
        for step in range(3):
            rt.backward(loss_of(model, step))
            rt.step(optimizer)
        rt.save(tmp_path / "amid")  # one batch after step 1
        rt.backward(loss_of(model, 3))
        rt.step(optimizer)
        rt.save(tmp_path / "whole")  # at step 2's end: nothing left out
    said = [r.getMessage() for r in caplog.records if "rt.save" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("rt.save at 1 of the 2 batches of a step (grad_accum)")
    assert "the checkpoint holds the weights of step 1" in said[0]
    rt.close()


def test_save_and_load_refuse_what_they_cannot_take_by_name(tmp_path):
    rt, _, _ = set_up()
    with pytest.raises(ConfigError, match=r"extra=.*list.* is not allowed; expected a dict of your own state"):
        rt.save(tmp_path / "ckpt", extra=[1, 2])  # type: ignore[arg-type]
    assert not (tmp_path / "ckpt").exists()
    with pytest.raises(ConfigError, match=r"checkpoint=.*int.* is not allowed; expected a path"):
        rt.load(5)  # type: ignore[arg-type]
    rt.close()


def test_the_plan_tells_the_first_loader_set_up_not_a_validation_loader_after_it():
    rt, _, _ = set_up()
    data = TensorDataset(torch.randn(32, 4), torch.randn(32, 2))
    rt.setup_loader(DataLoader(data, batch_size=8, shuffle=True))
    trained_on = rt.explain().loader
    rt.setup_loader([(torch.randn(8, 4), torch.randn(8, 2))])  # a list of batches, for validation
    assert rt.explain().loader == trained_on and "not a DataLoader" not in str(trained_on.reason)
    rt.close()
