"""The engine on its own thread, and the bridge to asyncio request handlers.

Handlers `submit` a request and read its token chunks from an asyncio queue; the engine thread is
the only one that touches the engine: adds and aborts reach it through an inbox and are applied
between rounds. A request whose client has gone is aborted, which frees its KV slot at once.

The thread is supervised: should it die, every request in flight is failed, `healthy` turns False
(/health answers 503) and new requests are refused instead of waiting forever.
"""

import asyncio
import ctypes
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from dspark.engine import Engine, GenerationFailed, Request

log = logging.getLogger("dspark.server")

class EndOfStream:
    """The type of `END_OF_STREAM`, the last item on a submission's queue: a sentinel of its own, so it
    cannot be mistaken for a chunk or for the exception that ended the request before it."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "END_OF_STREAM"


END_OF_STREAM = EndOfStream()


class QueueFull(Exception):
    pass


class ServiceStopped(Exception):
    """The server is shutting down (or shut down before the request finished)."""


class EngineDown(ServiceStopped):
    """The engine thread has died; only a restart brings the server back."""


class DeadlineExceeded(Exception):
    """The request ran (or waited) past the server's per-request deadline."""


@dataclass(eq=False)
class Submission:
    """A request in flight: its token chunks (lists of ids), then END_OF_STREAM, arrive on `chunks`.
    An exception object on the queue means the request failed (GenerationFailed, DeadlineExceeded,
    ServiceStopped); END_OF_STREAM follows it."""

    request: Request
    loop: asyncio.AbstractEventLoop
    deadline: float | None = None  #: time.monotonic() past which the request is ended
    chunks: asyncio.Queue = field(default_factory=asyncio.Queue)

    def deliver(self, item: list[int] | Exception | EndOfStream) -> None:
        try:
            self.loop.call_soon_threadsafe(self.chunks.put_nowait, item)
        except RuntimeError:  # the event loop has closed (shutdown): nobody is waiting any more
            pass


class EngineService:
    def __init__(self, engine: Engine, max_queue: int = 64) -> None:
        self.engine = engine
        self.max_queue = max_queue
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._live: dict[Request, Submission] = {}
        self._accepting = True
        self._stop = False
        self._drain_deadline: float | None = None
        self.failure: BaseException | None = None  #: why the engine thread died
        self._thread = threading.Thread(target=self._supervised, name="dspark-engine", daemon=True)
        self.finished: dict[str, int] = {}  #: finish reason -> count, for /metrics

    # -- handler side (any thread) ------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def submit(self, request: Request, timeout_s: float | None = None) -> Submission:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        submission = Submission(request, asyncio.get_running_loop(), deadline)
        with self._lock:
            if self.failure is not None:
                raise EngineDown("the engine has stopped; the server needs a restart")
            if not self._accepting:
                raise ServiceStopped("the server is shutting down")
            if len(self._live) >= self.engine.max_concurrency + self.max_queue:
                raise QueueFull(f"{len(self._live)} requests in flight; the queue holds {self.max_queue}")
            self._live[request] = submission
        self._inbox.put(("add", submission))
        self._wake.set()
        return submission

    def cancel(self, submission: Submission) -> None:
        """Abort a request (client disconnected, stop string reached); harmless once finished."""
        self._inbox.put(("abort", submission))
        self._wake.set()

    @property
    def healthy(self) -> bool:
        """The engine thread is running (or not started yet) and has not died."""
        return self.failure is None and (self._thread.is_alive() or self._thread.ident is None)

    @property
    def draining(self) -> bool:
        return not self._accepting

    @property
    def in_flight(self) -> int:
        return len(self._live)

    @property
    def queue_depth(self) -> int:
        return len(self.engine.waiting) + self._inbox.qsize()

    def begin_drain(self, timeout_s: float) -> None:
        """Refuse new requests; the ones in flight may finish until `timeout_s` from the first call,
        then they are ended with ServiceStopped."""
        with self._lock:
            self._accepting = False
            if self._drain_deadline is None:
                self._drain_deadline = time.monotonic() + timeout_s
        self._wake.set()

    def stop(self, timeout_s: float = 30.0) -> None:
        """Drain (see `begin_drain`), then end the thread."""
        self.begin_drain(timeout_s)
        self._stop = True
        self._wake.set()
        if self._thread.ident is not None:
            self._thread.join(timeout_s + 5.0)

    # -- engine thread --------------------------------------------------------------------------------

    def _supervised(self) -> None:
        try:
            self._run()
        except BaseException as error:  # noqa: BLE001 - a dead engine must not leave handlers waiting
            log.critical("the engine thread died; failing every request in flight", exc_info=error)
            with self._lock:
                self.failure = error
                live = list(self._live.values())
                self._live.clear()
            for submission in live:
                submission.deliver(EngineDown("the engine stopped while serving this request"))
                submission.deliver(END_OF_STREAM)

    def _run(self) -> None:
        engine = self.engine
        busy = False
        while True:
            self._apply_inbox()
            self._expire(time.monotonic())
            if not engine.has_work:
                if self._stop:
                    break
                if busy:  # the last request just finished: hand the freed heap back to the OS
                    release_free_memory()
                    busy = False
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            busy = True
            self._round()

    def _round(self) -> None:
        try:
            events = self.engine.step()
        except Exception as error:  # the engine isolates faults itself; this is the backstop: shed one, not all
            victim = self.engine.largest_request()
            log.exception("engine round failed; failing request %s", getattr(victim, "request_id", None))
            if victim is not None:
                self.engine.fail(victim, GenerationFailed("running a round", error))
            events = []
        for request, tokens in events:
            submission = self._live.get(request)
            if submission is not None and tokens:
                submission.deliver(tokens)
        with self._lock:
            done = [r for r in self._live if r.finished]
        for request in done:
            self._close(request, request.error)

    def _apply_inbox(self) -> None:
        while True:
            try:
                action, submission = self._inbox.get_nowait()
            except queue.Empty:
                return
            request = submission.request
            if action == "add" and not request.finished:
                try:
                    self.engine.add(request)
                except Exception as error:
                    request.finished, request.finish_reason = True, "error"
                    self._close(request, error)
            elif action == "abort" and request in self._live:
                self.engine.abort(request)
                self._close(request)

    def _expire(self, now: float) -> None:
        """End requests past their deadline, and every request once the drain deadline has passed."""
        with self._lock:
            live = list(self._live.items())
        draining_over = self._drain_deadline is not None and now >= self._drain_deadline
        for request, submission in live:
            if draining_over:
                self.engine.abort(request, "shutdown")
                self._close(request, ServiceStopped("the server shut down before this request finished"))
            elif submission.deadline is not None and now >= submission.deadline:
                self.engine.abort(request, "timeout")
                self._close(request, DeadlineExceeded("the request ran past the server's deadline"))

    def _close(self, request: Request, error: Exception | None = None) -> None:
        with self._lock:
            submission = self._live.pop(request, None)
        if submission is not None:
            reason = request.finish_reason or "abort"
            self.finished[reason] = self.finished.get(reason, 0) + 1
            if error is not None:
                submission.deliver(error)
            submission.deliver(END_OF_STREAM)


def release_free_memory() -> None:
    """glibc keeps freed heap in its arenas, so RSS stays at a load peak after the load is gone;
    malloc_trim returns it. A no-op where glibc is not the allocator."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
