"""Every resolver decision, fed device facts as data."""

import dataclasses

import pytest

from devices import A100, CPU, CPU_AMX, CPUS, EIGHT_GPUS, H100, MAC, MPS, NO_ACCELERATOR, ONE_GPU, P100, T4, V100
from redline.errors import ConfigError, DeviceUnavailableError
from redline.hardware.device import Accelerators, DeviceFacts
from redline.plan import Choice, Plan, parse_switch
from redline.plan.compile import MIN_STEPS_CUDA, resolve_compile
from redline.plan.device import resolve_device, resolve_worker_device
from redline.plan.layout import resolve_channels_last
from redline.plan.micro_batch import after_oom, found_size, resolve_micro_batch
from redline.plan.optimizer import OptimizerFacts, optimizer_facts, resolve_optimizer, resolve_zero_grad
from redline.plan.precision import resolve_precision, resolve_tf32

SUPPORTED = lambda: (True, "")  # noqa: E731


# -- device -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("requested", "found", "expected"),
    [
        ("auto", EIGHT_GPUS, "cuda:0"),
        ("auto", MAC, "mps"),
        ("auto", NO_ACCELERATOR, "cpu"),
        ("cpu", EIGHT_GPUS, "cpu"),
        ("cuda", ONE_GPU, "cuda:0"),
        ("cuda:7", EIGHT_GPUS, "cuda:7"),
        (" CUDA:1 ", EIGHT_GPUS, "cuda:1"),
        ("mps", MAC, "mps"),
    ],
)
def test_device_resolves(requested, found, expected):
    assert resolve_device(requested, found).value == expected


def test_auto_device_says_why():
    assert "8 CUDA devices" in resolve_device("auto", EIGHT_GPUS).reason
    assert "no CUDA or MPS" in resolve_device("auto", NO_ACCELERATOR).reason


def test_a_worker_of_a_distributed_job_gets_its_own_gpu():
    worker = resolve_worker_device("auto", EIGHT_GPUS, local_rank=3)
    assert worker.value == "cuda:3" and worker.reason.endswith("; worker 3's GPU")
    assert resolve_worker_device("auto", EIGHT_GPUS, local_rank=None).value == "cuda:0"  # one process
    assert resolve_worker_device("cpu", EIGHT_GPUS, local_rank=3).value == "cpu"  # gloo workers on the CPU


def test_a_worker_without_a_gpu_of_its_own_is_refused_with_the_fix():
    with pytest.raises(DeviceUnavailableError, match="LOCAL_RANK=2 needs its own GPU, but this process sees 2") as err:
        resolve_worker_device("auto", Accelerators(cuda_count=2), local_rank=2)
    assert "--nproc auto" in str(err.value)
    assert resolve_worker_device("cpu", Accelerators(cuda_count=2), local_rank=2).value == "cpu"


@pytest.mark.parametrize("requested", ["gpu", "cuda:x", "cpu:1", "tpu", "", "mps:0"])
def test_unknown_device_names_the_forms(requested):
    with pytest.raises(ConfigError, match="'auto', 'cpu', 'cuda', 'cuda:N' or 'mps'"):
        resolve_device(requested, ONE_GPU)


def test_cuda_without_gpu_says_how_to_fix():
    with pytest.raises(DeviceUnavailableError, match="no CUDA device") as err:
        resolve_device("cuda", NO_ACCELERATOR)
    assert "hint:" in str(err.value) and "allowed here: cpu" in str(err.value)


def test_cuda_index_out_of_range():
    with pytest.raises(DeviceUnavailableError, match=r"(?s)only 1 CUDA device.*CUDA_VISIBLE_DEVICES"):
        resolve_device("cuda:1", ONE_GPU)


def test_mps_missing():
    with pytest.raises(DeviceUnavailableError, match="MPS is not available"):
        resolve_device("mps", ONE_GPU)


# -- precision ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("facts", "expected"),
    [
        (H100, "bf16-mixed"),
        (A100, "bf16-mixed"),
        (V100, "fp16-mixed"),
        (T4, "fp16-mixed"),
        (P100, "fp32"),
        (CPU, "fp32"),
        (CPU_AMX, "fp32"),
        (MPS, "fp32"),
    ],
)
def test_auto_precision(facts, expected):
    choice = resolve_precision("auto", facts)
    assert choice.value == expected
    assert choice.reason.startswith("auto:")


