"""The Runtime on CPU: parity with the plain loop, accumulation, clipping, precision, compile, errors."""

import copy
import dataclasses
import logging
import re

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import redline
from redline.errors import ConfigError, DeviceUnavailableError
from redline.plan import Choice
from redline.runtime.compile import compile_module, eager_calls_of, explain_compile, recompile_room
from redline.runtime.optimizer import rebuild_optimizer

STEPS = 12


def make_model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 8 * 8, 32), nn.ReLU(), nn.Linear(32, 10)
    )


def make_loader(batch_size: int = 16, seed: int = 0) -> DataLoader:
    gen = torch.Generator().manual_seed(123)
    data = TensorDataset(
        torch.randn(STEPS * 16, 1, 8, 8, generator=gen), torch.randint(0, 10, (STEPS * 16,), generator=gen)
    )
    return DataLoader(data, batch_size=batch_size, shuffle=True, generator=torch.Generator().manual_seed(seed))


def plain_loop(model: nn.Module, loader: DataLoader, clip: float | None = None) -> nn.Module:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for inputs, targets in loader:
        loss = nn.functional.cross_entropy(model(inputs), targets)
        optimizer.zero_grad()
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
    return model


def runtime_loop(rt: redline.Runtime, model: nn.Module, loader: DataLoader) -> nn.Module:
    model, optimizer = rt.setup(model, lambda params: torch.optim.AdamW(params, lr=1e-2))
    for inputs, targets in rt.setup_loader(loader):
        with rt.autocast():
            loss = nn.functional.cross_entropy(model(inputs), targets)
        rt.backward(loss)
        rt.step(optimizer)
    return model


def assert_same_weights(a: nn.Module, b: nn.Module, atol: float = 1e-6) -> None:
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.allclose(x, y, rtol=0, atol=atol), f"{name} differs by {(x - y).abs().max():.3g}"


@pytest.fixture
def initial() -> nn.Module:
    torch.manual_seed(0)
    return make_model()


def test_parity_with_the_plain_loop(initial):
    """fp32, compile off, everything else auto: the same weights as the plain loop (atol 1e-6)."""
    expected = plain_loop(copy.deepcopy(initial), make_loader())
    got = runtime_loop(
        redline.Runtime(devices="cpu", precision="fp32", compile="off"), copy.deepcopy(initial), make_loader()
    )
    assert_same_weights(got, expected)
    changed = any(not torch.equal(a, b) for a, b in zip(got.parameters(), initial.parameters(), strict=True))
    assert changed, "training did not change the weights; the parity check would be empty"


def test_grad_accum_matches_the_full_batch(initial):
    """Two micro-batches of 8 with accumulation step like one batch of 16 (a mean loss, no BatchNorm)."""
    expected = plain_loop(copy.deepcopy(initial), make_loader(batch_size=16))
    rt = redline.Runtime(devices="cpu", precision="fp32", compile="off", grad_accum=2)
    model, optimizer = rt.setup(copy.deepcopy(initial), lambda params: torch.optim.AdamW(params, lr=1e-2))
    stepped = []
    for inputs, targets in make_loader(batch_size=16):
        for half in (slice(0, 8), slice(8, 16)):
            loss = nn.functional.cross_entropy(model(inputs[half]), targets[half])
            rt.backward(loss)
            stepped.append(rt.step(optimizer))
    assert stepped == [False, True] * STEPS
    assert_same_weights(model, expected, atol=1e-5)


def test_clipping_matches_clip_grad_norm(initial):
    expected = plain_loop(copy.deepcopy(initial), make_loader(), clip=0.1)
    got = runtime_loop(
        redline.Runtime(devices="cpu", precision="fp32", compile="off", clip_grad_norm=0.1),
        copy.deepcopy(initial),
        make_loader(),
    )
    assert_same_weights(got, expected)
    unclipped = plain_loop(copy.deepcopy(initial), make_loader())
    assert any(not torch.allclose(a, b) for a, b in zip(got.parameters(), unclipped.parameters(), strict=True))


def test_bf16_mixed_runs_the_forward_in_bf16(initial):
    rt = redline.Runtime(devices="cpu", precision="bf16-mixed", compile="off")
    model, _ = rt.setup(initial, lambda params: torch.optim.SGD(params, lr=0.1))
    with rt.autocast():
        out = model(torch.randn(2, 1, 8, 8))
    assert out.dtype == torch.bfloat16
    assert rt.explain().precision.value == "bf16-mixed"


