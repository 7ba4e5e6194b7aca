"""The CPU's facts: how the probe classifies a CPU."""

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


def test_probe_reads_this_machine_without_failing():
    assert probe_cpu_isa() in CPU_ISAS
    assert probe_device(torch.device("cpu")).cpu_isa == probe_cpu_isa()


def test_device_facts_refuse_an_unknown_isa():
    with pytest.raises(ConfigError, match=r"cpu_isa='sse'.*'amx', 'avx512_bf16'"):
        DeviceFacts(type="cpu", name="old", cpu_isa="sse")
