"""uvicorn serving the app of a ServedModel in a background thread:

    with Server(served, port=0) as server:      port 0: a free port, server.port says which
        openai.OpenAI(base_url=server.url + "/v1", api_key="none")...

(`mhsa serve` runs it so, and waits: on SIGINT or SIGTERM it stops taking requests,
lets running ones finish within limits.drain_timeout, then ends the rest with an error
event and `[DONE]`; a second signal ends them at once.)"""

from __future__ import annotations

import signal
import threading
import time
from types import TracebackType

try:
    import uvicorn
except ImportError as error:  # pragma: no cover - the serve extra is missing
    raise ImportError(
        f"mhsa serve needs starlette and uvicorn ({error}): pip install 'mhsa[serve]'"
    ) from error

from .app import build_app
from .guard import Gate
from .limits import Access, Limits
from .models import ServedModel
from .protocol import timeout_protocol

# Seconds past limits.body_seconds after which the protocol ends a connection whose body
# is still coming: the app, reading a body, answers its own 408 at body_seconds; this
# ends one the app is not reading (or reads with no limit).
BODY_GRACE = 1.0


class Server:
    """The HTTP server on host:port (port 0: the system picks a free one); start() runs it
    in a daemon thread and returns once it accepts connections, stop() ends it."""

    def __init__(
        self,
        served: ServedModel,
        *,
        host: str = "127.0.0.1",
        port: int = 8000,
        log_level: str = "warning",
        limits: Limits | None = None,
        access: Access | None = None,
    ) -> None:
        self.limits = limits or Limits()
        self.gate = Gate()
        config = uvicorn.Config(
            build_app(served, self.limits, access or Access.for_host(host), self.gate),
            host=host,
            port=port,
            log_level=log_level,
            lifespan="on",
            timeout_graceful_shutdown=5,
            http=timeout_protocol(
                self.limits.header_seconds, self.limits.body_seconds + BODY_GRACE
            ),
        )
        self.served, self.host = served, host
        self._server = uvicorn.Server(config)
        self._thread: threading.Thread | None = None
        # Set when uvicorn's run returns. Waiting is on this, not Thread.join: on Python
        # 3.11 a join that Ctrl-C interrupts marks the still-running thread as stopped, so
        # a later join returns at once and the interpreter would exit mid-shutdown.
        self._ended = threading.Event()
        self._signals = 0  # SIGINT / SIGTERM received while waiting

    @property
    def port(self) -> int:
        """The port it listens on (once started)."""
        return self._server.servers[0].sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self, timeout: float = 60.0) -> Server:
        if self._thread is not None:
            raise RuntimeError("the server is already running")
        self._ended.clear()
        self.gate.open, self._signals = True, 0
        self._thread = threading.Thread(target=self._run, name="mhsa-serve", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if self._ended.is_set():
                self._thread = None
                raise OSError(
                    f"the server could not start on {self.host}:"
                    f"{self._server.config.port} (see the log above: a port in "
                    "use? pass another --port)"
                )
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"the server did not start within {timeout} s")
            time.sleep(0.02)
        return self

    def _run(self) -> None:
        try:
            self._server.run()
        except SystemExit:  # uvicorn's way out of a failed startup: start() reports it
            pass
        finally:
            self._ended.set()

    def wait(self) -> None:
        """Block until SIGINT or SIGTERM (or the server ends), then shut down: drain, then
        stop. A second signal cuts the drain short. (Signal handlers are installed only
        from the main thread; elsewhere Ctrl-C's KeyboardInterrupt still stops it.)"""
        if self._thread is None:
            return
        previous = self._install_handlers()
        try:
            try:
                while not self._signals and not self._ended.wait(0.2):
                    pass
            except KeyboardInterrupt:
                self._signals += 1
            self.stop()
        finally:
            for number, handler in previous.items():
                if handler is not None:  # (None: a handler not set from Python)
                    signal.signal(number, handler)

    def _install_handlers(self) -> dict:
        if threading.current_thread() is not threading.main_thread():
            return {}
        previous = {}
        for number in (signal.SIGINT, signal.SIGTERM):
            previous[number] = signal.signal(number, self._on_signal)
        return previous

    def _on_signal(self, number: int, frame: object) -> None:
        self._signals += 1  # (the second cuts the drain short)

    def drain(self, timeout: float) -> bool:
        """Take no new requests (503) and wait up to timeout seconds, or until a second
        signal, for the running and waiting ones to end; True if they all did."""
        self.gate.open = False
        engine = self.served.engine
        deadline = time.monotonic() + timeout
        while not engine.idle:
            if time.monotonic() >= deadline or self._signals > 1:
                return False
            time.sleep(0.02)
        return True

    def stop(self, drain_timeout: float | None = None) -> None:
        """End the server: no new requests; open ones get drain_timeout seconds
        (default: limits.drain_timeout) to finish, the rest end with an error (a stream:
        an error event and `[DONE]`); then the engine and uvicorn stop."""
        if self._thread is None:
            return
        timeout = self.limits.drain_timeout if drain_timeout is None else drain_timeout
        if not self._ended.is_set():
            self.drain(timeout)
        self.served.engine.stop()  # (cancels what is left: each stream gets its error event)
        self._server.should_exit = True
        self._ended.wait()
        self._thread.join()
        self._thread = None

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()