def test_fp16_mixed_scales_the_loss_and_still_learns(initial):
    rt = redline.Runtime(devices="cpu", precision="fp16-mixed", compile="off", clip_grad_norm=1.0)
    assert rt.precision.scaler is not None
    model, optimizer = rt.setup(initial, lambda params: torch.optim.SGD(params, lr=0.05))
    before = copy.deepcopy(model.state_dict())
    for inputs, targets in rt.setup_loader(make_loader()):
        with rt.autocast():
            loss = nn.functional.cross_entropy(model(inputs), targets)
        rt.backward(loss)
        rt.step(optimizer)
    assert rt.precision.scaler.get_scale() > 0
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_explain_lists_every_axis_after_setup(initial):
    rt = redline.Runtime(devices="cpu")
    rt.setup(initial, lambda params: torch.optim.AdamW(params))
    rt.setup_loader(make_loader())
    plan = rt.explain()
    assert [row[0] for row in plan.rows()] == [
        "device", "precision", "tf32", "deterministic", "seed", "grad_accum", "micro_batch", "clip_grad_norm",
        "strategy", "channels_last", "compile", "cuda_graphs", "attention", "activation_checkpointing", "optimizer",
        "zero_grad", "loader",
    ]  # fmt: skip
    assert plan.precision.value == "fp32" and plan.compile.value is False
    assert all(reason for _, _, reason in plan.rows())


def test_optimizer_instance_is_accepted_and_checked(initial):
    rt = redline.Runtime(devices="cpu", compile="off")
    optimizer = torch.optim.SGD(initial.parameters(), lr=0.1, foreach=False)  # its kind set: kept, not timed fused
    _, got = rt.setup(initial, optimizer)
    assert got is optimizer
    with pytest.raises(ConfigError, match="not in the model"):
        rt.setup(make_model(), torch.optim.SGD(make_model().parameters(), lr=0.1))


def test_rebuild_keeps_groups_and_hyperparameters(initial):
    params = list(initial.parameters())
    optimizer = torch.optim.AdamW(
        [{"params": params[:2], "lr": 0.1}, {"params": params[2:]}], lr=0.01, weight_decay=0.5
    )
    rebuilt = rebuild_optimizer(optimizer, fused=True)
    assert type(rebuilt) is torch.optim.AdamW
    assert [g["lr"] for g in rebuilt.param_groups] == [0.1, 0.01]
    assert all(g["fused"] and g["weight_decay"] == 0.5 for g in rebuilt.param_groups)
    assert [p for g in rebuilt.param_groups for p in g["params"]] == params
    initial(torch.randn(2, 1, 8, 8)).sum().backward()
    optimizer.step()
    with pytest.raises(ConfigError, match="already holds state"):
        rebuild_optimizer(optimizer, fused=True)


def test_an_lr_scheduler_built_before_setup_keeps_scheduling_the_optimizer_that_trains(initial):
    """On CUDA setup rebuilds a fresh AdamW fused; one a scheduler holds is kept, so the schedule reaches the model."""
    rt = redline.Runtime(devices="cpu", compile="off")
    rt.facts = dataclasses.replace(rt.facts, type="cuda", name="NVIDIA H100", capability=(9, 0))  # plan as on a GPU
    optimizer = torch.optim.AdamW(initial.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    model, got = rt.setup(initial, optimizer)
    assert got is optimizer and "LR scheduler" in rt.explain().optimizer.reason
    rt.backward(model(torch.randn(2, 1, 8, 8)).sum())
    assert rt.step(got)
    scheduler.step()
    assert [group["lr"] for group in got.param_groups] == [0.05]  # the optimizer that trains follows the schedule
    fresh, other = redline.Runtime(devices="cpu", compile="off"), make_model()
    fresh.facts = rt.facts
    _, fused = fresh.setup(other, torch.optim.AdamW(other.parameters(), lr=0.1))
    assert fresh.explain().optimizer.value == "fused" and fused.param_groups[0]["fused"]  # without one: rebuilt
    scheduled = torch.optim.AdamW(make_model().parameters(), lr=0.1)
    torch.optim.lr_scheduler.StepLR(scheduled, step_size=1)
    with pytest.raises(ConfigError, match=r"an LR scheduler was built on it(.|\n)*build the scheduler after setup"):
        rebuild_optimizer(scheduled)  # as FSDP's setup does, over the sharded parameters


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"devices": "cuda"}, DeviceUnavailableError, "no CUDA device"),
        ({"devices": "gpu"}, ConfigError, "cuda:N"),
        ({"precision": "bf16"}, ConfigError, "bf16-mixed"),
        ({"grad_accum": 0}, ConfigError, "grad_accum"),
        ({"clip_grad_norm": -1.0}, ConfigError, "clip_grad_norm"),
        ({"compile": "sometimes"}, ConfigError, "compile"),
    ],
)
def test_wrong_arguments_say_what_is_allowed(kwargs, error, match, initial):
    with pytest.raises(error, match=match):
        rt = redline.Runtime(**kwargs)
        rt.setup(initial, lambda params: torch.optim.SGD(params, lr=0.1))


