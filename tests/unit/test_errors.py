"""A refused choice's hint: the value a typo most likely meant."""

import pytest

from redline.config import one_of
from redline.errors import ConfigError, nearest


@pytest.mark.parametrize(
    ("typed", "meant"),
    [
        ("bf16", "bf16-mixed"),  # begins exactly one choice
        ("BF16", "bf16-mixed"),
        ("ddpp", "ddp"),  # close in spelling
        ("fsd", "fsdp"),
        ("poison", "poisson"),
        ("fp", "fp32"),  # begins two choices: the closer in spelling
        ("bf61", None),  # nothing close
        ("", None),
        (16, None),  # not text
    ],
)
def test_nearest_is_the_choice_a_typo_meant_or_none(typed, meant):
    choices = ("auto", "fp32", "bf16-mixed", "fp16-mixed", "single", "ddp", "fsdp", "uniform", "poisson")
    assert nearest(typed, choices) == meant


def test_one_of_hints_the_nearest_choice_else_an_example():
    with pytest.raises(ConfigError) as caught:
        one_of("precision", "bf16", ("auto", "fp32", "bf16-mixed"))
    assert str(caught.value) == (
        "precision='bf16' is not allowed; expected one of 'auto', 'fp32', 'bf16-mixed'\n"
        "hint: did you mean precision='bf16-mixed'?"
    )
    with pytest.raises(ConfigError, match=r"hint: e\.g\. compile='auto'$"):
        one_of("compile", "maybe", ("auto", "on", "off"))
    one_of("compile", "on", ("auto", "on", "off"))  # an allowed value passes


def test_one_of_says_a_list_of_allowed_values_is_one_too_many():
    with pytest.raises(ConfigError) as caught:
        one_of("precision", "fp32, bf16-mixed", ("auto", "fp32", "bf16-mixed"))
    assert str(caught.value).endswith(
        "hint: one value here, not a list: give 'fp32', then 'bf16-mixed' in another run"
        " (redline bench times several side by side)"
    )
    with pytest.raises(ConfigError) as caught:  # a list with a stranger in it gets the usual hint
        one_of("precision", "fp32,bf17", ("auto", "fp32", "bf16-mixed"))
    assert "not a list" not in str(caught.value)


def test_the_users_line_skips_code_python_made_such_as_a_dataclass_init():
    from redline.errors import user_line

    def build():
        exec("raise ValueError('bad field')")  # its frame is Python-made, as a dataclass's generated __init__ is

    try:
        build()
    except ValueError as exc:
        said = user_line(exc)
    assert "test_errors.py" in said and "in build" in said and "at <string>" not in said
