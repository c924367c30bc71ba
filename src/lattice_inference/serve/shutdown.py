"""uvicorn's server with a bounded, graceful shutdown that exits with status 0.

On SIGTERM or SIGINT uvicorn stops accepting connections and waits for the open ones to end. `GracefulServer`
tells the app first (``on_shutdown``: `Server.begin_shutdown`, which ends the generations still running after
``--shutdown-timeout``), keeps uvicorn's own cancellation of what is left as a backstop a few seconds later, and
does not re-raise the signal afterwards (uvicorn does, which would end the process with the signal's status
rather than 0 after a clean shutdown).
"""

from __future__ import annotations

import math
import socket
from collections.abc import Callable
from types import FrameType

import uvicorn

#: Seconds uvicorn waits, beyond the app's own shutdown timeout, before it cancels the connections still open.
BACKSTOP_S = 5.0


class GracefulServer(uvicorn.Server):
    """A `uvicorn.Server` that calls ``on_shutdown()`` (on the event loop) as soon as shutdown begins."""

    def __init__(self, config: uvicorn.Config, on_shutdown: Callable[[], None]) -> None:
        super().__init__(config)
        self.on_shutdown = on_shutdown

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.on_shutdown()
        await super().shutdown(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        captured = getattr(self, "_captured_signals", None)
        if isinstance(captured, list):  # uvicorn >= 0.29 raises these again once shut down; we exit with 0
            captured.clear()


def serve(app: object, *, host: str, port: int, log_level: str, shutdown_timeout: float) -> None:
    """Run ``app`` (whose ``state.server`` is the `lattice_inference.serve.app.Server`) until a signal, then shut
    down within ``shutdown_timeout`` seconds (plus the time to end the last decode round)."""
    config = uvicorn.Config(
        app,  # type: ignore[arg-type]
        host=host,
        port=port,
        log_level=log_level,
        timeout_graceful_shutdown=math.ceil(shutdown_timeout + BACKSTOP_S),
    )
    GracefulServer(config, on_shutdown=app.state.server.begin_shutdown).run()  # type: ignore[attr-defined]
