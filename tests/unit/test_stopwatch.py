"""A run's steps timed from their first training forward to their optimizer step, on a fake clock."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn

from redline.runtime.stopwatch import StepTimer, Stopwatch


def timer_on(now: list[float]) -> StepTimer:
    return StepTimer(Stopwatch(clock=lambda: now[0]))


def test_a_step_is_timed_from_its_first_training_forward_and_what_came_before_is_left_out():
    now, net, x = [0.0], nn.Linear(2, 2), torch.randn(3, 2)
    timer = timer_on(now)
    timer.watch(net)
    timer.stepped()  # the step before: where a step without a watched forward would be timed from
    now[0] += 5.0  # the loop's own work: an evaluation, the loader
    net(x)
    now[0] += 0.25
    net(x)  # a second forward in the step (a micro-batch) does not begin it again
    now[0] += 0.25
    timer.stepped()
    assert timer.block() == pytest.approx(0.5)
    assert timer.block() == 0.0  # nothing ended since


@pytest.mark.parametrize("evaluation", ["eval", "no_grad"])
def test_an_evaluation_begins_no_step(evaluation):
    now, net, x = [0.0], nn.Linear(2, 2), torch.randn(3, 2)
    timer = timer_on(now)
    timer.watch(net)
    timer.stepped()
    net.train(evaluation != "eval")
    with torch.set_grad_enabled(evaluation != "no_grad"):
        net(x)
    now[0] += 3.0
    net.train()
    net(x)
    now[0] += 1.0
    timer.stepped()
    assert timer.block() == pytest.approx(1.0)


def test_a_step_trained_in_eval_mode_is_timed_from_its_forward_with_autograd():
    # frozen BatchNorm and dropout (model.eval() while training): its steps were timed from the step before,
    # the loop's work between steps included
    now, net, x = [0.0], nn.Linear(2, 2).eval(), torch.randn(3, 2)
    timer = timer_on(now)
    timer.watch(net)
    timer.stepped()
    now[0] += 5.0  # the loader's next batch
    net(x)
    now[0] += 0.5
    timer.stepped()
    assert timer.block() == pytest.approx(0.5)


def test_a_step_no_watched_model_ran_is_timed_from_the_step_before():
    now = [0.0]
    timer = timer_on(now)
    timer.stepped()  # the first step: no step before it to time from, so no span
    now[0] += 2.0
    timer.stepped()
    now[0] += 3.0
    timer.stepped()
    assert timer.block() == pytest.approx(5.0)


def test_a_model_let_go_or_copied_keeps_no_hook_of_the_timer():
    now, net, x = [0.0], nn.Linear(2, 2), torch.randn(3, 2)
    timer = timer_on(now)
    timer.watch(net)
    timer.watch(net)  # set up again: watched once
    assert len(net._forward_pre_hooks) == 1
    copied = copy.deepcopy(net)
    pickle.loads(pickle.dumps(net))(x)  # a pickle of it runs, holding no timer
    timer.stepped()
    now[0] += 4.0
    copied(x)  # the copy begins no step of the run's
    now[0] += 1.0
    timer.stepped()
    assert timer.block() == pytest.approx(5.0)
    timer.unwatch()
    assert not net._forward_pre_hooks
