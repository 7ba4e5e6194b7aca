"""The Runtime owns its state: state_dict/load_state_dict, save/load, and the process-wide settings it enters."""

import collections
import copy
import os

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import redline
from redline.errors import ConfigError
from redline.runtime.attention import sdp_state
from redline.runtime.settings import ProcessSettings


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 3))  # dropout draws on the RNG


def loader() -> DataLoader:
    gen = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(48, 6, generator=gen), torch.randint(0, 3, (48,), generator=gen))
    return DataLoader(data, batch_size=8)


def run(rt: redline.Runtime, model: nn.Module, optimizer: torch.optim.Optimizer, batches: list) -> None:
    for inputs, targets in batches:
        with rt.autocast():
            loss = nn.functional.cross_entropy(model(inputs), targets)
        rt.backward(loss)
        rt.step(optimizer)


def fresh(**options) -> tuple[redline.Runtime, nn.Module, torch.optim.Optimizer]:
    rt = redline.Runtime(devices="cpu", seed=0, **options)
    rt.start()  # seeds: the model's initial weights are the same in every fresh run
    model, optimizer = rt.setup(make_model(), lambda params: torch.optim.AdamW(params, lr=1e-2))
    return rt, model, optimizer


@pytest.mark.parametrize("how", ["state_dict", "save"])
def test_a_run_continued_from_the_runtimes_state_equals_the_unbroken_run(tmp_path, how):
    batches = list(loader())
    rt, model, optimizer = fresh(precision="fp16-mixed")  # fp16: the loss scale is part of the state
    run(rt, model, optimizer, batches[:3])
    if how == "state_dict":
        state = copy.deepcopy(rt.state_dict())  # like torch's, it holds the live tensors
    else:
        written = rt.save(tmp_path / "step-00000003", extra={"note": "mine"}, step=3)
        assert written.step == 3
    run(rt, model, optimizer, batches[3:])  # the unbroken run
    unbroken = {k: v.clone() for k, v in model.state_dict().items()}
    rt.close()

    rt2, model2, optimizer2 = fresh(precision="fp16-mixed")
    torch.manual_seed(12345)  # the RNG moves on: the state must put it back
    if how == "state_dict":
        rt2.load_state_dict(state)
    else:
        assert rt2.load(tmp_path / "step-00000003") == {"note": "mine"}
    run(rt2, model2, optimizer2, batches[3:])
    for name, value in model2.state_dict().items():
        assert torch.equal(value, unbroken[name]), name
    rt2.close()


def test_state_before_setup_says_what_to_do():
    rt = redline.Runtime(devices="cpu")
    for call in (rt.state_dict, lambda: rt.save("x"), lambda: rt.load("x")):
        with pytest.raises(ConfigError, match=r"(?s)no model yet.*hint: call rt.setup"):
            call()


def test_the_runtime_applies_its_settings_while_it_runs_and_puts_them_back():
    assert not torch.are_deterministic_algorithms_enabled()
    with redline.Runtime(devices="cpu", deterministic=True, seed=7) as rt:
        assert torch.are_deterministic_algorithms_enabled()
        drawn = torch.rand(3)
        plan = rt.explain()
    assert not torch.are_deterministic_algorithms_enabled()
    torch.manual_seed(7)
    assert torch.equal(drawn, torch.rand(3))
    assert plan.deterministic.value is True and "while the run lasts" in plan.deterministic.reason
    assert plan.seed.value == 7 and plan.tf32.value is False


def test_a_paused_runtime_puts_its_settings_back_keeps_its_models_checks_and_starts_again(monkeypatch):
    # Runtimes that take turns in one process (a bench's rows): each leaves the process as it found it between turns.
    monkeypatch.setenv("REDLINE_CPU", "amx")  # "auto" lays bf16 convolutions out NHWC, and checks the model runs so
    rt = redline.Runtime(devices="cpu", precision="bf16-mixed", deterministic=True)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.Flatten(), nn.Linear(64, 2))
    model, _ = rt.setup(model, lambda params: torch.optim.SGD(params, lr=0.1))
    rt.pause()
    assert not torch.are_deterministic_algorithms_enabled()
    assert model._forward_pre_hooks  # the layout's check of the first forward in NHWC is still armed
    with rt.turn():
        assert torch.are_deterministic_algorithms_enabled()
    assert not torch.are_deterministic_algorithms_enabled()
    rt.start()
    assert torch.are_deterministic_algorithms_enabled()
    rt.pause()
    rt.close()  # paused after a setup: closed for good, hooks taken off
    assert not model._forward_pre_hooks and not torch.are_deterministic_algorithms_enabled()
    with pytest.raises(ConfigError, match="this Runtime was closed"):
        rt.start()


