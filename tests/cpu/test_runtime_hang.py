"""`redline launch --hang-timeout` watches a loop of the user's own through the Runtime, not the Trainer's alone."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

LOOP = textwrap.dedent(
    """
    import sys, time
    import torch
    import torch._dynamo  # torch imports it at the first optimizer: seconds of 'start' on a loaded machine
    from torch import nn
    import redline

    with redline.Runtime(devices="cpu", compile="off") as rt:
        model, optimizer = rt.setup(nn.Linear(4, 2), lambda params: torch.optim.SGD(params, lr=0.1))
        rank = torch.distributed.get_rank()
        for step in range(1, 200):
            if rank == 1 and step == 4:
                time.sleep(120)  # a rank stuck in its own code: the other waits in the gradient all-reduce
            with rt.autocast():
                loss = model(torch.randn(8, 4)).pow(2).mean()
            rt.backward(loss)
            rt.step(optimizer)
    """
)


def test_a_stalled_rank_of_a_runtime_loop_is_named_by_the_hang_watchdog(tmp_path):
    script = tmp_path / "loop.py"
    script.write_text(LOOP)
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "redline", "launch", "--nproc", "2", "--hang-timeout", "5", str(script)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode != 0
    assert time.monotonic() - start < 60, "the watchdog ends the job within its timeout plus a few seconds"
    said = "error: hang: rank 1 stopped at step 4 in 'the loop between optimizer steps (data, forward, loss)'"
    assert said in result.stderr, result.stderr[-3000:]
