"""A user's own loop around the Runtime: plausible slips end in a redline error naming the fix, or just work."""

from __future__ import annotations

import pytest
import torch

import redline
from redline.errors import ConfigError, TrainingError
from redline.plan import Choice
from redline.runtime import runtime, state


def _model() -> torch.nn.Module:
    return torch.nn.Linear(4, 1)


def test_an_optimizer_factory_that_takes_no_parameters_is_refused_with_the_factory_form() -> None:
    """Called by setup, its TypeError would come from redline's line, as if the bug were redline's."""
    with redline.Runtime(devices="cpu") as rt:
        model = _model()
        with pytest.raises(ConfigError, match=r"cannot be called with 1 argument(.|\n)*lambda params: torch.optim"):
            rt.setup(model, lambda: torch.optim.SGD(model.parameters(), lr=0.1))
        _, built = rt.setup(model, torch.optim.SGD)  # a class whose other arguments have defaults is a factory
        assert isinstance(built, torch.optim.SGD)


def test_load_state_dict_of_a_models_weights_is_refused_with_how_to_load_them() -> None:
    with redline.Runtime(devices="cpu") as rt:
        rt.setup(_model(), lambda params: torch.optim.SGD(params, lr=0.1))
        with pytest.raises(ConfigError, match=r"\['bias', 'weight'\](.|\n)*rt.unwrap\(model\).load_state_dict"):
            rt.load_state_dict(_model().state_dict())
        state = rt.state_dict()
        rt.load_state_dict(state)  # what state_dict() returned loads
        assert state["step"] == 0


def test_a_with_block_inside_another_on_the_same_runtime_leaves_the_run_to_the_outer_one() -> None:
    """A helper that enters the Runtime it is given must not close it under its caller."""
    was = torch.are_deterministic_algorithms_enabled()
    rt = redline.Runtime(devices="cpu", deterministic=True)
    with rt:
        with rt:
            pass
        assert torch.are_deterministic_algorithms_enabled()  # still the run's settings
        model, optimizer = rt.setup(_model(), lambda params: torch.optim.SGD(params, lr=0.1))
        rt.backward(model(torch.ones(2, 4)).sum())
        assert rt.step(optimizer)
    assert torch.are_deterministic_algorithms_enabled() == was  # put back when the outer block ends
    with pytest.raises(ConfigError, match="this Runtime was closed"):
        rt.setup(_model(), lambda params: torch.optim.SGD(params, lr=0.1))


def test_a_closed_runtime_refuses_to_start_even_if_it_never_started(caplog) -> None:
    """close() is final whether or not the Runtime ran: setup() then refuses it, and says nothing of a seed."""
    for started in (True, False):
        rt = redline.Runtime(devices="cpu", seed=0)
        if started:
            rt.start()
        rt.close()
        caplog.clear()
        with pytest.raises(ConfigError, match="this Runtime was closed"):
            rt.setup(_model(), lambda params: torch.optim.SGD(params, lr=0.1))
        assert "seed" not in caplog.text  # no warning that the seed came late: nothing was seeded


def test_a_half_model_under_fp16_mixed_is_refused_at_setup_with_the_fix() -> None:
    """torch's grad scaler would fail at the first step ("Attempting to unscale FP16 gradients"), from redline's
    own step; the mixed precision keeps float32 weights, so the .half() is the slip."""
    with redline.Runtime(devices="cpu", precision="fp16-mixed") as rt:
        with pytest.raises(ConfigError, match=r"5 float16 parameters(.|\n)*hint: drop the model's .half\(\)"):
            rt.setup(_model().half(), lambda params: torch.optim.SGD(params, lr=0.1))
        model, optimizer = rt.setup(_model(), lambda params: torch.optim.SGD(params, lr=0.1))
        with rt.autocast():
            loss = model(torch.ones(2, 4)).float().mean()
        rt.backward(loss)
        assert rt.step(optimizer)
        assert "step" in rt.state_dict()  # the refused setup left no second model: the state is this one's


