"""Run the app under uvicorn; SIGTERM / SIGINT end every unfinished request at once, so a busy
server stops within seconds instead of waiting for its longest generation."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any

import uvicorn

from kvcodec.server.app import create_app

GRACEFUL_S = 3.0  # how long open connections may take to close after a stop signal


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, engine: Any) -> None:
        super().__init__(config)
        self.engine = engine

    def handle_exit(self, sig: int, frame: Any) -> None:
        # off the event loop: stop() waits for the engine's current step
        threading.Thread(target=self.engine.stop, kwargs={"abort": True}, daemon=True).start()
        super().handle_exit(sig, frame)


def _exit_on_sigterm(sig: int, frame: Any) -> None:
    raise SystemExit(128 + sig)


@contextlib.contextmanager
def sigterm_exits() -> Iterator[None]:
    """SIGTERM raises SystemExit (status 143) in the main thread for the block, where its action is the
    default (ending the process with no cleanup); the handler before it is put back after."""
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
    ):
        yield
        return
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def serve(engine: Any, model_name: str, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> None:
    """Serve `engine` until a stop signal; the engine is closed on the way out. uvicorn raises the stop
    signal again once it has shut down: SIGTERM then leaves as SystemExit (status 143), so the caller's
    cleanup runs (serve's temporary store is deleted), where its default action would end the process."""
    app = create_app(engine, model_name, close_on_shutdown=True)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=GRACEFUL_S)
    with sigterm_exits():
        _Server(config, engine).run()
