"""The engine's inference plan: the candidates each device gets, the choice from timings, CUDA graphs, sticky errors."""

import pytest

from redline.errors import ConfigError
from redline.hardware.device import DeviceFacts
from redline.plan.inference import (
    MARGIN,
    TOLERANCE,
    Setting,
    Timing,
    choose,
    no_room_for_copy,
    propose,
    read_measure,
    resolve_cuda_graphs,
    split_buckets,
)
from redline.runtime.cuda_errors import is_sticky_cuda_error

H200 = DeviceFacts(type="cuda", name="NVIDIA H200", index=0, capability=(9, 0), cpu_isa="amx")
V100 = DeviceFacts(type="cuda", name="Tesla V100", index=0, capability=(7, 0))
AVX2 = DeviceFacts(type="cpu", name="CPU", cpu_isa="avx2")
AMX = DeviceFacts(type="cpu", name="CPU", cpu_isa="amx")
BF16_CPU = DeviceFacts(type="cpu", name="CPU", cpu_isa="avx512_bf16")

FP32 = Setting("fp32", False)
BF16 = Setting("bf16-mixed", False)


def supported():
    return True, ""


def unsupported():
    return False, "triton is not installed"


def labels(proposal):
    return [proposal.reference.label, *(c.label for c in proposal.candidates)]


def test_a_cpu_without_bf16_arithmetic_times_nothing_and_keeps_fp32_with_the_reason():
    proposal = propose(AVX2, precision="auto", compile="auto", measure=True, compile_supported=supported)
    assert labels(proposal) == ["fp32"]
    assert proposal.precision.value == "fp32" and "AVX2" in proposal.precision.reason
    assert proposal.compile.value is False


@pytest.mark.parametrize("facts", [AMX, BF16_CPU])
def test_a_cpu_with_bf16_arithmetic_times_bf16_against_fp32_and_a_compile_of_the_one_kept_after(facts):
    proposal = propose(facts, precision="auto", compile="auto", measure=True, compile_supported=supported)
    assert labels(proposal) == ["fp32", "bf16-mixed", "bf16-true"], "no compiled candidate among the others"
    assert (
        proposal.compile_after and "unless a compile of the setting kept is measured faster" in proposal.compile.reason
    )
    assert proposal.channels_last.value is False and "no 2-d convolution" in proposal.channels_last.reason
    unsupported_here = propose(facts, precision="auto", compile="auto", measure=True, compile_supported=unsupported)
    assert not unsupported_here.compile_after and "triton is not installed" in unsupported_here.compile.reason
    for given in ({"compile": "off", "measure": True}, {"compile": "auto", "measure": False}):
        assert not propose(facts, precision="auto", compile_supported=supported, **given).compile_after, given
    asked = []
    propose(facts, precision="auto", compile="off", measure=True, compile_supported=lambda: asked.append(1))
    assert asked == [], "whether compile is supported is not asked where no compile is in question"


def test_a_convolutional_model_is_timed_in_both_layouts_under_every_precision():
    proposal = propose(AMX, precision="auto", compile="auto", measure=True, compile_supported=supported,
                       convolutional=True)  # fmt: skip
    assert labels(proposal) == [
        "fp32", "fp32+channels_last", "bf16-mixed", "bf16-mixed+channels_last", "bf16-true", "bf16-true+channels_last",
    ]  # fmt: skip
    assert proposal.reference == Setting("fp32", False, False)
    assert proposal.channels_last.value is False and "unless channels_last is measured" in proposal.channels_last.reason
    asked = propose(AMX, precision="fp32", compile="off", measure=True, compile_supported=supported,
                    channels_last="on", convolutional=True)  # fmt: skip
    assert labels(asked) == ["fp32+channels_last"] and asked.channels_last.reason == "requested"


def test_a_compile_is_timed_only_on_the_references_weights_where_the_others_are_copies():
    """A setting whose weights are cast or laid out otherwise runs on a copy of the model, and eagerly."""
    proposal = propose(H200, precision="auto", compile="auto", measure=True, compile_supported=supported,
                       convolutional=True)  # fmt: skip
    compiled = [c.label for c in proposal.candidates if c.compiled]
    assert compiled == ["fp32+compile", "bf16-mixed+compile"]
    assert all(c.variant == proposal.reference.variant for c in proposal.candidates if c.compiled)
    assert "bf16-true+channels_last" in labels(proposal) and len(labels(proposal)) == 8


