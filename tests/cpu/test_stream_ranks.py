"""A stream that yields each rank its own share (``splits_across_ranks = True``) is read whole by every rank.

The Trainer split such a stream a second time: each rank kept half of its own share, so half the training and
validation data was never seen, without a word.
"""

import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from rank_stream_task import RankShare

from redline.train.data import eval_loader, plan_length, train_loader

TASK = Path(__file__).with_name("rank_stream_task.py")


def firsts(loader) -> list[list[int]]:
    return [[int(v) for v in x[:, 0].tolist()] for x, _ in loader]


def test_the_trainer_reads_each_ranks_own_share_whole_in_batches_of_its_share_of_the_global_batch():
    read = [firsts(train_loader(RankShare(0, 40, world=2, rank=r), batch_size=10, seed=0, rank=r, world_size=2)[0])
            for r in (0, 1)]  # fmt: skip
    assert read[0] == [[0, 2, 4, 6, 8], [10, 12, 14, 16, 18], [20, 22, 24, 26, 28], [30, 32, 34, 36, 38]]
    assert read[1] == [[i + 1 for i in batch] for batch in read[0]]


def test_a_resumed_rank_skips_its_own_share_of_what_the_job_read():
    loader, stream = train_loader(RankShare(0, 40, world=2, rank=1), batch_size=10, seed=0, rank=1, world_size=2)
    stream.set_epoch(0, skip=20)  # two global batches of 10 read: five items of each rank's share each
    assert firsts(loader) == [[21, 23, 25, 27, 29], [31, 33, 35, 37, 39]]


def test_a_partial_last_batch_of_each_share_is_kept_and_dropped_with_drop_last():
    def read(drop_last: bool) -> list[list[int]]:
        data = RankShare(0, 24, world=2, rank=0)  # 12 a rank: two batches of 5, and 2 left
        return firsts(train_loader(data, batch_size=10, seed=0, world_size=2, drop_last=drop_last)[0])

    assert read(False)[-1] == [20, 22] and read(True)[-1] == [10, 12, 14, 16, 18]


def test_an_epoch_is_planned_by_the_job_s_items_where_len_states_a_rank_s_share():
    share = RankShare(0, 24, world=2, rank=0)
    assert plan_length(share, batch_size=10, world_size=2, grad_accum=1, max_epochs=1, max_steps=None) == (3, 3)
    one = RankShare(0, 24, world=1, rank=0)
    assert plan_length(one, batch_size=10, world_size=1, grad_accum=1, max_epochs=1, max_steps=None) == (3, 3)


def test_evaluation_reads_each_ranks_own_share_so_every_sample_counts_once():
    read = [firsts(eval_loader(RankShare(1000, 20, world=2, rank=r), batch_size=10, rank=r, world_size=2))
            for r in (0, 1)]  # fmt: skip
    assert sorted(i for rank in read for batch in rank for i in batch) == list(range(1000, 1020))


@pytest.mark.slow
def test_two_launched_ranks_train_and_evaluate_on_every_item_of_the_stream_once(tmp_path):
    spec = f"{TASK}:task"
    args = ["train", "--task", spec, "--task-arg", f"log={tmp_path}", "--out", str(tmp_path / "out"), "--trial", "off",
            "--no-progress"]  # fmt: skip
    ran = subprocess.run([sys.executable, "-m", "redline", *args, "--nproc", "2", "--max-steps", "4"],
                         capture_output=True, text=True, timeout=240)  # fmt: skip
    assert ran.returncode == 0, ran.stderr[-3000:]
    # the checkpoint counts the job's items (each rank's share, times the ranks): one process resumes it, its stream
    # the whole (it was refused as another training set, of 20 samples against 40)
    again = subprocess.run([sys.executable, "-m", "redline", *args, "--max-steps", "5", "--resume", "auto"],
                           capture_output=True, text=True, timeout=240)  # fmt: skip
    assert again.returncode == 0, again.stderr[-3000:]

    def items(kind: str) -> Counter[int]:
        text = "".join((tmp_path / f"{kind}-{rank}.txt").read_text() for rank in (0, 1))
        return Counter(int(i) for i in text.split())

    assert items("train") - Counter(range(10)) == Counter(range(40))  # 4 steps of 10: every item once; then 1 more
    evaluated = items("eval")  # a stream's first batch is not checked after step 1: every item as often
    passes = evaluated[1000]
    assert passes >= 1 and evaluated == Counter({i: passes for i in range(1000, 1020)})