def test_auto_precision_reason_names_the_architecture():
    assert "sm90" in resolve_precision("auto", H100).reason
    assert "no bf16" in resolve_precision("auto", V100).reason
    mi300x = DeviceFacts(type="cuda", name="AMD Instinct MI300X", capability=(9, 4), mem_gib=192)
    assert "natively (ROCm capability 9.4)" in resolve_precision("auto", mi300x).reason, "gfx942: no sm name"


# What each CPU's precision reason must say: the instruction set it saw (a phrase no other CPU's
# reason has), and what that means for bf16.
CPU_REASONS = {
    "avx2": ("AVX2 only", "no fast bf16"),
    "avx512": ("CPU has AVX-512", "no bf16 instructions"),
    "avx512_bf16": ("CPU has AVX512-BF16", "no AMX"),
    "amx": ("CPU has AMX", "casts can cost more"),
    "arm": ("Arm CPU", "not measured"),
}


@pytest.mark.parametrize("isa", sorted(CPUS))
def test_auto_precision_is_fp32_on_every_cpu_and_names_what_it_saw(isa):
    choice = resolve_precision("auto", CPUS[isa])
    assert choice.value == "fp32"
    assert choice.reason.startswith("auto:")
    for phrase in CPU_REASONS[isa]:
        assert phrase in choice.reason
    others = [CPU_REASONS[other][0] for other in CPUS if other != isa]
    assert not any(phrase in choice.reason for phrase in others), choice.reason  # no "AVX2 only" on AMX
    assert "REDLINE_CPU" not in choice.reason  # probed, not faked


def test_auto_precision_says_when_the_cpu_was_faked():
    faked = dataclasses.replace(CPU_AMX, cpu_isa_faked=True)
    reason = resolve_precision("auto", faked).reason
    assert "AMX" in reason and "REDLINE_CPU=amx" in reason and "not this machine's" in reason


@pytest.mark.parametrize(
    ("isa", "bf16"), [("avx2", False), ("avx512", False), ("avx512_bf16", True), ("amx", True), ("arm", False)]
)
def test_cpu_bf16_means_bf16_instructions(isa, bf16):
    assert CPUS[isa].bf16 is bf16


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed", "fp16-mixed"])
def test_explicit_precision_is_kept_where_possible(precision):
    assert resolve_precision(precision, H100) == Choice(precision, "requested")
    assert resolve_precision(precision, CPU).value == precision


def test_fp16_on_a_cpu_says_what_it_costs_and_what_to_use_instead():
    reason = resolve_precision("fp16-mixed", CPU).reason
    assert "loss scaling" in reason and "skipped" in reason and "bf16-mixed" in reason
    assert resolve_precision("fp16-mixed", H100).reason == "requested"


def test_bf16_on_v100_is_refused_with_the_fix():
    with pytest.raises(ConfigError, match=r"expected 'fp32', 'fp16-mixed' or 'auto' on .* no native bf16") as err:
        resolve_precision("bf16-mixed", V100)
    assert "7.0" in str(err.value) and "hint:" in str(err.value)


@pytest.mark.parametrize("bad", ["bf16", "fp16", "16-mixed", "float32", None])
def test_unknown_precision(bad):
    with pytest.raises(ConfigError, match="'fp32', 'bf16-mixed', 'fp16-mixed'"):
        resolve_precision(bad, H100)


@pytest.mark.parametrize(("facts", "expected"), [(H100, True), (A100, True), (V100, False), (T4, False), (CPU, False)])
def test_tf32(facts, expected):
    assert resolve_tf32(facts).value is expected


def test_tf32_on_rocm_is_on_only_where_hipblaslt_is_allowed_it(monkeypatch):
    # torch ignores allow_tf32 on ROCm without HIPBLASLT_ALLOW_TF32=1: an MI300X's fp32 matmuls then run in full
    # fp32, and an MFU over its TF32 peak (653.7 TFLOP/s, 4x the fp32 one) read a quarter of the truth
    import redline.hardware.device as device

    mi300x = DeviceFacts(type="cuda", name="AMD Instinct MI300X", capability=(9, 4), mem_gib=192, rocm_tf32=False)
    off = resolve_tf32(mi300x)
    assert off.value is False and "HIPBLASLT_ALLOW_TF32=1" in off.reason
    assert resolve_tf32(dataclasses.replace(mi300x, rocm_tf32=True)).value is True
    monkeypatch.setattr(device.torch, "__version__", "2.9.1+rocm6.4")
    monkeypatch.delenv("HIPBLASLT_ALLOW_TF32", raising=False)
    assert device.rocm_tf32() is False
    monkeypatch.setenv("HIPBLASLT_ALLOW_TF32", "1")
    assert device.rocm_tf32() is True
    monkeypatch.setattr(device.torch, "__version__", "2.5.1+rocm6.2")  # before torch turned TF32 on for ROCm
    assert device.rocm_tf32() is False


