"""The CPU's facts: how the probe classifies a CPU, and how REDLINE_CPU fakes one for planning."""

from pathlib import Path

import pytest
import torch

from redline.errors import ConfigError
from redline.hardware.device import CPU_ISAS, DeviceFacts, cpu_isa_of, probe_cpu_isa, probe_device


def flags(*names):
    return lambda flag: flag in names


@pytest.mark.parametrize(
    ("machine", "has", "expected"),
    [
        ("x86_64", flags("avx2"), "avx2"),
        ("x86_64", flags("avx2", "avx512f"), "avx512"),
        ("x86_64", flags("avx2", "avx512f", "avx512_bf16"), "avx512_bf16"),
        ("x86_64", flags("avx2", "avx512f", "avx512_bf16", "amx_tile"), "amx"),
        ("AMD64", flags("avx2", "avx512f"), "avx512"),  # Windows spells it so
        ("x86_64", flags("sse4_2"), "other"),
        ("aarch64", flags("avx2"), "arm"),  # an Arm flag list never names x86 features; the machine decides
        ("arm64", flags(), "arm"),  # macOS
        ("ppc64le", flags(), "other"),
    ],
)
def test_cpu_isa_of_names_the_best_instructions(machine, has, expected):
    assert cpu_isa_of(machine, has) == expected


def test_probe_reads_this_machine_without_failing(monkeypatch):
    monkeypatch.delenv("REDLINE_CPU", raising=False)
    isa, faked = probe_cpu_isa()
    assert isa in CPU_ISAS and faked is False
    facts = probe_device(torch.device("cpu"))
    assert facts.cpu_isa == isa and facts.cpu_isa_faked is False


@pytest.mark.parametrize("value", ["avx2", "avx512", "amx", "arm", " AMX "])
def test_redline_cpu_fakes_the_cpu_for_planning(monkeypatch, value):
    monkeypatch.delenv("REDLINE_CPU", raising=False)
    real = probe_device(torch.device("cpu"))
    monkeypatch.setenv("REDLINE_CPU", value)
    facts = probe_device(torch.device("cpu"))
    assert facts.cpu_isa == value.strip().lower() and facts.cpu_isa_faked is True
    assert facts.type == "cpu" and facts.name == real.name  # only the instruction set is faked


@pytest.mark.parametrize("value", ["avx3", "x86", "amx,avx2"])
def test_unknown_redline_cpu_names_the_allowed_values(monkeypatch, value):
    monkeypatch.setenv("REDLINE_CPU", value)
    with pytest.raises(ConfigError) as err:
        probe_cpu_isa()
    message = str(err.value)
    assert f"REDLINE_CPU={value!r}" in message
    assert "'amx', 'avx512_bf16', 'avx512', 'avx2', 'arm', 'other'" in message and "hint: unset REDLINE_CPU" in message


def test_empty_redline_cpu_is_unset(monkeypatch):
    monkeypatch.setenv("REDLINE_CPU", "")
    assert probe_cpu_isa()[1] is False


def test_device_facts_refuse_an_unknown_isa():
    with pytest.raises(ConfigError, match=r"cpu_isa='sse'.*'amx', 'avx512_bf16'"):
        DeviceFacts(type="cpu", name="old", cpu_isa="sse")


CHILD_TEST = """
import subprocess, sys

def test_child_plans_as_the_faked_cpu():
    code = "from redline.hardware.device import probe_cpu_isa; print(probe_cpu_isa())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "('arm', True)"
"""


def test_suite_option_fakes_the_cpu_for_the_processes_tests_start(pytester, monkeypatch):
    monkeypatch.delenv("REDLINE_CPU", raising=False)
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")  # the inner runs need none (3 s each to import)
    pytester.makeconftest((Path(__file__).parents[1] / "conftest.py").read_text())
    pytester.makepyfile(test_child=CHILD_TEST)
    faked = pytester.runpytest_subprocess("--redline-cpu", "arm", "-p", "no:cacheprovider")
    faked.assert_outcomes(passed=1)
    assert any("redline plans as CPU: arm (faked by REDLINE_CPU)" in line for line in faked.outlines)
    pytester.runpytest_subprocess("-p", "no:cacheprovider").assert_outcomes(failed=1)  # unfaked: the probe's CPU
