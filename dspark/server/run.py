"""Running the app under uvicorn with a bounded, client-aware drain on SIGINT / SIGTERM."""

import contextlib

import uvicorn
from fastapi import FastAPI

from dspark.server.service import EngineService

#: uvicorn's own hard stop comes this long after the drain deadline (the drain normally ends first)
SHUTDOWN_MARGIN_S = 5.0


class DrainingServer(uvicorn.Server):
    """On a signal, the engine service starts draining at once: new requests get 503 and the ones in
    flight have `drain_timeout_s` to finish before they are ended with an error. Requests whose
    client has gone were aborted when it left, so nobody waits for them. After a graceful drain the
    process exits 0 (uvicorn would re-raise the signal)."""

    def __init__(self, config: uvicorn.Config, service: EngineService, drain_timeout_s: float) -> None:
        super().__init__(config)
        self.service, self.drain_timeout_s = service, drain_timeout_s

    async def shutdown(self, sockets=None) -> None:
        self.service.begin_drain(self.drain_timeout_s)
        await super().shutdown(sockets)

    @contextlib.contextmanager
    def capture_signals(self):
        with super().capture_signals():
            yield
            captured = getattr(self, "_captured_signals", None)
            if captured is not None:
                captured.clear()


def draining_server(app: FastAPI, host: str, port: int, drain_timeout_s: float,
                    log_level: str = "info") -> DrainingServer:
    """uvicorn over an app from `create_app` (its engine service is `app.state.service`)."""
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=drain_timeout_s + SHUTDOWN_MARGIN_S)
    return DrainingServer(config, app.state.service, drain_timeout_s)
