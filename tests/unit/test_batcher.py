"""The dynamic batching decision: wait from the first arrival, cap in samples, deadlines, never split a request."""

from hypothesis import given
from hypothesis import strategies as st

from redline.serve.batcher import Decision, Pending, decide

FAR = 1e9  # a deadline that never comes


def pending(samples=1, arrived=0.0, deadline=FAR):
    return Pending(samples=samples, arrived=arrived, deadline=deadline)


def test_an_empty_queue_waits_for_nothing():
    assert decide([], 5.0, max_batch_size=8, max_wait=0.005) == Decision()


def test_the_wait_is_counted_from_the_first_requests_arrival_not_from_now():
    queue = [pending(arrived=10.000), pending(arrived=10.003)]
    # Looked at 4 ms after the first arrival: 1 ms left, whoever dequeues it now.
    assert decide(queue, 10.004, max_batch_size=8, max_wait=0.005) == Decision(wait_until=10.005)
    # A request that arrived while the model was busy with the last batch has waited enough already.
    assert decide(queue, 10.020, max_batch_size=8, max_wait=0.005) == Decision(run=(0, 1))


def test_the_oldest_live_request_starts_the_clock_once_an_older_one_expired():
    queue = [pending(arrived=0.0, deadline=1.0), pending(arrived=0.998, deadline=5.0)]
    assert decide(queue, 1.0, max_batch_size=8, max_wait=0.005) == Decision(expired=(0,), wait_until=1.003)


def test_the_clock_starts_at_the_earliest_arrival_even_when_that_request_was_queued_second():
    # Arrival is taken before the body is read: a slow upload is queued after a request that came later.
    queue = [pending(arrived=1.000), pending(arrived=0.998)]
    assert decide(queue, 1.001, max_batch_size=8, max_wait=0.005) == Decision(wait_until=1.003)
    assert decide(queue, 1.003, max_batch_size=8, max_wait=0.005) == Decision(run=(0, 1))


def test_a_full_batch_runs_at_once_counted_in_samples():
    queue = [pending(samples=3), pending(samples=5)]
    assert decide(queue, 0.0, max_batch_size=8, max_wait=1.0) == Decision(run=(0, 1))
    # 3 + 5 samples do not fit in 6: the first runs alone now, without splitting the second.
    assert decide(queue, 0.0, max_batch_size=6, max_wait=1.0) == Decision(run=(0,))


def test_requests_fewer_than_the_cap_in_samples_wait_even_when_many():
    queue = [pending(samples=1) for _ in range(4)]
    assert decide(queue, 0.001, max_batch_size=8, max_wait=0.005).run == ()
    assert decide(queue, 0.001, max_batch_size=4, max_wait=0.005).run == (0, 1, 2, 3)


def test_requests_run_in_arrival_order_and_a_later_small_one_does_not_jump_a_large_one():
    queue = [pending(samples=4), pending(samples=6), pending(samples=1)]
    assert decide(queue, 0.0, max_batch_size=8, max_wait=1.0).run == (0,)


def test_expired_requests_are_dropped_and_never_run():
    queue = [pending(deadline=2.0), pending(deadline=9.0), pending(deadline=2.5)]
    decision = decide(queue, 3.0, max_batch_size=8, max_wait=0.005)
    assert decision.expired == (0, 2) and decision.run == (1,)
    assert decide([pending(deadline=1.0)], 1.0, max_batch_size=8, max_wait=0.005) == Decision(expired=(0,))


def test_a_batch_runs_early_rather_than_let_a_request_in_it_expire_while_waiting():
    queue = [pending(arrived=0.0, deadline=0.003)]
    assert decide(queue, 0.001, max_batch_size=8, max_wait=0.005).run == (0,)


def test_a_request_larger_than_the_cap_that_slipped_in_runs_alone_rather_than_block_the_queue():
    queue = [pending(samples=20), pending(samples=1)]
    assert decide(queue, 0.0, max_batch_size=8, max_wait=1.0).run == (0,)


queues = st.lists(st.tuples(st.integers(1, 8), st.floats(0, 1), st.floats(0, 2)), min_size=0, max_size=30).map(
    lambda rows: [Pending(samples=s, arrived=a, deadline=a + d) for s, a, d in sorted(rows, key=lambda r: r[1])]
)


@given(queues, st.floats(0, 3), st.integers(1, 16), st.floats(0, 0.5))
def test_every_decision_keeps_the_rules(queue, now, max_batch_size, max_wait):
    decision = decide(queue, now, max_batch_size=max_batch_size, max_wait=max_wait)
    live = [i for i, p in enumerate(queue) if p.deadline > now]
    assert set(decision.expired) == {i for i, p in enumerate(queue) if p.deadline <= now}
    assert not set(decision.run) & set(decision.expired)
    if decision.run:
        # The oldest live requests, in order, whole, within the cap (a single request always fits).
        assert decision.run == tuple(live[: len(decision.run)])
        assert len(decision.run) == 1 or sum(queue[i].samples for i in decision.run) <= max_batch_size
        assert decision.wait_until is None
        taken = sum(queue[i].samples for i in decision.run)
        next_fits = len(decision.run) < len(live) and taken + queue[live[len(decision.run)]].samples <= max_batch_size
        assert not next_fits, "a batch ran without the next request that still fitted"
    elif live:
        # Waiting: only before the first live request's wait is over, and with room left in the batch.
        assert decision.wait_until == queue[live[0]].arrived + max_wait > now
        assert sum(queue[i].samples for i in live) < max_batch_size
        assert all(queue[i].deadline > decision.wait_until for i in live)
    else:
        assert decision.wait_until is None