def test_without_a_measurement_the_layout_follows_the_training_rule():
    amx = propose(AMX, precision="bf16-true", compile="off", measure=False, compile_supported=supported,
                  convolutional=True)  # fmt: skip
    assert amx.channels_last.value is True and "AMX" in amx.channels_last.reason, "bf16-true is judged as bf16"
    plain = propose(AMX, precision="fp32", compile="off", measure=False, compile_supported=supported,
                    convolutional=True)  # fmt: skip
    assert plain.channels_last.value is False


def test_cuda_times_each_fast_precision_with_and_without_compile():
    proposal = propose(H200, precision="auto", compile="auto", measure=True, compile_supported=supported)
    assert labels(proposal) == ["fp32", "fp32+compile", "bf16-mixed", "bf16-mixed+compile", "bf16-true"]
    old = propose(V100, precision="auto", compile="auto", measure=True, compile_supported=supported)
    assert labels(old) == ["fp32", "fp32+compile", "fp16-mixed", "fp16-mixed+compile", "fp16-true"]


def test_cuda_without_a_working_compiler_times_precision_only_and_says_why():
    proposal = propose(H200, precision="auto", compile="auto", measure=True, compile_supported=unsupported)
    assert labels(proposal) == ["fp32", "bf16-mixed", "bf16-true"]
    assert proposal.compile.value is False and "triton" in proposal.compile.reason


def test_explicit_values_are_used_as_given_and_not_timed():
    proposal = propose(H200, precision="fp16-mixed", compile="on", measure=True, compile_supported=supported)
    assert labels(proposal) == ["fp16-mixed+compile"]
    assert proposal.precision.reason == "requested" and proposal.compile.reason == "requested"
    # An explicit precision with compile still auto: only the compile is timed, in that precision.
    half = propose(H200, precision="fp32", compile="auto", measure=True, compile_supported=supported)
    assert labels(half) == ["fp32", "fp32+compile"]
    true = propose(H200, precision="bf16-true", compile="auto", measure=True, compile_supported=supported)
    assert labels(true) == ["bf16-true", "bf16-true+compile"] and true.precision.reason == "requested"


def test_a_precision_no_engine_takes_or_bf16_weights_on_a_gpu_without_bf16_is_refused_with_the_fix():
    with pytest.raises(ConfigError, match="did you mean precision='bf16-true'"):
        propose(H200, precision="bf16-ture", compile="off", measure=True, compile_supported=supported)
    with pytest.raises(ConfigError, match="hint: use precision='fp16-true'"):
        propose(V100, precision="bf16-true", compile="off", measure=True, compile_supported=supported)


def test_fp16_asked_for_on_a_cpu_is_not_explained_by_training_terms():
    """Inference has no gradients: the training rule's note about loss scaling does not belong in its Plan."""
    proposal = propose(AVX2, precision="fp16-mixed", compile="off", measure=True, compile_supported=supported)
    assert proposal.precision.value == "fp16-mixed" and proposal.precision.reason == "requested"


def test_compile_on_where_it_cannot_run_falls_back_to_eager_with_the_reason():
    proposal = propose(H200, precision="fp32", compile="on", measure=True, compile_supported=unsupported)
    assert proposal.compile.value is False and "triton is not installed" in proposal.compile.reason


def test_measure_off_plans_by_the_rules():
    proposal = propose(H200, precision="auto", compile="auto", measure=False, compile_supported=supported)
    assert labels(proposal) == ["bf16-mixed"]
    assert proposal.precision.value == "bf16-mixed" and "auto" in proposal.precision.reason
    assert proposal.compile.value is False and "not measured" in proposal.compile.reason


def test_read_measure_takes_auto_and_off_and_refuses_the_rest():
    assert read_measure("auto") is True and read_measure(True) is True
    assert read_measure("off") is False and read_measure(False) is False
    with pytest.raises(ConfigError, match="measure='sometimes'"):
        read_measure("sometimes")


def test_bf16_on_a_gpu_without_it_is_refused_with_the_fix():
    with pytest.raises(ConfigError, match="fp16-mixed"):
        propose(V100, precision="bf16-mixed", compile="off", measure=True, compile_supported=supported)


