"""Device facts as data: the machines the resolver tests feed in."""

from redline.hardware.device import Accelerators, DeviceFacts

H100 = DeviceFacts(type="cuda", name="NVIDIA H100 80GB HBM3", index=0, capability=(9, 0), mem_gib=79.1, cpu_count=26)
A100 = DeviceFacts(type="cuda", name="NVIDIA A100-SXM4-40GB", index=0, capability=(8, 0), mem_gib=39.4, cpu_count=16)
V100 = DeviceFacts(type="cuda", name="Tesla V100-SXM2-16GB", index=0, capability=(7, 0), mem_gib=15.8, cpu_count=8)
T4 = DeviceFacts(type="cuda", name="Tesla T4", index=0, capability=(7, 5), mem_gib=14.6, cpu_count=4)
P100 = DeviceFacts(type="cuda", name="Tesla P100-PCIE-16GB", index=0, capability=(6, 0), mem_gib=15.9, cpu_count=4)
CPU_AVX2 = DeviceFacts(type="cpu", name="AMD EPYC 7B12", cpu_count=2, cpu_isa="avx2")
CPU_AVX512 = DeviceFacts(type="cpu", name="Intel Xeon Gold 6248", cpu_count=40, cpu_isa="avx512")
CPU_AVX512_BF16 = DeviceFacts(type="cpu", name="AMD EPYC 9654", cpu_count=96, cpu_isa="avx512_bf16")
CPU_AMX = DeviceFacts(type="cpu", name="Intel Xeon Platinum 8480+", cpu_count=56, cpu_isa="amx")
CPU_ARM = DeviceFacts(type="cpu", name="Neoverse-V1", cpu_count=64, cpu_isa="arm")
CPU = CPU_AVX2  # the CPU a resolver test means when the instruction set does not matter
# Every CPU redline tells apart, by the REDLINE_CPU value that fakes it.
CPUS = {"avx2": CPU_AVX2, "avx512": CPU_AVX512, "avx512_bf16": CPU_AVX512_BF16, "amx": CPU_AMX, "arm": CPU_ARM}
MPS = DeviceFacts(type="mps", name="Apple MPS", cpu_count=10)

NO_ACCELERATOR = Accelerators()
ONE_GPU = Accelerators(cuda_count=1)
EIGHT_GPUS = Accelerators(cuda_count=8)
MAC = Accelerators(mps=True)


# Python source that records every CUDA query a child process makes after it: prepend it to a probe
# script, which then reads the list `calls`.
CUDA_SPY = """
import json, sys
import torch
calls = []
def spy(name, real):
    def wrapped(*args, **kwargs):
        calls.append(name)
        return real(*args, **kwargs)
    return wrapped
for name in ("_lazy_init", "is_available", "device_count", "init"):
    setattr(torch.cuda, name, spy(name, getattr(torch.cuda, name)))
"""