# -- compile ------------------------------------------------------------------------------------


def test_compile_off_never_asks_whether_supported():
    def boom():
        raise AssertionError("supported() must not be called")

    assert resolve_compile("off", H100, planned_steps=10**6, supported=boom) == Choice(False, "requested")
    assert resolve_compile("auto", CPU, planned_steps=10**6, supported=boom).value is False


def test_compile_auto_weighs_the_run_length():
    assert resolve_compile("auto", H100, planned_steps=MIN_STEPS_CUDA, supported=SUPPORTED).value is True
    short = resolve_compile("auto", H100, planned_steps=MIN_STEPS_CUDA - 1, supported=SUPPORTED)
    assert short.value is False and "too few" in short.reason
    unknown = resolve_compile("auto", H100, planned_steps=None, supported=SUPPORTED)
    assert unknown.value is False and "unknown" in unknown.reason


def test_compile_auto_stays_eager_on_cpu_and_mps():
    assert resolve_compile("auto", CPU, planned_steps=10**6, supported=SUPPORTED).value is False
    assert resolve_compile("auto", MPS, planned_steps=10**6, supported=SUPPORTED).value is False


def test_compile_requested_but_unsupported_runs_eagerly_and_says_why():
    choice = resolve_compile(True, CPU, planned_steps=None, supported=lambda: (False, "no C++ compiler found"))
    assert choice.value is False and "no C++ compiler found" in choice.reason
    auto = resolve_compile("auto", H100, planned_steps=10**6, supported=lambda: (False, "triton is not installed"))
    assert auto.value is False and "triton" in auto.reason


@pytest.mark.parametrize("bad", ["yes", 1.5, "maybe", None])
def test_compile_bad_value(bad):
    with pytest.raises(ConfigError, match="expected one of 'auto', 'on', 'off'"):
        resolve_compile(bad, CPU, planned_steps=None, supported=SUPPORTED)


# -- channels_last ------------------------------------------------------------------------------


def test_channels_last_auto():
    assert resolve_channels_last("auto", H100, has_conv2d=True, precision="bf16-mixed").value is True
    assert resolve_channels_last("auto", V100, has_conv2d=True, precision="fp16-mixed").value is True
    assert resolve_channels_last("auto", A100, has_conv2d=True, precision="fp32").value is True  # TF32
    assert resolve_channels_last("auto", V100, has_conv2d=True, precision="fp32").value is False
    assert resolve_channels_last("auto", H100, has_conv2d=False, precision="bf16-mixed").value is False
    assert resolve_channels_last("auto", CPU, has_conv2d=True, precision="fp32").value is False
    assert resolve_channels_last("auto", P100, has_conv2d=True, precision="fp32").value is False


@pytest.mark.parametrize("requested", ["auto", "on"])
def test_channels_last_keeps_a_model_fsdp_shards_nchw_and_says_why(requested):
    # fully_shard takes contiguous parameters only: NHWC convolution weights would stop the run at setup
    for facts, precision in ((H100, "bf16-mixed"), (CPUS["amx"], "bf16-mixed")):
        sharded = resolve_channels_last(requested, facts, has_conv2d=True, precision=precision, sharded=True)
        assert sharded.value is False and "FSDP shards contiguous parameters only" in sharded.reason
        assert sharded.reason.startswith("auto: " if requested == "auto" else "requested, but ")
    assert resolve_channels_last("off", H100, has_conv2d=True, precision="fp32", sharded=True).reason == "requested"


def test_channels_last_auto_on_a_cpu_is_for_bf16_on_amx_alone():
    # oneDNN's AMX bf16 convolutions want NHWC (digits: 1.33x); its fp32 ones ran as fast in NCHW
    amx = resolve_channels_last("auto", CPUS["amx"], has_conv2d=True, precision="bf16-mixed")
    assert amx.value is True and "AMX" in amx.reason
    assert resolve_channels_last("auto", CPUS["amx"], has_conv2d=True, precision="fp32").value is False
    assert resolve_channels_last("auto", CPUS["amx"], has_conv2d=False, precision="bf16-mixed").value is False
    for isa in ("avx512_bf16", "avx512", "avx2", "arm"):  # not measured there: NCHW, as before
        assert resolve_channels_last("auto", CPUS[isa], has_conv2d=True, precision="bf16-mixed").value is False