def test_cuda_graphs_are_on_for_cuda_and_off_elsewhere_and_on_without_cuda_is_an_error():
    assert resolve_cuda_graphs("auto", H200).value is True
    off = resolve_cuda_graphs("auto", AMX)
    assert off.value is False and "cpu" in off.reason
    assert resolve_cuda_graphs("off", H200).value is False
    with pytest.raises(ConfigError, match=r"cuda_graphs='on'.*cpu") as caught:
        resolve_cuda_graphs("on", AMX)
    assert "hint:" in str(caught.value)
    with pytest.raises(ConfigError, match="cuda_graphs"):
        resolve_cuda_graphs("yes", H200)


def timed(setting, ms, error=0.0, failed=""):
    return Timing(setting, tuple(ms / 1e3 for _ in range(5)), error, failed)


CPU_PROPOSAL = propose(AMX, precision="auto", compile="auto", measure=True, compile_supported=supported)


def test_a_candidate_faster_by_the_margin_and_accurate_is_kept_with_its_numbers():
    chosen = choose(CPU_PROPOSAL, [timed(FP32, 1.31), timed(BF16, 1.0, error=0.01)], bucket=32)
    precision, compiled, measured = chosen["precision"], chosen["compile"], chosen["measured"]
    assert precision.value == "bf16-mixed"
    assert "1.31x fp32" in precision.reason and "largest bucket (32)" in precision.reason
    assert "median of 5" in precision.reason
    assert compiled == CPU_PROPOSAL.compile, "an axis that was not timed keeps the rule's choice"
    assert "bf16-mixed 1.31x" in measured.reason and "1.31 ms" in measured.reason


def test_a_candidate_faster_by_less_than_the_margin_leaves_fp32():
    slightly = 1.0 * MARGIN * 0.99
    precision = choose(CPU_PROPOSAL, [timed(FP32, slightly), timed(BF16, 1.0)], bucket=8)["precision"]
    assert precision.value == "fp32" and "(a candidate must run 5% faster, within tolerance)" in precision.reason


def test_a_fast_candidate_whose_outputs_depart_is_rejected_with_the_departure():
    chosen = choose(CPU_PROPOSAL, [timed(FP32, 3.0), timed(BF16, 1.0, error=TOLERANCE * 2)], bucket=8)
    precision, measured = chosen["precision"], chosen["measured"]
    assert precision.value == "fp32"
    assert "10.0% off fp32's (tolerance 5%)" in measured.reason


def test_a_candidate_with_non_finite_outputs_or_that_failed_is_rejected():
    nan = choose(CPU_PROPOSAL, [timed(FP32, 3.0), timed(BF16, 1.0, error=float("nan"))], bucket=8)
    assert nan["precision"].value == "fp32" and "non-finite" in nan["measured"].reason
    failed = choose(
        CPU_PROPOSAL, [timed(FP32, 3.0), Timing(BF16, failed="it failed: RuntimeError: no kernel")], bucket=8
    )
    assert failed["precision"].value == "fp32" and "no kernel" in failed["measured"].reason


def test_the_fastest_accepted_setting_sets_both_timed_axes():
    proposal = propose(H200, precision="auto", compile="auto", measure=True, compile_supported=supported)
    timings = [
        timed(FP32, 2.0),
        timed(Setting("fp32", True), 1.5),
        timed(Setting("bf16-mixed", False), 1.9),
        timed(Setting("bf16-mixed", True), 0.5, error=0.5),  # fastest, but wrong
    ]
    chosen = choose(proposal, timings, bucket=32)
    assert (chosen["precision"].value, chosen["compile"].value) == ("fp32", True)
    assert "fp32+compile ran 1.33x fp32" in chosen["compile"].reason
    assert chosen["channels_last"] == proposal.channels_last, "an axis that was not timed keeps the rule's choice"


def test_a_candidate_that_loses_on_the_smallest_bucket_is_not_kept_and_the_reason_says_so():
    large = [timed(FP32, 2.0), timed(BF16, 1.0)]
    slow_alone = choose(CPU_PROPOSAL, large, bucket=32, small=(1, [timed(FP32, 0.1), timed(BF16, 0.4)]))
    assert slow_alone["precision"].value == "fp32"
    assert (
        "fp32 kept (a candidate must run 5% faster at 32 and lose no more than 5% at 1, within tolerance): "
        "bf16-mixed 2.00x (0.25x at 1), on the largest bucket (32)"
    ) in slow_alone["precision"].reason
    assert "on the largest bucket (32) and the smallest (1)" in slow_alone["measured"].reason
    just_inside = choose(CPU_PROPOSAL, large, bucket=32, small=(1, [timed(FP32, 0.1), timed(BF16, 0.1 * MARGIN)]))
    assert (
        just_inside["precision"].value == "bf16-mixed"
        and "ran 2.00x fp32 (0.95x at 1)" in just_inside["precision"].reason
    )
    failed = choose(CPU_PROPOSAL, large, bucket=32, small=(1, [timed(FP32, 0.1), Timing(BF16, failed="it failed: x")]))
    assert failed["precision"].value == "fp32" and "bf16-mixed rejected: it failed: x" in failed["measured"].reason


