"""The collectives' single-process behaviour and the pure parts of the stop vote."""

import pytest
import torch

from redline.errors import TrainingError
from redline.parallel import collectives
from redline.parallel.collectives import StopVote, is_collective_failure, vote_interval


def test_a_broken_collective_is_told_from_a_bad_batch():
    gloo = RuntimeError("[third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1")
    assert is_collective_failure(gloo) and is_collective_failure(torch.distributed.DistBackendError("NCCL error"))
    assert not is_collective_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied (8x10 and 12x24)"))


def test_the_stop_vote_is_paced_to_about_every_fifth_of_a_second():
    assert vote_interval(0.002) == 100 and vote_interval(0.5) == 1 and vote_interval(1e-7) == 1000
    assert vote_interval(0.0) == 1 and vote_interval(float("nan")) == 1  # no step time yet: every step
    alone = StopVote()  # one process: no group, the vote is the signal itself, at once
    assert alone.vote(True, step=3) == (True, False) and alone.vote(False, step=4) == (False, False)
    assert alone.vote(False, step=5, checkpoint=True) == (False, True)  # its own clock, at once


def test_tensors_go_into_buckets_of_one_dtype_in_order(monkeypatch):
    monkeypatch.setattr(collectives, "BUCKET_BYTES", 64)
    a, b, c, d = torch.zeros(8), torch.zeros(8), torch.zeros(2, dtype=torch.float64), torch.zeros(20)
    buckets = collectives._buckets([a, b, c, d])  # 32 + 32 bytes fill one; a new dtype starts one; so does a big one
    assert [[t.shape for t in bucket] for bucket in buckets] == [[(8,), (8,)], [(2,)], [(20,)]]
    assert collectives.all_reduce_max(3, torch.device("cpu")) == 3  # one process: the value itself
    collectives.average_tensors([a])  # nothing to average with
    assert torch.equal(a, torch.zeros(8))


GLOO = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
    "[127.0.0.1]:9402. This is typically caused by a remote worker crashing. Check the logs of the remote worker."
)


def test_a_broken_collective_is_said_in_its_first_sentence_without_the_source_line():
    assert collectives.failed_collective(RuntimeError(GLOO)) == "Connection closed by peer [127.0.0.1]:9402"
    nccl = torch.distributed.DistBackendError("NCCL communicator was aborted on rank 0\nmore")
    assert collectives.failed_collective(nccl) == "NCCL communicator was aborted on rank 0"


def test_peers_said_names_what_the_ranks_did_together_and_lets_other_errors_pass():
    with pytest.raises(TrainingError) as said, collectives.peers_said("rt.backward", "call it on every rank"):
        raise RuntimeError(GLOO)
    assert str(said.value) == (
        "rt.backward: a collective with the other ranks failed: Connection closed by peer [127.0.0.1]:9402\n"
        "hint: call it on every rank"
    )
    with pytest.raises(ValueError, match="a bad batch"), collectives.peers_said("rt.backward", "unused"):
        raise ValueError("a bad batch")
