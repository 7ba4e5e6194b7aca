"""The asyncio side of batching: a bounded queue, and one worker that runs batches in the model's own thread.

    dispatcher = Dispatcher(engine, options, metrics)
    dispatcher.start()                          # warms the engine up (in the model thread), then serves
    outputs = await dispatcher.submit(batch, arrived=t)   # one JSON-ready value per sample
    await dispatcher.close()                    # after the last request: the worker and its thread end

The model runs off the event loop in one dedicated thread, the only thread that ever calls the
engine (inference_mode and autocast are entered there, per thread). The worker asks the pure
``decide`` what to run; each request's future gets its own outputs, a 504 once its deadline has
passed, or a 500 when the model raised on it (``model_error``; ``internal_error`` when redline's own
code did, its traceback logged): a failed batch of several requests is run again one request at
a time, so that only the request the model cannot take fails. The worker then goes on.
A full queue refuses at once with 503 and Retry-After: whatever was accepted is answered.
Stopped at once (``abandon``: a second Ctrl-C), it answers 503 to what is queued or running, and waits for none.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from queue import SimpleQueue
from typing import Any

import torch

from redline.errors import RedlineError, ServableError, describe_error, innermost, traceback_asked, user_line
from redline.runtime.contract import blames_user_code
from redline.serve.batcher import Pending, decide
from redline.serve.engine import WarmUpStopped
from redline.serve.metrics import ServeMetrics
from redline.serve.options import ServeOptions
from redline.serve.refused import Refused

log = logging.getLogger("redline")

RETRY_AFTER_S = 1  # what a client refused for a full queue is told to wait
CLOSE_POLL_S = 0.05  # how often a closing dispatcher looks whether every request was answered


class ModelThread:
    """The one thread that calls the engine. A daemon: a model call that never returns (a hung model, whose
    requests were all answered 504 by their deadlines) does not keep a stopped server's process alive, as a
    ``ThreadPoolExecutor``'s worker would (Python joins those at exit).

    A daemon still in a call when the interpreter shuts down is a hazard of its own: CPython (3.10 to 3.13)
    ends a daemon thread that retakes the GIL during shutdown by unwinding its stack, and torch's C++ frames
    cannot be unwound, so the process aborts ("terminate called without an active exception", -6) as soon as
    the model's next operation returns. ``Dispatcher.close`` therefore waits for an idle thread to end, and
    ``calls_left_running`` tells a process about to exit that one was left in a call.
    """

    def __init__(self) -> None:
        self._calls: SimpleQueue[tuple[Callable[..., Any], tuple[Any, ...], asyncio.Future[Any]] | None]
        self._calls = SimpleQueue()
        self.busy = False  # in a call: set and cleared by the thread itself
        self.stopped = False  # told to end: a dispatcher started again makes a new one
        self._thread = threading.Thread(target=self._serve, name=MODEL_THREAD_NAME, daemon=True)
        self._thread.start()

    async def run(self, function: Callable[..., Any], *args: Any) -> Any:
        """``function(*args)`` in the thread, awaited."""
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._calls.put((function, args, future))
        return await future

    def stop(self) -> None:
        """End the thread after the call it is running, if any (not waited for)."""
        self.stopped = True
        _STOPPED.add(self)
        self._calls.put(None)

    @property
    def alive(self) -> bool:
        """Whether the thread still runs (after ``stop``: in the call it was left in)."""
        return self._thread.is_alive()

    async def ended(self, within: float) -> bool:
        """Wait up to ``within`` seconds for the thread to end (after ``stop``); return whether it did."""
        deadline = time.monotonic() + within
        while self.alive and time.monotonic() < deadline:
            await asyncio.sleep(THREAD_POLL_S)
        return not self.alive

    def _serve(self) -> None:
        while (call := self._calls.get()) is not None:
            function, args, future = call
            self.busy = True
            try:
                outcome: tuple[Any, BaseException | None] = (function(*args), None)
            except (SystemExit, KeyboardInterrupt) as exc:  # the model's own (signals reach the main thread only):
                outcome = (None, _model_exit(exc))  # a model error the request is answered with, not the server's end
            except BaseException as exc:  # handed to the awaiting task, as an executor would
                outcome = (None, exc)
            self.busy = False
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody waits for the answer
                future.get_loop().call_soon_threadsafe(_hand_over, future, *outcome)
            del call, function, args, future, outcome  # the batch's tensors go now, not when the next call comes


MODEL_THREAD_NAME = "redline-model"
THREAD_POLL_S = 0.005
THREAD_END_S = 5.0  # the longest a closing dispatcher waits for its idle thread to end (it takes microseconds)


_STOPPED: weakref.WeakSet[ModelThread] = weakref.WeakSet()  # a running thread holds its own: kept while it runs


def calls_left_running() -> int:
    """How many model threads were stopped but still run: each was left in a model call (a stopped server's).

    A process about to exit with one should leave by ``os._exit`` (after flushing what it wrote), since the
    interpreter's shutdown would abort it when the call's next torch operation returns (see ``ModelThread``).
    """
    return sum(thread.alive for thread in list(_STOPPED))


def _model_exit(exc: SystemExit | KeyboardInterrupt) -> RuntimeError:
    """A model call's SystemExit or KeyboardInterrupt as an error of the model's, its traceback kept (the log names the
    model's line): raised in the event loop, it would end the server, and every request after it unanswered."""
    said = f"the model raised {type(exc).__name__}({', '.join(map(repr, exc.args))})"
    error = RuntimeError(f"{said}, which ends a program, not one request").with_traceback(exc.__traceback__)
    error.__cause__ = exc
    return error


def _hand_over(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.done():  # its awaiting task was cancelled
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


@dataclass(eq=False)
class Queued:
    """A request in the queue: its batch, when it arrived, its deadline, and the future its handler awaits."""

    inputs: torch.Tensor
    arrived: float
    deadline: float
    future: asyncio.Future[list[Any]] = field(repr=False)

    @property
    def samples(self) -> int:
        """Its number of samples."""
        return int(self.inputs.shape[0])


class Dispatcher:
    """The bounded queue in front of the engine, and the worker that batches it and runs the model."""

    def __init__(
        self, engine: Any, options: ServeOptions, metrics: ServeMetrics, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.engine = engine
        self.options = options
        self.metrics = metrics
        self.clock = clock
        self.failed: str | None = None  # why the worker stopped for good (its warm-up raised)
        self.error: Exception | None = None  # the exception that stopped it, traceback and all
        self.on_ready: Callable[[], None] | None = None  # called once the engine is warmed up (never fatal)
        self.on_failed: Callable[[str], None] | None = None  # called with ``failed`` when the worker gives up
        self._queue: deque[Queued] = deque()
        self._wakeup = asyncio.Event()
        self._closing = False
        self._task: asyncio.Task[None] | None = None
        self._thread: ModelThread | None = None
        self._stop_warm_up = threading.Event()  # set by close: a warm-up in progress ends before its next bucket
        self._running: list[Queued] = []  # the batch in the model now
        self._abandoned: Callable[[], Refused] | None = None  # makes each request's answer once stopped at once

    @property
    def queued(self) -> int:
        """Requests waiting for the model."""
        return len(self._queue)

    def start(self) -> None:
        """Start the worker on the running loop: the engine's warm-up first (unless it is ready), then batches.

        After ``close`` it may start again (an app's lifespan entered anew, as tests do).
        """
        self._closing = False
        self._abandoned = None
        self._wakeup = asyncio.Event()
        self._stop_warm_up = threading.Event()
        self._running = []
        if self._thread is None or self._thread.stopped:  # one not stopped serves any loop: its calls name theirs
            self._thread = ModelThread()
        self._task = asyncio.get_running_loop().create_task(self._work(), name="redline-serve-worker")

    def start_unless_running(self) -> None:
        """Start the worker where no lifespan did, as a request comes: in an app mounted inside another (whose
        lifespan does not run the mounted app's), or run with the lifespan off; and again where the loop it ran
        on has ended (Starlette's TestClient outside ``with`` runs each request in an event loop of its own).

        Without this its requests would wait in a queue nobody takes from, each answered 504 at its deadline.
        """
        if self._task is not None:
            ran_on = self._task.get_loop()
            if ran_on is asyncio.get_running_loop() or ran_on.is_running():  # here (or closed here), or elsewhere
                return
            self._queue.clear()  # the ended loop's requests: their handlers ended with it
        self.start()

    async def close(self) -> None:
        """Answer what is queued, then stop the worker and its thread; a warm-up still running stops early.

        Once every request was answered (each ends by its deadline), nothing more is waited for: a batch
        still in the model, whose requests all timed out, is left to end in its own (daemon) thread. After
        ``abandon`` the worker stops at once.
        """
        self._closing = True
        self._stop_warm_up.set()
        self._wakeup.set()
        while self._task is not None and not self._task.done():
            if self._abandoned is not None or (not self._queue and all(q.future.done() for q in self._running)):
                if self._running and self._abandoned is None:
                    log.warning(
                        "redline serve: stopping while the model still runs a batch whose requests were all "
                        "answered (504 at their deadline); it is not waited for"
                    )
                if self._running or self._abandoned is not None:
                    self._task.cancel()
            await asyncio.wait({self._task}, timeout=CLOSE_POLL_S)  # its cancellation is not raised here
        if self._thread is not None:
            self._thread.stop()
            if not self._thread.busy:  # idle: it ends at once, and is waited for, so that it does not outlive us
                await self._thread.ended(THREAD_END_S)

    def abandon(self, refused: Callable[[], Refused]) -> int:
        """Refuse every request queued or in the model, and any that comes after, with a ``refused()`` of its own
        (the server is stopping now); return how many were waiting. ``close`` then waits for none of them."""
        self._abandoned = refused
        waiting = [q for q in [*self._queue, *self._running] if not q.future.done()]
        for queued in waiting:
            _settle(queued.future, exception=refused())
        self._queue.clear()
        self.metrics.queued.set(0)
        return len(waiting)

    async def submit(self, inputs: torch.Tensor, *, arrived: float) -> list[Any]:
        """Queue ``inputs`` (a batch) and return its outputs, one per sample; raise Refused for 500, 503 or 504."""
        if self.failed is not None:
            raise Refused(503, "not_ready", f"the model cannot run: {self.failed}")
        if self._abandoned is not None:  # a request that came on an open connection after the stop
            raise self._abandoned()
        if len(self._queue) >= self.options.queue_size:
            self._drop_gone()  # the timed out and the abandoned do not count toward a full queue
        if len(self._queue) >= self.options.queue_size:
            raise Refused(
                503, "queue_full",
                f"the queue is full ({self.options.queue_size} requests waiting); retry after {RETRY_AFTER_S} s",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )  # fmt: skip
        deadline = arrived + self.options.timeout_ms / 1000
        future: asyncio.Future[list[Any]] = asyncio.get_running_loop().create_future()
        queued = Queued(inputs, arrived, deadline, future)
        self._queue.append(queued)
        self.metrics.queued.set(len(self._queue))
        self._wakeup.set()
        try:
            return await asyncio.wait_for(future, max(deadline - self.clock(), 0.0))
        except (TimeoutError, asyncio.TimeoutError):  # one class from Python 3.11; two on 3.10
            raise self._timed_out() from None
        finally:
            # Timed out, or the handler was cancelled (its client went away): a request still queued leaves now,
            # so that it never runs and its place is free at once.
            future.cancel()
            if future.cancelled() and queued in self._queue:
                self._queue.remove(queued)
                self.metrics.queued.set(len(self._queue))

    def _model_thread(self) -> ModelThread:
        if self._thread is None:
            raise RuntimeError("the dispatcher was not started")
        return self._thread

    def _drop_gone(self) -> None:
        """Forget queued requests whose handler stopped waiting (timed out, or the client went away)."""
        self._queue = deque(q for q in self._queue if not q.future.done())

    def _timed_out(self) -> Refused:
        return Refused(
            504, "timeout", f"no answer within timeout_ms={self.options.timeout_ms:g} of the request's arrival"
        )

    async def _work(self) -> None:
        try:
            if not getattr(self.engine, "ready", False):
                await self._model_thread().run(self._warm_up, self._stop_warm_up)
            self._tell_ready()
            await self._batches()
        except WarmUpStopped:  # shutting down while warming up: no request was accepted, none is lost
            log.info("redline serve: the warm-up stopped early, as the server is shutting down")
        except Exception as exc:  # the server stays up to say why (/livez), and answers 503
            stage = "warm-up failed" if not self.engine.ready else "the batching worker stopped"
            self.failed = f"{stage}: {describe_error(exc)}"
            self.error = exc
            if self.on_failed is None:  # otherwise its owner reports it (redline serve exits with it)
                log.error("redline serve: %s", self.failed)
            for queued in self._queue:
                _settle(queued.future, exception=Refused(503, "not_ready", f"the model cannot run: {self.failed}"))
            self._queue.clear()
            if self.on_failed is not None:
                self.on_failed(self.failed)

    def _tell_ready(self) -> None:
        """Call ``on_ready``; what it raises is logged as a warning, and the worker serves on.

        The callback is its caller's (``redline serve`` prints a line with it): its failure is not the worker's,
        which would otherwise be counted dead, its server stopped, for a line nobody could read.
        """
        if self.on_ready is None:
            return
        try:
            self.on_ready()
        except Exception as exc:
            log.warning(
                "redline serve: the on_ready callback failed, and the server serves on: %s%s", describe_error(exc),
                user_line(exc), exc_info=exc if traceback_asked() else None,
            )  # fmt: skip

    def _warm_up(self, stop: threading.Event) -> None:
        """Warm the engine up, in the model thread, unless a warm-up queued before this one (by a worker whose
        loop ended meanwhile) already did."""
        if not getattr(self.engine, "ready", False):
            self.engine.warm_up(stop)

    async def _batches(self) -> None:
        max_wait = self.options.max_wait_ms / 1000
        while True:
            self._drop_gone()
            now = self.clock()
            queue = list(self._queue)
            decision = decide(
                [Pending(q.samples, q.arrived, q.deadline) for q in queue], now,
                max_batch_size=self.options.batch_limit, max_wait=max_wait,
            )  # fmt: skip
            for i in decision.expired:
                _settle(queue[i].future, exception=self._timed_out())
            if decision.run:
                batch = [queue[i] for i in decision.run]
                taken = set(decision.run) | set(decision.expired)
                self._queue = deque(q for i, q in enumerate(queue) if i not in taken)
                self.metrics.queued.set(len(self._queue))
                await self._run(batch)
                continue
            self._queue = deque(q for i, q in enumerate(queue) if i not in set(decision.expired))
            self.metrics.queued.set(len(self._queue))
            if self._closing and not self._queue:
                return
            self._wakeup.clear()
            timeout = None if decision.wait_until is None else max(decision.wait_until - self.clock(), 0.0)
            with contextlib.suppress(TimeoutError, asyncio.TimeoutError):
                await asyncio.wait_for(self._wakeup.wait(), timeout)

    async def _run(self, batch: list[Queued]) -> None:
        """Run one batch in the model's thread and settle each request's future."""
        started = self.clock()
        for queued in batch:
            self.metrics.queue_seconds.observe(started - queued.arrived)
        self.metrics.batch_samples.observe(sum(q.samples for q in batch))
        self.metrics.batch_requests.observe(len(batch))
        self._running = batch
        try:
            await self._answer(batch)
        finally:
            self._running = []
            self.metrics.compute_seconds.observe(self.clock() - started)

    async def _answer(self, batch: list[Queued]) -> None:
        """Settle each request of ``batch`` with its outputs, or with a 500 when the model raised.

        When a batch of several requests fails, each is run again alone, so that one request the
        model cannot take (a token id beyond its vocabulary, say) fails by itself, not its batchmates
        too; not when the device is lost, where nothing can run.
        """
        samples = sum(q.samples for q in batch)
        try:
            inputs = torch.cat([q.inputs for q in batch]) if len(batch) > 1 else batch[0].inputs
            outputs = await self._model_thread().run(self._predict, inputs)
        except Exception as exc:  # this batch fails; the server goes on with the next one
            broken = getattr(self.engine, "broken", None)
            if len(batch) > 1 and not broken:
                log.warning(
                    "redline serve: a batch of %d requests failed (%s); running each alone", len(batch),
                    describe_error(exc),
                )  # fmt: skip
                for queued in batch:
                    if not queued.future.done():  # timed out or abandoned meanwhile: not run again
                        await self._answer([queued])
                return
            refused = _batch_failed(exc, samples)
            if broken:
                log.error("redline serve: the device is unusable (%s); /livez now fails", broken)
            for queued in batch:
                _settle(queued.future, exception=refused)
            return
        start = 0
        for queued in batch:
            _settle(queued.future, result=outputs[start : start + queued.samples])
            start += queued.samples

    def _predict(self, inputs: torch.Tensor) -> list[Any]:
        """Return one JSON-ready value per sample (in the model's thread: postprocessing is the user's code too)."""
        outputs = self.engine.predict(inputs)
        postprocess = self.engine.servable.postprocess
        if postprocess is None:
            values: list[Any] = outputs.tolist()
            return values
        made = postprocess(outputs)
        if not isinstance(made, Iterable) or isinstance(made, str | bytes | dict | set | frozenset):  # a set: no order
            raise ServableError(f"postprocess returned {type(made).__name__}; expected a list of one value per sample")
        values = list(made)
        if len(values) != inputs.shape[0]:
            raise ServableError(f"postprocess returned {len(values)} values for {inputs.shape[0]} samples")
        return values


def _batch_failed(exc: Exception, samples: int) -> Refused:
    """The 500 of every request of a batch that raised ``exc``, logged: the model's error, or redline's own."""
    message = describe_error(exc)
    if isinstance(exc, RedlineError) or blames_user_code(exc):  # a redline error names what the model gave
        # the log (not the client) gets the line of the user's code that raised: the model's, or its
        # preprocess's or postprocess's; REDLINE_TRACEBACK=1 the whole traceback
        log.error(
            "redline serve: the model failed on a batch of %d samples: %s%s", samples, message,
            user_line(innermost(exc)), exc_info=exc if traceback_asked() else None,
        )  # fmt: skip
        return Refused(500, "model_error", f"the model failed: {message}")
    log.error("redline serve: redline's own code failed on a batch of %d samples", samples, exc_info=exc)
    return Refused(
        500, "internal_error",
        f"the server failed on this batch, in redline's own code, not the model's: {message}; its log holds the "
        "traceback (please report it)",
    )  # fmt: skip


def _settle(future: asyncio.Future[list[Any]], *, result: Any = None, exception: BaseException | None = None) -> None:
    """Give ``future`` its result or exception, unless its handler stopped waiting for it."""
    if future.done():
        return
    if exception is not None:
        future.set_exception(exception)
    else:
        future.set_result(result)