def test_a_runtime_that_is_never_started_changes_nothing_global():
    torch.manual_seed(1)
    expected = torch.rand(2)
    torch.manual_seed(1)
    redline.Runtime(devices="cpu", seed=99, deterministic=True)  # constructing resolves the Plan only
    assert torch.equal(torch.rand(2), expected) and not torch.are_deterministic_algorithms_enabled()


def test_deterministic_fixes_cublas_workspace_for_the_run_unless_the_user_set_one(monkeypatch):
    """torch refuses every CUDA matmul under deterministic algorithms unless CUBLAS_WORKSPACE_CONFIG fixes the
    workspace: the run sets it (before its first step, where cuBLAS reads it) and takes it away after."""
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    with ProcessSettings(deterministic=False).enter():
        assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ  # a run that does not ask changes nothing
    with redline.Runtime(devices="cpu", deterministic=True):
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    with ProcessSettings(deterministic=True).enter():
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"  # the user's own is kept
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"


def test_tf32_is_set_for_the_run_and_restored():
    before = torch.get_float32_matmul_precision()
    with ProcessSettings(tf32=True).enter():
        assert torch.get_float32_matmul_precision() == "high" and torch.backends.cudnn.allow_tf32
    assert torch.get_float32_matmul_precision() == before


def test_the_trainer_leaves_the_process_as_it_found_it():
    task = redline.Task(
        model=lambda: nn.Linear(6, 3),
        loss_fn=nn.functional.cross_entropy,
        train_data=loader().dataset,
        batch_size=8,
    )
    options = redline.RuntimeOptions(devices="cpu", deterministic=True)
    with redline.Trainer(task, runtime=options, max_steps=3, progress=False) as trainer:
        summary = trainer.fit()
        assert torch.are_deterministic_algorithms_enabled()
    assert not torch.are_deterministic_algorithms_enabled()
    assert summary.plan.deterministic.value is True


def test_runtimes_closed_out_of_order_keep_each_setting_while_one_holds_it_and_put_back_the_first_found():
    # the first to close turned deterministic mode off under the second, which then left it on for good
    first, second = (redline.Runtime(devices="cpu", deterministic=True) for _ in range(2))
    first.start()
    second.start()
    first.close()
    assert torch.are_deterministic_algorithms_enabled()  # the second still runs
    second.close()
    assert not torch.are_deterministic_algorithms_enabled()
    before = torch.get_float32_matmul_precision()
    tf32, other = ProcessSettings(tf32=True).enter(), ProcessSettings(tf32=True).enter()
    tf32.close()
    assert torch.get_float32_matmul_precision() == "high"
    other.close()
    assert torch.get_float32_matmul_precision() == before


def test_attention_kernels_preferred_by_overlapping_runs_come_back_whatever_order_they_end_in():
    found = sdp_state()
    flash, math = ProcessSettings(attention="flash").enter(), ProcessSettings(attention="math").enter()
    math_only = sdp_state()
    flash.close()
    assert sdp_state() == math_only  # the later run's kernel stands
    math.close()
    assert sdp_state() == found  # not the first run's flash, for good


def test_tf32_goes_through_the_per_backend_api_when_the_process_uses_it():
    matmul = torch.backends.cuda.matmul
    if not hasattr(matmul, "fp32_precision"):
        pytest.skip("this torch has no per-backend precision settings")
    conv_before = torch.backends.cudnn.conv.fp32_precision
    matmul.fp32_precision = "ieee"  # the newer API: reading the older global one now raises
    try:
        with redline.Runtime(devices="cpu", deterministic=True):  # starts without touching TF32 on a CPU
            pass
        with ProcessSettings(tf32=True).enter():
            assert matmul.fp32_precision == "tf32" and torch.backends.cudnn.conv.fp32_precision == "tf32"
        assert matmul.fp32_precision == "ieee" and torch.backends.cudnn.conv.fp32_precision == conv_before
    finally:
        matmul.fp32_precision = "none"  # the process reads the global setting again


