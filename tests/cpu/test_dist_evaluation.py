"""Evaluation under FSDP on 2 processes (CPU, gloo): the ranks' shards differ in length, BatchNorm's statistics
are rank 0's, and each rank evaluates in its share of the training batch."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

JOB = str(Path(__file__).with_name("eval_ranks_job.py"))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict]:
    out = tmp_path_factory.mktemp("eval-ranks")
    command = [sys.executable, "-m", "redline", "launch", "--nproc", "2", "--hang-timeout", "15", JOB, str(out)]
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=120
    )  # a hang: the watchdog reports it, and ends no wait
    assert result.returncode == 0, result.stderr[-3000:]
    return {rank: json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)}


def test_every_rank_runs_as_many_evaluation_forwards_on_shards_of_unequal_length(ranks):
    # 9 samples in batches of 4 a rank: rank 0's 4 are one batch, rank 1's 5 two; rank 0 pads once an evaluation
    counts = {rank: len(found["eval_sizes"]) for rank, found in ranks.items()}
    # the evaluations at steps 2 and 4 (the last), and evaluate(); and val_data's first batch after step 1
    assert counts[0] == counts[1] == 2 * 3 + 1
    # a rank with no sample at all (1 of them over 2 ranks) runs a forward with the other
    assert ranks[0]["one_sample_forwards"] == ranks[1]["one_sample_forwards"] == 1
    # a stream of 5 in batches of 2: rank 0's 3 samples are two batches, rank 1's 2 one, and rank 1 pads once
    assert ranks[0]["stream_forwards"] == ranks[1]["stream_forwards"] == 2


def test_padding_forwards_leave_the_metrics_those_of_rank_0s_whole_model_on_every_sample(ranks):
    reference = ranks[0]  # rank 0's weights and BatchNorm statistics, in one process
    for found in ranks.values():
        assert found["val_loss"] == pytest.approx(reference["reference"], abs=1e-6)
        assert found["summary_val_loss"] == pytest.approx(reference["reference"], abs=1e-6)
        assert found["one_sample_val_loss"] == pytest.approx(reference["first_reference"], abs=1e-6)
        assert found["stream_val_loss"] == pytest.approx(reference["first_5_reference"], abs=1e-6)


def test_each_rank_evaluates_in_batches_of_its_share_of_the_training_batch(ranks):
    for found in ranks.values():
        assert max(found["eval_sizes"]) == 4  # the global batch is 8: 4 a rank, as a training step holds


def test_a_sharded_checkpoint_keeps_rank_0s_batchnorm_statistics(ranks):
    bn = ranks[0]["bn"]
    assert bn["after"] == pytest.approx(bn["before"], abs=0)
    assert ranks[1]["bn"]["after"] == pytest.approx(bn["before"], abs=0)  # every rank holds rank 0's after the load