def test_compile_failure_falls_back_to_eager_with_a_warning(initial, caplog):
    def broken_backend(graph_module, example_inputs):
        raise RuntimeError("backend exploded")

    expected = initial(torch.ones(2, 1, 8, 8))
    record = compile_module(initial, backend=broken_backend)
    with caplog.at_level(logging.WARNING, logger="redline"):
        out = initial(torch.ones(2, 1, 8, 8))
    assert torch.allclose(out, expected)
    assert record.fell_back is not None and "backend exploded" in record.fell_back
    assert any("running eagerly" in r.getMessage() and "hint:" in r.getMessage() for r in caplog.records)
    assert initial.forward == type(initial).forward.__get__(initial)  # later calls stay eager


def test_a_user_error_inside_a_compiled_model_is_not_swallowed(initial, caplog):
    record = compile_module(initial, backend="eager")
    with caplog.at_level(logging.WARNING, logger="redline"), pytest.raises(RuntimeError) as raised:
        initial(torch.ones(2, 3, 8, 8))  # wrong channel count: the user's error, raised as such
    # dynamo wraps it as its own TorchRuntimeError: it was taken for a compile failure, said so, and compile turned off
    assert type(raised.value) is RuntimeError and "channels" in str(raised.value)
    assert record.fell_back is None and "torch.compile failed" not in caplog.text
    initial(torch.ones(2, 1, 8, 8))  # the right input then compiles, as the first call would have
    assert record.compiles == 1 and record.fell_back is None


@pytest.mark.slow
def test_compiled_runtime_matches_eager(initial):
    """The one real inductor compile of the suite: same weights as eager (atol 1e-4), compile timed."""
    expected = plain_loop(copy.deepcopy(initial), make_loader())
    rt = redline.Runtime(devices="cpu", precision="fp32", compile="on")
    got = runtime_loop(rt, copy.deepcopy(initial), make_loader())
    plan = rt.explain()
    assert plan.compile.value is True, plan.compile.reason
    assert rt.compile_seconds is not None and "compiled 1 time(s) in" in plan.compile.reason
    assert_same_weights(got, expected, atol=1e-4)
    assert list(got.state_dict()) == list(initial.state_dict())  # no _orig_mod. prefixes


def test_an_optimizer_that_already_stepped_is_kept_with_its_state(initial):
    optimizer = torch.optim.AdamW(initial.parameters(), lr=1e-2)
    initial(torch.randn(2, 1, 8, 8)).sum().backward()
    optimizer.step()
    moments = {k: v["exp_avg"].clone() for k, v in enumerate(optimizer.state.values())}
    rt = redline.Runtime(devices="cpu", compile="off")
    _, got = rt.setup(initial, optimizer)
    assert got is optimizer and rt.explain().optimizer.value == "as given"
    assert all(torch.equal(moments[k], v["exp_avg"]) for k, v in enumerate(got.state.values()))


def test_gradients_are_freed_before_the_next_backward_on_cpu(initial):
    rt = redline.Runtime(devices="cpu", compile="off")
    model, optimizer = rt.setup(initial, lambda params: torch.optim.SGD(params, lr=0.1))
    assert rt.explain().zero_grad.value == "before backward"
    x = torch.randn(2, 1, 8, 8)
    rt.backward(model(x).sum())
    assert rt.step(optimizer)
    first = [p.grad.clone() for p in model.parameters()]
    rt.backward(model(x).sum())  # must start from zero, not accumulate onto the last step's grads
    fresh = copy.deepcopy(model)
    for p in fresh.parameters():
        p.grad = None
    fresh(x).sum().backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), fresh.parameters(), strict=True))
    assert any(not torch.equal(a, p.grad) for a, p in zip(first, model.parameters(), strict=True))