def test_a_closed_runtime_does_not_start_again_and_one_model_is_saved():
    rt = redline.Runtime(devices="cpu")
    with rt:
        rt.setup(nn.Linear(2, 2), lambda params: torch.optim.SGD(params, lr=0.1))
        rt.setup(nn.Linear(2, 2), lambda params: torch.optim.SGD(params, lr=0.1))
        with pytest.raises(ConfigError, match=r"(?s)set up 2 models.*hint: .*or use one Runtime per model"):
            rt.state_dict()
    with pytest.raises(ConfigError, match=r"(?s)was closed.*hint: build a new Runtime"):
        rt.start()


def test_a_seeded_runtime_started_by_setup_says_the_model_was_not_seeded(caplog):
    rt = redline.Runtime(devices="cpu", seed=3)
    with caplog.at_level("WARNING", logger="redline"):
        rt.setup(nn.Linear(2, 2), lambda params: torch.optim.SGD(params, lr=0.1))
    rt.close()
    assert any("seed=3" in r.getMessage() and "hint:" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level("WARNING", logger="redline"), redline.Runtime(devices="cpu", seed=3) as started:
        started.setup(nn.Linear(2, 2), lambda params: torch.optim.SGD(params, lr=0.1))
    assert not caplog.records


def test_the_seed_is_applied_once_so_turns_and_restarts_draw_on_rather_than_repeat(caplog):
    """Each turn seeded again: a loop taking turns trained on one dropout mask and one shuffle, every turn."""
    rt = redline.Runtime(devices="cpu", seed=0)
    rt.start()
    first = torch.rand(4)
    rt.pause()
    drawn = []
    for _ in range(3):
        with rt.turn():
            drawn.append(torch.randperm(16).tolist())
    rt.start()
    drawn.append(torch.randperm(16).tolist())
    rt.close()
    assert len({tuple(d) for d in drawn}) == 4, "every turn, and the start after a pause, drew anew"
    torch.manual_seed(0)
    assert torch.equal(first, torch.rand(4)), "the first start seeded as asked"
    with caplog.at_level("WARNING", logger="redline"), redline.Runtime(devices="cpu", seed=0) as again:
        again.setup(nn.Linear(2, 2), lambda params: torch.optim.SGD(params, lr=0.1))
        again.pause()
        again.setup(nn.Linear(2, 2), lambda params: torch.optim.SGD(params, lr=0.1))  # restarted, seeded already
    assert not caplog.records, "a setup after a pause is not a seed applied late"


def test_a_closed_runtime_of_several_processes_refuses_to_save_or_load_alone(tmp_path):
    """Closed, a launched worker has left its process group: rt.save after the `with` block ran on every rank at once,
    and two of four runs failed writing one checkpoint (the others kept one rank's random state)."""
    import dataclasses

    from redline.parallel.env import DistEnv

    with redline.Runtime(devices="cpu") as rt:
        rt.setup(nn.Linear(2, 2), lambda params: torch.optim.SGD(params, lr=0.1))
        rt.save(tmp_path / "inside")
    rt.save(tmp_path / "after")  # one process: nothing to leave, so nothing to refuse
    rt.env = dataclasses.replace(DistEnv(), world_size=2, launched=True)  # as a worker of `redline launch --nproc 2`
    for call in (lambda: rt.save(tmp_path / "x"), lambda: rt.load(tmp_path / "inside"),
                 lambda: rt.save_weights(tmp_path / "w.safetensors")):  # fmt: skip
        with pytest.raises(ConfigError, match=r"(?s)on a closed Runtime of 2 processes.*hint: call it inside the"):
            call()
    assert not (tmp_path / "x").exists() and not (tmp_path / "w.safetensors").exists()


def test_options_are_taken_by_keyword_too():
    assert redline.Runtime(options=redline.RuntimeOptions(seed=1), devices="cpu").options.seed == 1


def test_evaluate_then_fit_leaves_the_process_as_it_found_it():
    task = redline.Task(
        model=lambda: nn.Linear(6, 3),
        loss_fn=nn.functional.cross_entropy,
        train_data=loader().dataset,
        val_data=loader().dataset,
        batch_size=8,
    )
    options = redline.RuntimeOptions(devices="cpu", deterministic=True)
    with redline.Trainer(task, runtime=options, max_steps=2, progress=False) as trainer:
        trainer.evaluate()  # sets up a Runtime of its own
        trainer.fit()  # which the fit replaces, closing it first
    assert not torch.are_deterministic_algorithms_enabled()


@pytest.mark.parametrize("how", ["state_dict", "save"])
def test_loading_state_drops_an_accumulation_cycle_begun_before_it(tmp_path, how):
    batches = list(loader())
    rt, model, optimizer = fresh(grad_accum=2)
    run(rt, model, optimizer, batches[:2])  # one whole step of two micro-batches
    state = copy.deepcopy(rt.state_dict())
    rt.save(tmp_path / "step-00000001", step=1)
    run(rt, model, optimizer, batches[2:])
    unbroken = {k: v.clone() for k, v in model.state_dict().items()}
    rt.close()

    rt2, model2, optimizer2 = fresh(grad_accum=2)
    run(rt2, model2, optimizer2, batches[5:])  # half a cycle: one micro-batch's gradients, its step pending
    if how == "state_dict":
        rt2.load_state_dict(state)
    else:
        rt2.load(tmp_path / "step-00000001")
    assert all(p.grad is None for p in model2.parameters())  # the old weights' gradients are gone
    run(rt2, model2, optimizer2, batches[2:])  # steps after each second micro-batch, as the unbroken run did
    for name, value in model2.state_dict().items():
        assert torch.equal(value, unbroken[name]), name
    rt2.close()


def test_rng_captured_before_cuda_started_puts_cuda_back_to_its_first_draw(monkeypatch):
    from redline.runtime import seed

    started, seeded = {"now": False}, []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: started["now"])
    monkeypatch.setattr(torch.cuda, "manual_seed_all", seeded.append)
    torch.manual_seed(41)  # CUDA seeds itself from this when it starts
    state = seed.capture_rng()
    assert "cuda" not in state and state["cuda_seed"] == 41
    seeded.clear()  # torch.manual_seed queued CUDA's seed too
    first = torch.rand(3)
    started["now"] = True  # something (a batch-size search, a probe) started CUDA and drew from it
    seed.restore_rng(state)
    assert seeded == [41]
    assert torch.equal(torch.rand(3), first)
    started["now"], seeded[:] = False, []
    torch.manual_seed(7)  # queues 7 for CUDA's start: the restore queues the captured seed over it
    seed.restore_rng(state)
    assert seeded[-1] == 41


