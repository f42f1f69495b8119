"""The engine on its own thread, and the bridge to asyncio request handlers.

Handlers `submit` a request and read its token chunks from an asyncio queue; the engine thread is
the only one that touches the engine: adds and aborts reach it through an inbox and are applied
between rounds. A request whose client has gone is aborted, which frees its KV slot at once.
"""

import asyncio
import logging
import queue
import threading
from dataclasses import dataclass, field

from dspark.engine import Engine, Request

log = logging.getLogger("dspark.server")

FINISHED = None  #: the last item on a submission's queue


class QueueFull(Exception):
    pass


class ServiceStopped(Exception):
    pass


@dataclass(eq=False)
class Submission:
    """A request in flight: its token chunks (lists of ids), then FINISHED, arrive on `chunks`.
    An exception object on the queue means the engine failed this request."""

    request: Request
    loop: asyncio.AbstractEventLoop
    chunks: asyncio.Queue = field(default_factory=asyncio.Queue)

    def deliver(self, item) -> None:
        self.loop.call_soon_threadsafe(self.chunks.put_nowait, item)


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
        self._thread = threading.Thread(target=self._run, name="dspark-engine", daemon=True)
        self.finished: dict[str, int] = {}  #: finish reason -> count, for /metrics

    # -- handler side (any thread) ------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def submit(self, request: Request) -> Submission:
        submission = Submission(request, asyncio.get_running_loop())
        with self._lock:
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
    def in_flight(self) -> int:
        return len(self._live)

    @property
    def queue_depth(self) -> int:
        return len(self.engine.waiting) + self._inbox.qsize()

    def stop(self, timeout: float = 30.0) -> None:
        """Refuse new requests, let the running ones finish (up to `timeout`), then end the thread."""
        with self._lock:
            self._accepting = False
        self._stop = True
        self._wake.set()
        self._thread.join(timeout)

    # -- engine thread --------------------------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        while True:
            self._apply_inbox()
            if not engine.has_work:
                if self._stop:
                    break
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            try:
                events = engine.step()
            except Exception as error:  # a failed round must not take the server down
                log.exception("engine round failed; failing its requests")
                self._fail_all(error)
                continue
            for request, tokens in events:
                submission = self._live.get(request)
                if submission is not None and tokens:
                    submission.deliver(tokens)
            with self._lock:
                done = [r for r in self._live if r.finished]
            for request in done:
                self._close(request)

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
                    submission.deliver(error)
                    self._close(request)
            elif action == "abort" and request in self._live:
                self.engine.abort(request)
                self._close(request)

    def _fail_all(self, error: Exception) -> None:
        with self._lock:
            live = list(self._live.items())
        for request, submission in live:
            if not request.finished:
                self.engine.abort(request, "error")
            submission.deliver(error)
            self._close(request)

    def _close(self, request: Request) -> None:
        with self._lock:
            submission = self._live.pop(request, None)
        if submission is not None:
            reason = request.finish_reason or "abort"
            self.finished[reason] = self.finished.get(reason, 0) + 1
            submission.deliver(FINISHED)
