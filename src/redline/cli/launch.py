"""`redline launch`: run a script on every GPU or machine through torch.distributed.run."""

from __future__ import annotations

from typing import Annotated

import typer

from redline.launch.torchrun import LaunchConfig, launch


def parse_nproc(text: str) -> int | str:
    """Read --nproc: 'auto' or a positive integer."""
    return "auto" if text == "auto" else int(text) if text.isdigit() else text


def launch_command(
    ctx: typer.Context,
    target: Annotated[str, typer.Argument(help="The script to run (or a module with --module).")],
    nproc: Annotated[str, typer.Option(help="Processes per machine: N or auto (every visible GPU, else 1).")] = "auto",
    nnodes: Annotated[int, typer.Option(help="Number of machines.")] = 1,
    node_rank: Annotated[int | None, typer.Option(help="This machine's rank, 0..nnodes-1.")] = None,
    master_addr: Annotated[str | None, typer.Option(help="Address of the node-rank 0 machine.")] = None,
    master_port: Annotated[int | None, typer.Option(help="A free port on the node-rank 0 machine.")] = None,
    rdzv_endpoint: Annotated[str | None, typer.Option(help="HOST:PORT of a c10d rendezvous (instead).")] = None,
    max_restarts: Annotated[int, typer.Option(help="Restart failed workers up to K times.")] = 0,
    hang_timeout: Annotated[float | None, typer.Option(help="Seconds without progress before a hang report.")] = None,
    module: Annotated[bool, typer.Option("--module", "-m", help="TARGET is a module: python -m TARGET.")] = False,
) -> None:
    """Run SCRIPT [ARGS...] on N processes (and N machines) with torch.distributed."""
    config = LaunchConfig(
        nproc=parse_nproc(nproc),
        nnodes=nnodes,
        node_rank=node_rank,
        master_addr=master_addr,
        master_port=master_port,
        rdzv_endpoint=rdzv_endpoint,
        max_restarts=max_restarts,
        hang_timeout_s=hang_timeout,
    )
    launch(config, [target, *ctx.args], module=module)
