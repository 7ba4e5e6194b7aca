"""Compile under DDP: a model whose forward is torch.nn's own (an nn.Sequential) is compiled, not left eager."""

import subprocess
import sys
import textwrap

SCRIPT = """
import functools, sys
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

torch.compile = functools.partial(torch.compile, backend="aot_eager")  # the graphs as traced: no inductor to wait for
from redline.hardware.device import probe_device
from redline.runtime.compile import compile_planned
from redline.runtime.options import RuntimeOptions

dist.init_process_group("gloo", init_method=f"file://{sys.argv[1]}", rank=0, world_size=1)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 2)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


for name, inner in (("sequential", nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))), ("own", Net())):
    model, records = DistributedDataParallel(inner), []
    planned = compile_planned(model, RuntimeOptions(compile="on"), probe_device(torch.device("cpu")),
                              planned_steps=None, records=records)
    out = model(torch.randn(4, 8))
    nodes = [out.grad_fn, *(n for n, _ in out.grad_fn.next_functions if n is not None)]
    ran = "compiled" if any(n.name().startswith("CompiledFunction") for n in nodes) else "eager"
    print(name, planned.value, ran, "inner" if records[0].module is inner else "wrapper")
    out.sum().backward()  # DDP's gradient hooks still reduce: one rank, but the hooks run
dist.destroy_process_group()
"""


def test_a_ddp_wrapped_torch_nn_model_compiles_its_own_forward_and_a_users_class_the_wrapper(tmp_path):
    # torch.compile skips DDP's own frames and then torch.nn's: a 2-process run of an nn.Sequential "compiled 2
    # time(s) in 0.3 s" and ran eagerly, while the Plan said compiled.
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(SCRIPT), str(tmp_path / "rendezvous")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.split("\n")
    assert "sequential True compiled inner" in lines
    assert "own True compiled wrapper" in lines  # the wrapper compiled: torch splits its graph at DDP's buckets