def test_the_median_block_is_compared_so_one_slow_block_does_not_decide():
    noisy = Timing(BF16, (0.001, 0.001, 0.001, 0.001, 0.100))
    assert choose(CPU_PROPOSAL, [timed(FP32, 2.0), noisy], bucket=8)["precision"].value == "bf16-mixed"


def test_a_setting_laid_out_and_cast_otherwise_sets_precision_and_layout_together():
    proposal = propose(AMX, precision="auto", compile="auto", measure=True, compile_supported=supported,
                       convolutional=True)  # fmt: skip
    fast = Setting("bf16-true", False, True)
    timings = [timed(s, 1.0 if s == fast else 2.0) for s in [proposal.reference, *proposal.candidates]]
    chosen = choose(proposal, timings, bucket=32)
    assert (chosen["precision"].value, chosen["channels_last"].value) == ("bf16-true", True)
    assert "bf16-true+channels_last ran 2.00x fp32" in chosen["channels_last"].reason
    assert chosen["compile"] == proposal.compile and chosen["measured"].value == "6 settings"


def test_candidates_tied_on_full_batches_are_told_apart_by_single_requests():
    """Within the margin on the largest bucket the timing cannot rank them: the smallest bucket decides."""
    proposal = propose(AMX, precision="auto", compile="auto", measure=True, compile_supported=supported,
                       convolutional=True)  # fmt: skip
    mixed, true = Setting("bf16-mixed", False, True), Setting("bf16-true", False, True)
    ms = {mixed: (1.00, 0.58), true: (1.02, 0.47)}  # as measured for a CNN: 3.87x and 3.82x fp32 at 32
    settings = [proposal.reference, *proposal.candidates]
    large = [timed(s, ms.get(s, (3.87, 1.0))[0]) for s in settings]
    small = [timed(s, ms.get(s, (3.87, 1.0))[1]) for s in settings]
    chosen = choose(proposal, large, bucket=32, small=(1, small))
    assert (chosen["precision"].value, chosen["channels_last"].value) == ("bf16-true", True)
    assert "bf16-true+channels_last ran 3.79x fp32 (2.13x at 1)" in chosen["precision"].reason
    apart = [timed(s, 0.9 if s == mixed else t.median_s * 1e3) for s, t in zip(settings, large, strict=True)]
    assert choose(proposal, apart, bucket=32, small=(1, small))["precision"].value == "bf16-mixed", (
        "one 10% faster on full batches is no tie: it wins"
    )


def test_timings_survive_the_cache_round_trip():
    timing = Timing(Setting("bf16-mixed", True), (0.1, 0.2), 0.01, "")
    assert Timing.from_dict(timing.to_dict()) == timing
    laid_out = Timing(Setting("bf16-true", False, True), (0.1,), 0.0, "")
    assert Timing.from_dict(laid_out.to_dict()) == laid_out
    failed = Timing(Setting("bf16-mixed", True), (), 0.0, "compile failed")
    assert Timing.from_dict(failed.to_dict()) == failed
    for edited in ([0.0], [float("inf")], [-0.1]):  # no block takes no time: an entry edited on disk, measured again
        with pytest.raises(ValueError, match="block_s"):
            Timing.from_dict({**timing.to_dict(), "block_s": edited})


@pytest.mark.parametrize(
    "message",
    [
        "CUDA error: an illegal memory access was encountered",
        "CUDA error: device-side assert triggered\nCompile with `TORCH_USE_CUDA_DSA`",
        "CUDA error: unspecified launch failure",
        "CUDA error: misaligned address",
        "CUDA error: an illegal instruction was encountered",
        "CUDA error: uncorrectable ECC error encountered",
        "Triton Error [CUDA]: an illegal memory access was encountered",
        "CUDA driver error: CUDA_ERROR_ILLEGAL_ADDRESS",
    ],
)
def test_sticky_cuda_errors_are_recognised(message):
    assert is_sticky_cuda_error(RuntimeError(message))