def test_gpu_rng_states_saved_on_more_gpus_restore_those_this_machine_has(monkeypatch):
    """A run saved on 8 GPUs and resumed on 2: torch's set_rng_state_all failed on ordinal 2."""
    from redline.runtime import seed

    restored = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", restored.extend)
    state = {**seed.capture_rng(), "cuda": [torch.full((8,), i, dtype=torch.uint8) for i in range(8)]}
    state.pop("cuda_seed", None)
    seed.restore_rng(state)
    assert [int(s[0]) for s in restored] == [0, 1]


def test_extra_state_that_could_not_be_loaded_back_is_refused_when_saved_and_nothing_is_written(tmp_path):
    """A NumPy number in extra saved fine, and the checkpoint then failed to load with the unpickler's error."""
    import numpy as np

    with redline.Runtime(devices="cpu") as rt:
        rt.setup(make_model(), lambda params: torch.optim.SGD(params, lr=0.1))
        extra = {"epoch": 3, "stats": {"history": [0.5, np.float64(0.25)]}, "ema": torch.ones(2)}
        with pytest.raises(ConfigError, match=r"extra\['stats'\]\['history'\]\[1\]='numpy\.float64' is not allowed"):
            rt.save(tmp_path / "step-00000001", extra=extra)
        assert list(tmp_path.iterdir()) == []  # not even a staging directory
        counts = collections.defaultdict(list)  # plain values in it, but a class the safe load refuses
        with pytest.raises(ConfigError, match=r"extra\['counts'\]='collections\.defaultdict' is not allowed"):
            rt.save(tmp_path / "step-00000001", extra={"counts": counts})
        extra["stats"]["history"][1] = 0.25  # the fix the hint names: a plain float
        rt.save(tmp_path / "step-00000001", extra=extra)
        assert rt.load(tmp_path / "step-00000001")["stats"] == {"history": [0.5, 0.25]}


def test_a_checkpoint_holding_what_the_safe_loader_refuses_is_a_checkpoint_error(tmp_path, monkeypatch):
    import datetime

    from redline.checkpoint import CheckpointError, whole

    with redline.Runtime(devices="cpu") as rt:
        rt.setup(make_model(), lambda params: torch.optim.SGD(params, lr=0.1))
        monkeypatch.setattr(whole, "check_loadable", lambda extra: None)  # as a redline that did not check wrote it
        rt.save(tmp_path / "ckpt", extra={"when": datetime.datetime(2026, 1, 1)})
        before = copy.deepcopy(rt.state_dict())
        run(rt, rt.model, rt.optimizer, list(loader())[:2])  # the run moves on from the checkpoint
        moved = copy.deepcopy(rt.state_dict())
        with pytest.raises(CheckpointError, match=r"(?s)extra\.pt: holds a value .*datetime.*hint: if you trust"):
            rt.load(tmp_path / "ckpt")
    assert not torch.equal(before["model"]["0.weight"], moved["model"]["0.weight"])
    assert_same_state(rt.state_dict(), moved)  # the failed load changed nothing: not the weights, nor the optimizer


