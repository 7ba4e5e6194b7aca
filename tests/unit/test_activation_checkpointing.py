"""The activation-checkpointing axis: what each request resolves to and why, the option, and a resumed run."""

import pytest

from redline.errors import ConfigError
from redline.plan.checkpointing import resolve_activation_checkpointing
from redline.runtime.options import RuntimeOptions

COST = "(about one more forward of compute)"


@pytest.mark.parametrize("requested", ["on", True])
def test_on_recomputes_every_block_and_says_what_it_costs(requested):
    chosen = resolve_activation_checkpointing(requested, blocks=12)
    assert chosen.value is True
    assert chosen.reason == f"requested: 12 blocks recompute their activations in backward {COST}"
    one = resolve_activation_checkpointing(requested, blocks=1)
    assert one.reason == f"requested: 1 block recomputes its activations in backward {COST}"


def test_on_without_repeated_blocks_names_the_problem_and_the_fix():
    with pytest.raises(ConfigError) as info:
        resolve_activation_checkpointing("on", blocks=0)
    message = str(info.value)
    assert message.startswith("activation_checkpointing='on' needs repeated blocks")
    assert "this model has none\nhint: wrap" in message
    assert "torch.utils.checkpoint.checkpoint(fn, x, use_reentrant=False)" in message


@pytest.mark.parametrize("requested", ["off", False])
def test_off_keeps_every_activation_even_when_memory_runs_short(requested):
    for short in (False, True):
        chosen = resolve_activation_checkpointing(requested, blocks=4, short_of_memory=short)
        assert (chosen.value, chosen.reason) == (False, "requested: every activation is kept for the backward")


def test_auto_is_off_until_memory_runs_short():
    idle = resolve_activation_checkpointing("auto", blocks=6)
    assert idle.value is False
    assert idle.reason == f"auto: off while memory suffices; recomputing would cost {COST[1:-1]}"
    short = resolve_activation_checkpointing("auto", blocks=6, short_of_memory=True)
    assert short.value is True
    assert short.reason == f"auto: memory runs short, so 6 blocks recompute their activations in backward {COST}"


def test_auto_without_blocks_stays_off_and_says_why():
    for short in (False, True):
        chosen = resolve_activation_checkpointing("auto", blocks=0, short_of_memory=short)
        assert (chosen.value, chosen.reason) == (False, "auto: the model has no repeated blocks to recompute")


def test_an_unknown_request_is_refused_with_what_is_allowed():
    with pytest.raises(
        ConfigError, match=r"activation_checkpointing='sometimes' is not allowed; expected one of 'auto', 'on', 'off'"
    ):
        resolve_activation_checkpointing("sometimes", blocks=2)


def test_the_option_takes_switch_words_and_booleans():
    assert RuntimeOptions().activation_checkpointing == "auto"
    assert RuntimeOptions(activation_checkpointing=True).activation_checkpointing == "on"
    assert RuntimeOptions(activation_checkpointing=False).activation_checkpointing == "off"
    with pytest.raises(ConfigError, match="activation_checkpointing='yes' is not allowed"):
        RuntimeOptions(activation_checkpointing="yes")


STORED = {
    "device": {"value": "cpu"}, "precision": {"value": "fp32"}, "compile": {"value": False},
    "channels_last": {"value": False}, "grad_accum": {"value": 1}, "clip_grad_norm": {"value": None},
}  # fmt: skip


@pytest.mark.parametrize(
    ("now", "stored", "resumed"),
    [
        ("auto", True, "on"),  # turned on when memory ran short: the resumed run starts with it on
        ("auto", False, "auto"),  # off as before, and still free to turn on
        ("auto", None, "auto"),  # a Plan written before the axis existed
        ("off", True, "off"),  # asked for now: results do not depend on it
        ("on", False, "on"),  # the run that ran out of memory, resumed with it on
    ],
)
def test_a_resumed_run_keeps_the_stored_choice_unless_asked_otherwise(now, stored, resumed):
    plan = dict(STORED)
    if stored is not None:
        plan["activation_checkpointing"] = {"value": stored, "reason": "from the first run"}
    options = RuntimeOptions(activation_checkpointing=now).with_plan(plan)
    assert options.activation_checkpointing == resumed