@pytest.mark.parametrize(
    "exc",
    [
        RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"),
        RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 5x2)"),
        ValueError("expected a tensor"),
        RuntimeError("CUDA error: invalid argument"),
    ],
)
def test_ordinary_errors_are_not_sticky(exc):
    assert not is_sticky_cuda_error(exc)


def test_a_sticky_error_wrapped_in_another_is_recognised():
    try:
        try:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        except RuntimeError as inner:
            raise ValueError("postprocessing failed") from inner
    except ValueError as outer:
        assert is_sticky_cuda_error(outer)


DIGITS_CL = Setting("fp32", False, True)
BF16_CL = Setting("bf16-true", False, True)


def conv_timings(ms):
    """The convolutional proposal's timings, ``ms`` per setting (3.0 ms for the ones not named)."""
    proposal = propose(AMX, precision="auto", compile="auto", measure=True, compile_supported=supported,
                       convolutional=True)  # fmt: skip
    return proposal, [timed(s, ms.get(s, 3.0)) for s in [proposal.reference, *proposal.candidates]]


def test_with_a_second_copy_allowed_each_end_keeps_its_own_fastest_setting():
    """As measured for digits on a Xeon with AMX: bf16 weights in channels_last 2.67x fp32 on 32, 0.48x on 1."""
    proposal, large = conv_timings({BF16_CL: 1.0, DIGITS_CL: 1.6})
    large[0] = timed(proposal.reference, 2.67)
    _, small = conv_timings({BF16_CL: 0.21, DIGITS_CL: 0.094})
    small[0] = timed(proposal.reference, 0.1)
    one = choose(proposal, large, bucket=32, small=(1, small))
    assert (one["precision"].value, one["channels_last"].value) == ("fp32", True), "one setting: no loss at 1"
    assert "small_batches" not in one
    two = choose(proposal, large, bucket=32, small=(1, small), split=True)
    assert (two["precision"].value, two["channels_last"].value) == ("bf16-true", True)
    assert two["small_batches"].value == DIGITS_CL
    assert (
        "measured: bf16-true+channels_last ran 2.67x fp32 on the largest bucket (32); smaller buckets run "
        "fp32+channels_last, 2.23x bf16-true+channels_last at 1"
    ) in two["precision"].reason


def test_no_split_where_one_setting_is_fastest_on_both_ends_or_the_gap_is_under_the_margin():
    proposal, large = conv_timings({BF16_CL: 1.0})
    _, small = conv_timings({BF16_CL: 1.0})
    chosen = choose(proposal, large, bucket=32, small=(1, small), split=True)
    assert chosen["precision"].value == "bf16-true" and chosen["small_batches"].value is None
    assert "one setting serves every bucket: no other runs 5% faster than it at 1" in chosen["small_batches"].reason
    _, close = conv_timings({BF16_CL: 1.0, DIGITS_CL: 1.0 / MARGIN * 1.01})
    nearly = choose(proposal, large, bucket=32, small=(1, close), split=True)
    assert nearly["small_batches"].value is None, "faster at 1 by less than the margin: no second copy"


def test_a_split_pairs_settings_compiled_alike_and_only_accurate_ones():
    proposal = propose(H200, precision="auto", compile="auto", measure=True, compile_supported=supported)
    order = [proposal.reference, *proposal.candidates]
    compiled_bf16, compiled_fp32, true = Setting("bf16-mixed", True), Setting("fp32", True), Setting("bf16-true", False)
    large = [timed(s, {compiled_bf16: 1.0}.get(s, 3.0)) for s in order]
    small = [timed(s, {compiled_bf16: 3.0, true: 0.5, compiled_fp32: 0.8}.get(s, 1.0)) for s in order]
    chosen = choose(proposal, large, bucket=32, small=(1, small), split=True)
    assert chosen["compile"].value is True and chosen["precision"].value == "bf16-mixed"
    assert chosen["small_batches"].value == compiled_fp32, "bf16-true ran faster at 1, but eagerly: not paired"
    large = [timed(s, {true: 1.0}.get(s, 3.0)) for s in order]
    small = [timed(s, {true: 3.0, BF16: 0.5}.get(s, 1.0), error=0.5 if s == BF16 else 0.0) for s in order]
    accurate = choose(proposal, large, bucket=32, small=(1, small), split=True)
    assert accurate["precision"].value == "bf16-true"
    assert accurate["small_batches"].value == FP32, "bf16-mixed ran fastest at 1, but 50% off: not kept"