def assert_same_state(state: dict, expected: dict) -> None:
    for part in ("model", "optimizer"):
        got, want = numbers_of(state[part]), numbers_of(expected[part])
        assert got.keys() == want.keys()
        for key in want:
            assert torch.equal(torch.as_tensor(got[key]), torch.as_tensor(want[key])), f"{part} {key} changed"


def numbers_of(tree, prefix: str = "") -> dict:
    """A state dict's numbers and tensors by path."""
    if isinstance(tree, dict):
        return {k: v for key, item in tree.items() for k, v in numbers_of(item, f"{prefix}{key}.").items()}
    if isinstance(tree, list | tuple):
        return {k: v for i, item in enumerate(tree) for k, v in numbers_of(item, f"{prefix}{i}.").items()}
    return {prefix: tree} if isinstance(tree, torch.Tensor | int | float) else {}


def test_a_state_of_another_optimizer_or_model_is_refused_before_anything_loads():
    from redline.checkpoint import CheckpointError

    rt, model, optimizer = fresh()
    run(rt, model, optimizer, list(loader())[:1])
    adam = copy.deepcopy(rt.state_dict())
    sgd_run = redline.Runtime(devices="cpu", seed=0)
    sgd_run.setup(make_model(), lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9))
    kept = copy.deepcopy(sgd_run.state_dict())
    with pytest.raises(CheckpointError, match=r"^rt\.load_state_dict\(state\): the state's optimizer differs"):
        sgd_run.load_state_dict(adam)  # loaded, its first step failed with KeyError: 'momentum'
    assert_same_state(sgd_run.state_dict(), kept)
    other = {**adam, "model": {f"body.{name}": value for name, value in adam["model"].items()}}
    with pytest.raises(CheckpointError, match=r"^rt\.load_state_dict\(state\): the state's model differs .*missing"):
        rt.load_state_dict(other)
    grouped = redline.Runtime(devices="cpu", seed=0)
    net = make_model()
    grouped.setup(net, torch.optim.AdamW([{"params": net[0].parameters()}, {"params": net[3].parameters()}]))
    kept = copy.deepcopy(grouped.state_dict())
    with pytest.raises(CheckpointError, match=r"the state's optimizer has parameter groups of \[4\] tensors"):
        grouped.load_state_dict(adam)  # torch's ValueError came after the weights were replaced
    assert_same_state(grouped.state_dict(), kept)


def test_the_same_model_set_up_again_with_a_new_optimizer_still_saves(tmp_path):
    """Fine-tuning in two phases: the head first, then everything with another optimizer; a checkpoint holds the
    model and the optimizer of the second phase (only another model makes the Runtime's state ambiguous)."""
    rt = redline.Runtime(devices="cpu", compile="off")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.Linear(6, 3))
    model[0].requires_grad_(False)
    model, head = rt.setup(model, lambda params: torch.optim.AdamW([p for p in params if p.requires_grad], lr=0.1))
    rt.backward(model(torch.randn(4, 6)).sum())
    assert rt.step(head)
    model[0].requires_grad_(True)
    model, everything = rt.setup(model, lambda params: torch.optim.AdamW(params, lr=0.01))
    rt.backward(model(torch.randn(4, 6)).sum())
    with pytest.raises(ConfigError, match=r"a later rt.setup\(\) of its model replaced with another \(AdamW\)"):
        rt.step(head)  # the first phase's: its state is in no checkpoint
    assert rt.step(everything)
    rt.save(tmp_path / "ck")
    resumed = redline.Runtime(devices="cpu", compile="off")
    again, optimizer = resumed.setup(nn.Sequential(nn.Linear(6, 6), nn.Linear(6, 3)), lambda p: torch.optim.AdamW(p))
    resumed.load(tmp_path / "ck")
    assert all(torch.equal(a, b) for a, b in zip(again.parameters(), model.parameters(), strict=True))
    assert optimizer.param_groups[0]["lr"] == 0.01 and len(optimizer.state) == 4  # the second phase's
    rt.setup(nn.Linear(2, 2), lambda params: torch.optim.SGD(params, lr=0.1))  # another model: ambiguous
    with pytest.raises(ConfigError, match="set up 2 models"):
        rt.save(tmp_path / "other")