def test_channels_last_explicit():
    assert resolve_channels_last("on", CPU, has_conv2d=True, precision="fp32") == Choice(True, "requested")
    assert resolve_channels_last(False, H100, has_conv2d=True, precision="bf16-mixed").value is False
    no_conv = resolve_channels_last("on", H100, has_conv2d=False, precision="fp32")
    assert no_conv.value is False and "no 2-d convolution" in no_conv.reason


# -- optimizer ----------------------------------------------------------------------------------


def facts_of(**overrides):
    base = {"name": "AdamW", "has_fused": True, "has_state": False, "impl_set_by_user": False}
    return OptimizerFacts(**{**base, **overrides})


def test_optimizer_fused_on_cuda_by_rule_and_kept_where_untimed():
    assert resolve_optimizer(facts_of(), H100).value == "fused"
    assert resolve_optimizer(facts_of(), CPU).value == "as given"
    assert resolve_optimizer(facts_of(), MPS).value == "as given"


def test_optimizer_kept_when_rebuilding_would_change_the_run():
    stateful = resolve_optimizer(facts_of(has_state=True), H100)
    assert stateful.value == "as given" and "state" in stateful.reason
    user = resolve_optimizer(facts_of(impl_set_by_user=True), H100)
    assert user.value == "as given" and "user" in user.reason
    custom = resolve_optimizer(facts_of(name="Lion", has_fused=False), H100)
    assert custom.value == "as given" and "no fused" in custom.reason


@pytest.mark.parametrize("implementation", [{"fused": False}, {"fused": True}, {"foreach": False}, {"foreach": True}])
def test_an_implementation_the_user_chose_is_kept_even_when_it_turns_fused_off(implementation):
    import torch

    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))], **implementation)
    assert optimizer_facts(optimizer).impl_set_by_user
    assert resolve_optimizer(optimizer_facts(optimizer), H100).value == "as given"
    default = torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))])
    assert not optimizer_facts(default).impl_set_by_user


def test_an_optimizer_an_lr_scheduler_holds_is_kept_as_given():
    """Rebuilt fused, it would be another object: the scheduler built on it would set a learning rate nothing uses."""
    import torch

    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))], lr=0.1)
    assert not optimizer_facts(optimizer).has_scheduler
    torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    facts = optimizer_facts(optimizer)
    assert facts.has_scheduler
    kept = resolve_optimizer(facts, H100)
    assert kept.value == "as given" and "LR scheduler" in kept.reason and "setup returns" in kept.reason


def test_an_optimizer_reduce_lr_on_plateau_holds_is_kept_as_given_and_not_rebuilt_over_shards():
    """ReduceLROnPlateau records nothing on the optimizer's groups, as the other schedulers do (initial_lr): rebuilt
    fused, the scheduler would go on lowering the learning rate of the old optimizer, and training would never slow."""
    import torch

    from redline.runtime.optimizer import check_stateless

    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))], lr=0.1)
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, patience=0)
    vars(scheduler)  # a scheduler whose __dict__ was asked for is held through it
    kept = resolve_optimizer(optimizer_facts(optimizer), H100)
    assert kept.value == "as given" and "LR scheduler" in kept.reason
    with pytest.raises(ConfigError, match="an LR scheduler was built on it"):
        check_stateless(optimizer, " over the shards")
    del scheduler  # gone: nothing holds the optimizer any more, and it is rebuilt fused
    assert resolve_optimizer(optimizer_facts(optimizer), H100).value == "fused"


def test_parameters_a_fused_kernel_refuses_keep_the_optimizer_as_given():
    """torch's fused kernels take real floating-point parameters with dense gradients, and fail at the first step
    on others: complex parameters, or an embedding with sparse=True (trained by SGD)."""
    import torch
    from torch import nn

    complex_param = torch.optim.AdamW([nn.Parameter(torch.ones(2, dtype=torch.complex64))])
    kept = resolve_optimizer(optimizer_facts(complex_param), H100)
    assert kept.value == "as given" and "not real floating point" in kept.reason
    sparse = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 2))
    kept = resolve_optimizer(optimizer_facts(torch.optim.SGD(sparse.parameters(), lr=0.1), sparse), H100)
    assert kept.value == "as given" and "sparse gradients" in kept.reason
    dense = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 2))
    assert resolve_optimizer(optimizer_facts(torch.optim.SGD(dense.parameters(), lr=0.1), dense), H100).value == "fused"


# -- the Plan -----------------------------------------------------------------------------------