def backward_once(initial: nn.Module, **options: object) -> tuple[redline.Runtime, nn.Module, torch.optim.Optimizer]:
    """Set ``initial`` up with SGD under ``options`` and run one forward and ``rt.backward`` (no step yet)."""
    rt = redline.Runtime(devices="cpu", compile="off", **options)
    model, optimizer = rt.setup(initial, lambda params: torch.optim.SGD(params, lr=0.1))
    with rt.autocast():
        loss = nn.functional.cross_entropy(model(torch.randn(4, 1, 8, 8)), torch.tensor([0, 1, 2, 3]))
    rt.backward(loss)
    return rt, model, optimizer


def test_fp16_overflow_steps_are_skipped_and_counted(initial):
    rt, model, optimizer = backward_once(initial, precision="fp16-mixed")
    before = copy.deepcopy(model.state_dict())  # a backward leaves the weights as they were
    scale = rt.precision.scaler.get_scale()
    next(model.parameters()).grad.view(-1)[0] = float("inf")  # what an fp16 overflow leaves behind
    assert rt.step(optimizer)
    assert rt.skipped_steps == 1
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # weights untouched
    assert rt.precision.scaler.get_scale() == scale / 2  # the scale backed off


def test_fp16_refuses_a_direct_optimizer_step_on_scaled_gradients(initial):
    rt, model, optimizer = backward_once(initial, precision="fp16-mixed")
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ConfigError, match=r"multiplied by the loss scale \(65536\)(.|\n)*rt\.step\(optimizer\)"):
        optimizer.step()  # on gradients 65536 times too large: the weights would go to inf
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert rt.step(optimizer)  # the step that unscales first goes through
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_step_refuses_an_optimizer_setup_did_not_return(initial):
    rt, model, optimizer = backward_once(initial)
    with pytest.raises(ConfigError, match=r"that rt.setup\(\) did not return(.|\n)*model, optimizer = rt.setup"):
        rt.step(torch.optim.SGD(model.parameters(), lr=0.1))
    assert rt.step(optimizer)


def test_step_and_clip_before_setup_are_refused_naming_setup():
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(3, 4)).sum().backward()
    before = copy.deepcopy(model.state_dict())
    with redline.Runtime(devices="cpu") as rt:
        for called in (lambda: rt.step(optimizer), lambda: rt.clip_grad_norm_(optimizer, 1.0)):
            with pytest.raises(ConfigError, match=r"called before rt.setup\(\)(.|\n)*hint: `model, optimizer = rt"):
                called()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items()), "nothing was stepped"


@pytest.mark.parametrize("precision", ["fp32", "fp16-mixed"])
def test_backward_passes_its_keywords_to_torch(initial, precision):
    """retain_graph lets a second loss back-propagate through the same forward, as loss.backward(...) does."""
    rt = redline.Runtime(devices="cpu", precision=precision, compile="off")
    model, optimizer = rt.setup(initial, lambda params: torch.optim.SGD(params, lr=0.1))
    with rt.autocast():
        outputs = model(torch.randn(4, 1, 8, 8)).float()
    rt.backward(nn.functional.cross_entropy(outputs, torch.tensor([0, 1, 2, 3])), retain_graph=True)
    rt.backward(outputs.pow(2).mean())  # through the graph the first call kept
    assert rt.step(optimizer)
    first = next(model.parameters())
    rt.backward(nn.functional.cross_entropy(model(torch.randn(2, 1, 8, 8)), torch.tensor([0, 1])), inputs=[first])
    assert all(p.grad is None for p in list(model.parameters())[1:])  # only the named input got a gradient


def test_a_distributed_strategy_outside_a_launch_says_how_to_launch(initial):
    rt = redline.Runtime(devices="cpu", strategy="ddp")
    with pytest.raises(ConfigError, match="redline launch") as info:
        rt.setup(initial, lambda params: torch.optim.SGD(params, lr=0.1))
    assert info.value.parts is not None and info.value.parts[0] == "strategy"  # said by its flag on the CLI


@pytest.mark.parametrize("precision", ["fp32", "fp16-mixed"])
def test_a_step_no_backward_reached_changes_nothing_in_every_precision(initial, precision):
    """A loop that skips the backward of a bad batch still steps: in fp32 a no-op, and so under fp16, not a crash."""
    rt = redline.Runtime(devices="cpu", precision=precision, compile="off")
    model, optimizer = rt.setup(initial, lambda params: torch.optim.SGD(params, lr=0.1))
    before = copy.deepcopy(model.state_dict())
    assert rt.step(optimizer)  # no gradient anywhere: nothing moves
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert rt.skipped_steps == 0
    with rt.autocast():
        loss = nn.functional.cross_entropy(model(torch.randn(4, 1, 8, 8)), torch.tensor([0, 1, 2, 3]))
    rt.backward(loss)
    assert rt.step(optimizer)  # the next batch steps as ever
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())


