"""Fixtures the CPU tier's tests share."""

import gc
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch.distributed as dist


@pytest.fixture
def one_rank_group(tmp_path: Path) -> Iterator[None]:
    """A gloo process group of one rank, for the wrapping and collectives of a distributed run in one process."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        gc.collect()  # FSDP modules sit in reference cycles; free them while gloo still runs
        dist.destroy_process_group()