def test_plan_renders_every_decided_axis_with_its_reason():
    plan = Plan(
        device=Choice("cuda:0", "auto: 1 CUDA device visible"),
        precision=Choice("bf16-mixed", "auto: runs bf16 natively (sm90)"),
        tf32=Choice(True, "TF32 tensor cores"),
        grad_accum=Choice(4, "requested"),
        clip_grad_norm=Choice(None, "default: no clipping"),
    )
    text = str(plan)
    assert "bf16-mixed" in text and "sm90" in text and "compile" not in text
    data = plan.to_dict()
    assert data["tf32"] == {"value": True, "reason": "TF32 tensor cores"}
    assert data["clip_grad_norm"]["value"] is None
    assert [row[0] for row in plan.rows()] == ["device", "precision", "tf32", "grad_accum", "clip_grad_norm"]


@pytest.mark.parametrize(
    ("given", "expected"), [("on", True), (True, True), ("off", False), (False, False), ("auto", None)]
)
def test_parse_switch(given, expected):
    assert parse_switch("x", given) is expected


def test_zero_grad_timing():
    assert resolve_zero_grad(H100).value == "after step"
    assert resolve_zero_grad(CPU).value == "before backward"
    assert resolve_zero_grad(MPS).value == "before backward"


# -- strategy -----------------------------------------------------------------------------------


def test_strategy_auto():
    from redline.plan.strategy import resolve_strategy

    assert resolve_strategy("auto", world_size=1, params=10**9, device_mem_gib=80).value == "single"
    small = resolve_strategy("auto", world_size=8, params=124 * 10**6, device_mem_gib=80)  # GPT-2 small: 1.8 GiB
    assert small.value == "ddp" and "fit in half of 80 GiB" in small.reason
    big = resolve_strategy("auto", world_size=8, params=7 * 10**9, device_mem_gib=80)  # 7B: 104 GiB of state
    assert big.value == "fsdp" and "13.0 GiB each" in big.reason
    assert resolve_strategy("auto", world_size=2, params=10**6, device_mem_gib=None).value == "ddp"  # CPU


def test_strategy_explicit_and_wrong():
    from redline.plan.strategy import resolve_strategy

    assert resolve_strategy("fsdp", world_size=2, params=1, device_mem_gib=80).value == "fsdp"
    with pytest.raises(ConfigError, match="one of 'auto', 'single', 'ddp', 'fsdp'"):
        resolve_strategy("zero3", world_size=2, params=1, device_mem_gib=80)
    with pytest.raises(ConfigError, match="several processes"):
        resolve_strategy("single", world_size=2, params=1, device_mem_gib=80)


# -- micro-batches -------------------------------------------------------------------------------


def test_micro_batch_reasons_say_how_the_batch_runs_and_syncs():
    assert resolve_micro_batch(None) == Choice(
        None, "default: each batch runs whole; an out-of-memory error stops the run"
    )
    assert resolve_micro_batch("auto") == Choice("auto", "auto: the whole batch; halved on out-of-memory")
    assert (
        resolve_micro_batch(4, strategy="single").reason
        == "requested: micro-batches of at most 4 samples, gradients accumulated"
    )
    ddp = resolve_micro_batch("auto", strategy="ddp").reason
    assert "without gradient sync" in ddp and "all-reduced once per batch, after the backward" in ddp
    assert "in the last micro-batch's backward, overlapped" in resolve_micro_batch(4, strategy="ddp").reason
    assert "last micro-batch" in resolve_micro_batch(4, strategy="fsdp").reason
    halved = after_oom([(32, 12), (16, 12)], 8, strategy="ddp")
    assert (
        halved.value == 8
        and halved.reason.startswith("auto: 8 after out-of-memory at 32 (step 12), 16 (step 12); DDP")
        and "all-reduced once per batch" in halved.reason
    )


def test_auto_micro_batch_under_fsdp_is_refused_with_the_fix():
    with pytest.raises(
        ConfigError, match=r"(?s)micro_batch='auto' is not supported with strategy 'fsdp'.*--micro-batch 4"
    ):
        resolve_micro_batch("auto", strategy="fsdp")


@pytest.mark.parametrize(
    ("entry", "expected"),
    [
        ({"value": 4, "reason": "auto: 4 after out-of-memory at 8 (step 3)"}, 4),
        ({"value": 4, "reason": "from checkpoint step 6: auto: 4 after out-of-memory at 8 (step 3)"}, 4),
        ({"value": "auto", "reason": "auto: the whole batch; halved on out-of-memory"}, None),
        ({"value": 4, "reason": "requested: micro-batches of 4 samples, gradients accumulated"}, None),
        (None, None),
    ],
)
def test_a_resumed_auto_run_finds_the_size_its_plan_had_halved_to(entry, expected):
    assert found_size(entry) == expected
