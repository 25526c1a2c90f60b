"""An asyncio event loop in a daemon thread: how the clients serve code without a loop.

The clients are asyncio adapters (:mod:`headgate.client.link`). Code that
has no event loop of its own (a Spark listener's py4j thread, a plain
script) gets one here: the :class:`~headgate.client.SyncProducer` runs its
:class:`~headgate.client.Producer` on one, and the
:class:`~headgate.client.ReleaseClient` its connection. The demo and the
tests run gateways on them too. Other threads hand work over with
:meth:`BackgroundLoop.call` (a callback, never waiting) or
:meth:`BackgroundLoop.run` (a coroutine, waiting for its result).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

__all__ = ["BackgroundLoop"]

T = TypeVar("T")


class BackgroundLoop:
    """An asyncio loop running in its own daemon thread until :meth:`stop`.

    Args:
        name: the thread's name (shown by debuggers and py-spy).
    """

    def __init__(self, name: str) -> None:
        #: The loop; touch it only from its thread, or through the methods below.
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    @property
    def running(self) -> bool:
        """Whether the loop still runs (not stopped yet)."""
        return self.loop.is_running()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the loop and wait for its result.

        Raises:
            TimeoutError: not done within ``timeout`` seconds; ``coro`` is cancelled.
        """
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"not done within {timeout} s") from None

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Start ``coro`` on the loop; the returned future tells when it is done."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, callback: Callable[[], object]) -> None:
        """Run ``callback`` on the loop soon; nothing happens once the loop is closed."""
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(callback)

    def stop(self) -> None:
        """Cancel what still runs on the loop, then stop and close it; idempotent."""
        if self._thread.is_alive():

            async def cancel_the_rest() -> None:
                me = asyncio.current_task()
                rest = [t for t in asyncio.all_tasks() if t is not me]
                for task in rest:
                    task.cancel()
                await asyncio.gather(*rest, return_exceptions=True)

            with contextlib.suppress(Exception):
                self.run(cancel_the_rest(), 10)
            self.call(self.loop.stop)
            self._thread.join(10)
        if not self._thread.is_alive() and not self.loop.is_closed():
            self.loop.close()