def test_the_buckets_between_go_to_whichever_of_the_two_settings_ran_them_faster():
    timings = {
        1: [timed(BF16_CL, 0.21), timed(DIGITS_CL, 0.09), timed(FP32, 0.1)],
        2: [timed(BF16_CL, 0.30), timed(DIGITS_CL, 0.20)],
        4: [timed(BF16_CL, 0.40), timed(DIGITS_CL, 0.41)],
        32: [timed(BF16_CL, 1.0), timed(DIGITS_CL, 1.6), timed(FP32, 2.67)],
    }
    runs, choice = split_buckets(BF16_CL, DIGITS_CL, timings)
    assert runs == {1, 2} and choice.value == "fp32+channels_last at 1, 2"
    assert "batches of 1, 2 run fp32+channels_last on a second copy of the model, the rest bf16-true+channels_last" in (
        choice.reason
    )
    assert "2.33x at 1, 1.50x at 2, 0.98x at 4, 0.62x at 32" in choice.reason
    failed = {**timings, 2: [timed(BF16_CL, 0.30), Timing(DIGITS_CL, failed="it failed: x")]}
    assert split_buckets(BF16_CL, DIGITS_CL, failed)[0] == {1}, "a setting that failed on a bucket does not run it"


def test_the_buckets_split_off_are_the_smallest_with_no_gap_where_the_gains_summed_are_greatest():
    timings = {b: [timed(BF16_CL, 1.0), timed(DIGITS_CL, 1.0 / x)] for b, x in
               {1: 1.2, 2: 1.1, 4: 1.04, 8: 0.97, 16: 1.01, 32: 0.8}.items()}  # fmt: skip
    assert split_buckets(BF16_CL, DIGITS_CL, timings)[0] == {1, 2, 4}, "16's 1.01x is noise past 8's 0.97x"
    timings[8] = [timed(BF16_CL, 1.0), timed(DIGITS_CL, 1.0 / 0.995)]
    assert split_buckets(BF16_CL, DIGITS_CL, timings)[0] == {1, 2, 4, 8, 16}, "16 gains more than 8 loses"
    timings[2] = [Timing(BF16_CL, failed="it failed: x"), timed(DIGITS_CL, 1.0)]
    assert split_buckets(BF16_CL, DIGITS_CL, timings)[0] == {1, 2, 4, 8, 16}, "a bucket only small ran is small's"


def test_a_second_copy_is_held_only_within_a_tenth_of_the_devices_memory():
    assert no_room_for_copy(100 * 2**20, 2 * 2**30, "cuda") == ""
    told = no_room_for_copy(300 * 2**20, 2 * 2**30, "cuda")
    assert "a second copy of the weights (300 MiB), over 10% of the cuda's 2 GiB" in told


def test_a_split_never_runs_small_batches_slower_than_the_reference():
    """A compiled winner pairs with compiled settings only: where none beats eager fp32 on one sample, no split."""
    proposal = propose(H200, precision="auto", compile="auto", measure=True, compile_supported=supported)
    order = [proposal.reference, *proposal.candidates]
    compiled_fp32, compiled_bf16 = Setting("fp32", True), Setting("bf16-mixed", True)
    large = [timed(s, {FP32: 2.0, compiled_fp32: 1.0, compiled_bf16: 1.3}.get(s, 3.0)) for s in order]
    small = [timed(s, {FP32: 1.0, compiled_fp32: 3.0, compiled_bf16: 2.5}.get(s, 3.0)) for s in order]
    chosen = choose(proposal, large, bucket=32, small=(1, small), split=True)
    assert chosen["small_batches"].value is None
    assert chosen == {**choose(proposal, large, bucket=32, small=(1, small)), "small_batches": chosen["small_batches"]}


def test_a_split_takes_no_setting_within_the_margin_of_the_reference_on_its_bucket():
    order = [CPU_PROPOSAL.reference, *CPU_PROPOSAL.candidates]
    true = Setting("bf16-true", False)
    large = [timed(s, {FP32: 1.0, true: 0.98, BF16: 1.04}.get(s, 3.0)) for s in order]
    small = [timed(s, {FP32: 1.0, true: 2.0, BF16: 0.9}.get(s, 3.0)) for s in order]
    chosen = choose(CPU_PROPOSAL, large, bucket=32, small=(1, small), split=True)
    assert chosen["precision"].value == "fp32" and chosen["small_batches"].value is None, (
        "bf16-true's 1.02x at 32 is noise: fp32 stays, with no second copy"
    )