def test_a_half_model_under_bf16_mixed_is_refused_at_setup_with_the_fix() -> None:
    """bf16-mixed has no loss scale: its float16 weights trained on float16 gradients, unscaled, without a word."""
    with redline.Runtime(devices="cpu", precision="bf16-mixed") as rt:
        with pytest.raises(ConfigError, match=r"(?s)precision='bf16-mixed' got a model with 5 float16 parameters.*"
                           r"no loss scale.*hint: drop the model's .half\(\).*precision='fp32'"):  # fmt: skip
            rt.setup(_model().half(), lambda params: torch.optim.SGD(params, lr=0.1))
        frozen = torch.nn.Sequential(torch.nn.Linear(4, 4).half().requires_grad_(False), torch.nn.Linear(4, 1))
        rt.setup(frozen, lambda params: torch.optim.SGD([p for p in params if p.requires_grad], lr=0.1))  # trains fp32


@pytest.mark.parametrize("chosen", ["bf16-mixed", "fp16-mixed"])
@pytest.mark.parametrize("by", ["the rule", "a trial"])
def test_auto_keeps_fp32_for_a_half_model_where_the_rule_or_a_trial_chose_mixed_precision(monkeypatch, chosen, by):
    """A trial timed bf16-mixed on a .half() model (2.38x), and the run it chose it for was refused at setup, as every
    later one that read the cached choice; on a bf16 GPU the rule alone did the same."""
    said = Choice(chosen, f"auto: {by} chose it")
    monkeypatch.setattr(runtime, "resolve_precision", lambda requested, facts: said)  # as on a GPU
    measured = {"precision": said} if by == "a trial" else None
    with redline.Runtime(devices="cpu", precision="auto", compile="off", measured=measured) as rt:
        model, optimizer = rt.setup(_model().half(), lambda params: torch.optim.SGD(params, lr=0.1))
        plan = rt.explain().precision
        assert (plan.value, rt.precision.name) == ("fp32", "fp32")
        assert plan.reason.startswith(f"auto: fp32, not {chosen}, since the model trains 5 float16 parameters: ")
        rt.backward(model(torch.ones(2, 4, dtype=torch.float16)).float().sum())
        rt.step(optimizer)  # it trains, in float16, as it would have under fp32
        assert model.weight.dtype == torch.float16


@pytest.mark.parametrize(("precision", "cpu"), [("fp32", "avx2"), ("bf16-mixed", "avx2"), ("auto", "amx")])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_the_plan_says_the_dtype_of_parameters_no_precision_changes(monkeypatch, precision, cpu, dtype) -> None:
    """A bfloat16 model's Plan said "fp32: requested", and it trained in bfloat16."""
    monkeypatch.setenv("REDLINE_CPU", cpu)
    name = str(dtype).removeprefix("torch.")
    with redline.Runtime(devices="cpu", precision=precision, compile="off") as rt:
        rt.setup(_model().to(dtype), lambda params: torch.optim.SGD(params, lr=0.1))
        plan = rt.explain().precision
        assert plan.value == ("bf16-mixed" if precision == "bf16-mixed" else "fp32")
        assert plan.reason.endswith(f"; the model's trained parameters are {name}, not float32: they and their "
                                    f"gradients stay {name}")  # fmt: skip
        assert rt._compile_check is None  # auto's check would time a switch that changes no weight's dtype


def test_clipping_the_gradients_of_an_optimizer_setup_did_not_return_is_refused() -> None:
    """On CUDA setup rebuilds the optimizer fused: clipping the one it was given would clip nothing, silently."""
    with redline.Runtime(devices="cpu") as rt:
        model, optimizer = rt.setup(_model(), lambda params: torch.optim.SGD(params, lr=0.1))
        rt.backward(model(torch.ones(2, 4)).sum())
        other = torch.optim.SGD(_model().parameters(), lr=0.1)
        with pytest.raises(ConfigError, match=r"rt.clip_grad_norm_\(\) got an optimizer .* did not return"):
            rt.clip_grad_norm_(other, 1.0)
        assert float(rt.clip_grad_norm_(optimizer, 1.0)) > 0  # the set-up one's gradients