def test_a_compiled_model_set_up_again_is_not_compiled_a_second_time():
    rt = redline.Runtime(devices="cpu", compile="on")
    model, _ = rt.setup(nn.Linear(4, 2), lambda params: torch.optim.SGD(params, lr=0.1))
    compiled = model.forward
    model, _ = rt.setup(model, lambda params: torch.optim.AdamW(params, lr=0.1))
    assert model.forward is compiled  # not a compile of the compiled forward, which would compile twice


def test_a_model_the_user_compiled_gives_its_state_and_module_under_its_own_names():
    """torch.compile(model)'s wrapper names every tensor `_orig_mod.<name>`: a state saved with those names loads into
    no plain model. No forward runs here, so nothing compiles."""
    plain_names = set(make_model().state_dict())
    rt, model, _ = fresh()
    compiled_rt = redline.Runtime(devices="cpu", compile="off")
    compiled, _ = compiled_rt.setup(torch.compile(make_model()), lambda params: torch.optim.AdamW(params, lr=1e-2))
    state = compiled_rt.state_dict()
    assert set(state["model"]) == plain_names
    assert set(compiled_rt.module.state_dict()) == plain_names
    rt.load_state_dict(state)  # into the plain model of another run
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), compiled.parameters(), strict=True))
    wrapped = {**state, "model": {f"_orig_mod.{k}": v for k, v in state["model"].items()}}
    compiled_rt.load_state_dict(wrapped)  # a state taken with the wrapper's names still loads where it came from


@pytest.mark.parametrize("accum", [1, 2])
def test_the_step_count_is_the_optimizer_steps_taken_when_a_batch_has_two_losses(accum):
    """README's retain_graph use: two losses back-propagated through one forward. Counted per backward, the state's
    step doubled, and a run resumed from it went on from twice the steps it had taken."""
    rt, model, optimizer = fresh(grad_accum=accum)
    taken = 0
    for inputs, targets in list(loader())[:4]:
        outputs = model(inputs)
        rt.backward(nn.functional.cross_entropy(outputs, targets), retain_graph=True)
        rt.backward(outputs.pow(2).mean())
        taken += rt.step(optimizer)
    assert taken == 4 // accum and rt.state_dict()["step"] == taken
    rt2, _, _ = fresh(grad_accum=accum)
    rt2.load_state_dict(rt.state_dict())
    assert rt2.state_dict()["step"] == taken


def test_a_checkpoint_saved_without_a_step_records_the_steps_taken_and_a_load_goes_on_from_them(tmp_path):
    """rt.save(path) under a name of the user's: the checkpoint said step 0, and a run loaded from it counted its
    steps from 0 again, where one loaded from rt.state_dict() went on from 3."""
    rt, model, optimizer = fresh()
    run(rt, model, optimizer, list(loader())[:3])
    assert rt.save(tmp_path / "latest").step == 3
    rt2, _, _ = fresh()
    rt2.load(tmp_path / "latest")
    assert rt2.state_dict()["step"] == 3
    assert rt.save(tmp_path / "mine", step=7).step == 7  # a step given is the checkpoint's


@pytest.mark.parametrize(("step", "said"), [(1.5, "step=1.5"), ("3", "step='3'"), (-1, "step=-1"), (True, "step=True")])
def test_a_checkpoints_step_is_a_whole_number_or_refused_before_anything_is_written(tmp_path, step, said):
    rt, _, _ = fresh()
    with pytest.raises(ConfigError, match=f"^{said} is not allowed; expected an integer >= 0"):
        rt.save(tmp_path / "ckpt", step=step)  # a fraction or a text was written as step 0, and a load counted from it
    assert list(tmp_path.iterdir()) == []
    assert rt.save(tmp_path / "ckpt", step=torch.tensor(5)).step == 5  # numpy's and torch's integers are integers


def test_a_save_that_fails_other_than_on_the_disk_leaves_no_staging_directory(tmp_path, monkeypatch):
    from redline.checkpoint import whole

    rt, _, _ = fresh()

    def refused(path, plan):
        raise TypeError("Object of type Thing is not JSON serializable")

    monkeypatch.setattr(whole, "write_json", refused)
    with pytest.raises(TypeError, match="not JSON serializable"):
        rt.save(tmp_path / "ckpt")
    assert list(tmp_path.iterdir()) == []