def two_models() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(1)
    return nn.Linear(4, 4), nn.Linear(4, 1)


def two_losses(a: nn.Module, b: nn.Module, device_type: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    inputs = torch.linspace(-1, 1, 32).reshape(8, 4)
    with torch.autocast(device_type, dtype=torch.float16):
        overflowing = a(inputs).float().pow(2).mean() * 1e6  # its fp16 gradients overflow at the first scale
        fine = b(inputs).float().pow(2).mean()
    return overflowing, fine


def test_fp16_two_optimizers_step_as_torchs_one_scaler_recipe():
    """Both losses back-propagated, then both optimizers stepped: the scale is updated once, after both steps.

    An update after the first step (which overflowed) would halve the scale before the second optimizer's
    gradients were unscaled, so its step would be twice too large.
    """
    a, b = two_models()
    plain_a, plain_b = torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    overflowing, fine = two_losses(a, b)
    scaler.scale(overflowing).backward()
    scaler.scale(fine).backward()
    scaler.step(plain_a)
    scaler.step(plain_b)
    scaler.update()
    rt = redline.Runtime(devices="cpu", precision="fp16-mixed", compile="off")
    ra, rb = two_models()
    ra, opt_a = rt.setup(ra, lambda params: torch.optim.SGD(params, lr=0.1))
    rb, opt_b = rt.setup(rb, lambda params: torch.optim.SGD(params, lr=0.1))
    overflowing, fine = two_losses(ra, rb)
    rt.backward(overflowing)
    rt.backward(fine)
    assert rt.step(opt_a) and rt.step(opt_b)
    assert_same_weights(ra, a, atol=0)  # skipped: the overflow
    assert_same_weights(rb, b, atol=0)  # stepped as far as torch's recipe steps it
    assert not torch.equal(rb.weight, two_models()[1].weight)
    assert rt.skipped_steps == 1 and rt.precision.scaler.get_scale() == scaler.get_scale() == 2.0**15


def _limit_name():
    import torch._dynamo.config as dynamo_config

    return dynamo_config, "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"


def test_each_compiled_model_keeps_its_graphs_apart_and_room_is_made_for_more():
    """torch.compile's limit counts the graphs of one code object; it wraps torch.nn's own forwards (an
    nn.Sequential's) in a function whose code all of them would share."""
    dynamo_config, name = _limit_name()
    with dynamo_config.patch(name, 2):
        first, second = (compile_module(nn.Sequential(nn.ReLU()), backend="eager", dynamic=False) for _ in "ab")
        for record in (first, second):
            for rows in (1, 2):
                record.module(torch.zeros(rows))
        with recompile_room(second, 2):
            for rows in (3, 4):
                second.module(torch.zeros(rows))
    assert (first.compiles, second.compiles, second.uncompiled) == (2, 4, 0)


def test_a_call_torch_compile_gave_up_on_is_counted_and_told():
    class Triple(nn.Module):
        def forward(self, x):
            return x * 3

    dynamo_config, name = _limit_name()
    with dynamo_config.patch(name, 1):
        record = compile_module(Triple(), backend="eager", dynamic=False)
        record.module(torch.zeros(1))
        out = record.module(torch.ones(2))  # a second shape, past the limit: eager, and still right
        for _ in range(3):  # torch skips the frame from then on, unsaid: these ran eagerly too
            record.module(torch.ones(2))
    assert torch.equal(out, torch.full((2,), 3.0))
    assert (record.compiles, record.uncompiled, record.calls) == (1, 1, 5)
    assert eager_calls_of(record.module) == (4, 5)
    told = explain_compile(Choice(True, "requested"), [record]).reason
    assert told.endswith(
        "torch.compile gave up compiling (its recompile limit, or a frame it cannot trace): 4 of 5 call(s) ran eagerly"
    )


def test_a_resumed_runs_compile_row_counts_its_own_stretch_in_place_of_the_checkpoints():
    """The stored reason's count stayed, and each resume added its own: three counts, none saying whose."""
    record = compile_module(nn.Sequential(nn.ReLU()), backend="eager", dynamic=False)
    record.module(torch.ones(2))
    stored = "from checkpoint step 20: requested; compiled 2 time(s) in 15.6 s (recompiled: a new shape)"
    told = explain_compile(Choice(True, stored), [record]).reason
    assert re.fullmatch(r"from checkpoint step 20: requested; compiled 1 time\(s\) in \d+\.\d s since the resume", told)
    fresh = explain_compile(Choice(True, "requested"), [record]).reason
    assert re.fullmatch(r"requested; compiled 1 time\(s\) in \d+\.\d s", fresh)


def test_an_engines_graph_per_bucket_is_told_as_planned_not_as_recompiles(caplog):
    told = {}
    for per_bucket in (False, True):
        record = compile_module(nn.Sequential(nn.ReLU()), per_bucket=per_bucket, backend="eager", dynamic=False)
        with torch.no_grad(), caplog.at_level(logging.INFO, logger="redline"):
            caplog.clear()
            for rows in (1, 2):
                record.module(torch.zeros(rows))
        told[per_bucket] = (explain_compile(Choice(True, "measured"), [record]).reason, caplog.text)
    assert "(0 for training, 2 for evaluation under no_grad) (recompiled:" in told[False][0]
    assert "compiled Sequential again" in told[False][1]
    assert "compiled 2 time(s)" in told[True][0] and told[True][0].endswith("(a graph per batch bucket)")
    assert "again" not in told[True][1], "a bucket's own graph is no news"


def test_a_recompile_for_a_length_beyond_the_batch_axis_says_to_pad_to_fixed_lengths(caplog):
    """A collate_fn that pads each batch to its longest item recompiled the step, with torch's reason alone."""
    torch._dynamo.reset()  # graphs left by earlier tests would change which calls compile
    record = compile_module(nn.Sequential(nn.Linear(3, 3)), backend="eager")
    with caplog.at_level(logging.INFO, logger="redline"):
        for shape in ((2, 5, 3), (2, 7, 3), (4, 7, 3)):  # a new length, then a new batch size
            record.module(torch.zeros(shape)).sum().backward()
    said = [r.getMessage() for r in caplog.records if "compiled Sequential again" in r.getMessage()]
    assert len(said) == 2 and "size mismatch at index 1" in said[0] and "size mismatch at index 0" in said[1]
    assert "hint: a length beyond the batch axis changed from one batch to the next: pad the data" in said[0]
    assert "in the collate_fn, so the compiled step sees fixed shapes" in said[0]
    assert "hint" not in said[1], "a batch size that changed is no padding's to fix"


@pytest.mark.parametrize("cpu", ["amx", "avx2"])  # with the run's precision check, and without
@pytest.mark.parametrize("asked", ["auto", "off"])
def test_a_model_the_caller_compiled_is_said_to_run_compiled(monkeypatch, cpu, asked):
    """Its Plan said `off: auto: on cpu the gain rarely repays the compile` while the model ran compiled."""
    from redline.hardware.device import FAKE_CPU_ENV

    monkeypatch.setenv(FAKE_CPU_ENV, cpu)
    model = torch.compile(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)))
    with redline.Runtime(devices="cpu", compile=asked) as rt:
        rt.setup(model, lambda params: torch.optim.SGD(params, lr=0.1))
        compile_choice = rt.explain().compile
    assert compile_choice is not None and compile_choice.value is True
    assert compile_choice.reason.startswith("compiled by the caller (torch.compile before setup): run as given")
    assert ("cannot undo it" in compile_choice.reason) == (asked == "off")


def test_a_compile_mode_auto_does_not_use_is_said_in_a_warning_and_the_plan_not_dropped(initial, caplog):
    # --compile-mode max-autotune with compile left to auto ran eager on a CPU with no word of the mode
    with caplog.at_level(logging.WARNING, logger="redline"), redline.Runtime(
        devices="cpu", precision="fp32", compile_mode="max-autotune"
    ) as rt:  # fmt: skip
        rt.setup(initial, torch.optim.SGD(initial.parameters(), lr=0.1))
        plan = rt.explain()
    assert plan.compile.value is False
    assert plan.compile.reason.endswith("; compile_mode='max-autotune' unused (compile='on' compiles in it)")
    assert "compile_mode='max-autotune' is not used: auto: on cpu" in caplog.text
    assert "hint: pass compile='on' to compile in it" in caplog.text