def test_a_model_built_on_the_meta_device_is_refused_with_how_to_give_it_weights() -> None:
    """torch's own error, from setup's move to the device, suggests to_empty(): weights of uninitialised memory."""
    with torch.device("meta"):
        empty = _model()
    with redline.Runtime(devices="cpu") as rt:
        with pytest.raises(ConfigError, match=r"tensors weight, bias are on the meta device(.|\n)*assign=True"):
            rt.setup(empty, lambda params: torch.optim.SGD(params, lr=0.1))
        empty.load_state_dict(_model().state_dict(), assign=True)  # the hint's fix
        model, _ = rt.setup(empty, lambda params: torch.optim.SGD(params, lr=0.1))
        assert not model.weight.is_meta


def test_train_step_given_a_loss_or_a_function_returning_loss_and_outputs_says_what_it_takes() -> None:
    with redline.Runtime(devices="cpu") as rt:
        model, optimizer = rt.setup(_model(), lambda params: torch.optim.SGD(params, lr=0.1))
        batch = (torch.ones(2, 4), torch.zeros(2, 1))
        with pytest.raises(ConfigError, match=r"train_step\(step_fn\)='Tensor'(.|\n)*pass the function itself"):
            rt.train_step(model(batch[0]).mean(), batch)  # the loss, not the function that computes it
        with pytest.raises(redline.errors.TaskError, match=r"a tuple of 2 (.|\n)*return only the loss"):
            rt.train_step(lambda b: (model(b[0]).mean(), model(b[0])), batch)
        loss = rt.train_step(lambda b: ((model(b[0]) - b[1]) ** 2).mean(), batch)
        assert rt.step(optimizer) and loss.requires_grad is False


class _PeerGone(torch.autograd.Function):
    """The gradient reduction of a rank whose peer ran out of batches first: gloo's words, as they come."""

    @staticmethod
    def forward(ctx, x):  # type: ignore[override]
        return x

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:9402. GLHF!")


def test_a_collective_that_breaks_in_backward_or_save_says_that_every_rank_takes_part(monkeypatch, tmp_path) -> None:
    """Before, gloo's own RuntimeError, which names neither the likely cause nor the call."""
    with redline.Runtime(devices="cpu", compile="off") as rt:
        model, _ = rt.setup(_model(), lambda params: torch.optim.SGD(params, lr=0.1))
        with pytest.raises(TrainingError) as err:
            rt.backward(_PeerGone.apply(model(torch.randn(2, 4))).sum())
        assert str(err.value).startswith(
            "rt.backward: a collective with the other ranks failed: Connection closed by peer [127.0.0.1]:9402\n"
        )
        assert "or ran fewer steps: every rank calls backward as often as the others" in str(err.value)
        monkeypatch.setattr(state, "gather_objects", lambda obj: _PeerGone.backward(None, None))
        with pytest.raises(
            TrainingError, match=r"writing the checkpoint .*ck: a collective(.|\n)*did not call rt.save"
        ):
            rt.save(tmp_path / "ck")
    assert not (tmp_path / "ck").exists()


def test_find_unused_parameters_where_no_ddp_runs_is_named_in_the_plan_as_doing_nothing() -> None:
    with redline.Runtime(devices="cpu", compile="off", find_unused_parameters=True) as rt:
        rt.setup(_model(), lambda params: torch.optim.SGD(params, lr=0.1))
        strategy = rt.explain().strategy
    assert (
        strategy.value == "single"
        and strategy.reason == "auto: one process; find_unused_parameters is DDP's: it does nothing here"
    )
    with redline.Runtime(devices="cpu", compile="off") as rt:
        rt.setup(_model(), lambda params: torch.optim.SGD(params, lr=0.1))
        assert rt.explain().strategy.reason == "auto: one process"
