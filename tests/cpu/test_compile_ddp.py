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


def one_rank(script: str, tmp_path) -> str:
    """Run ``script`` as the one rank of a gloo group that meets in ``tmp_path``; return what it printed."""
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script), str(tmp_path / "rendezvous")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_a_ddp_wrapped_torch_nn_model_compiles_its_own_forward_and_a_users_class_the_wrapper(tmp_path):
    # torch.compile skips DDP's own frames and then torch.nn's: a 2-process run of an nn.Sequential "compiled 2
    # time(s) in 0.3 s" and ran eagerly, while the Plan said compiled.
    lines = one_rank(SCRIPT, tmp_path).split("\n")
    assert "sequential True compiled inner" in lines
    assert "own True compiled wrapper" in lines  # the wrapper compiled: torch splits its graph at DDP's buckets


AGAIN = """
import functools, os, sys
import torch
import torch.distributed as dist
from torch import nn

torch.compile = functools.partial(torch.compile, backend="aot_eager")
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
dist.init_process_group("gloo", init_method=f"file://{sys.argv[1]}", rank=0, world_size=1)
import redline

rt = redline.Runtime(redline.RuntimeOptions(strategy="ddp", devices="cpu", compile="on", precision="fp32"))
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
model, optimizer = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
x, y = torch.randn(4, 8), torch.randint(0, 2, (4,))
for phase in range(2):
    for _ in range(2):
        with rt.autocast():
            loss = nn.functional.cross_entropy(model(x), y)
        rt.backward(loss)
        rt.step(optimizer)
    print("phase", phase, type(model).__name__, type(model.module).__name__, rt.compiles[0])
    model, optimizer = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.01))  # a second phase
dist.destroy_process_group()
"""


def test_a_ddp_model_set_up_again_for_a_second_phase_keeps_its_one_wrapper_and_compile(tmp_path):
    # The returned DDP model, set up again with a new optimizer (as the README allows), was wrapped in a second
    # DDP: its first backward failed ("parameter gradient is not the expected DDP bucket view").
    said = one_rank(AGAIN, tmp_path)
    assert "phase 0 DistributedDataParallel Sequential 1" in said
    assert "phase 1 DistributedDataParallel Sequential 1" in said  # one compile, not a second
