"""The engine on its own thread, fed from asyncio: continuous batching for the HTTP server.

Requests join and leave between steps: `submit` hands a request to the engine thread, and its stream
yields its output after every step that changed it; the thread steps the engine while any request is
unfinished and sleeps otherwise. A consumer that stops listening (a client that disconnected)
aborts its request at once, which frees its sequences and KV slots before the next step.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from specdec.config import SamplingParams
from specdec.engine.sequence import Sequence
from specdec.engine.engine import Engine
from specdec.outputs import RequestOutput


class EngineError(RuntimeError):
    """The engine failed while running this request (not the request's fault)."""


@dataclass(eq=False)
class RequestStream:
    """One queued request: its outputs arrive on `queue` from the engine thread."""

    request_id: str
    owner: "EngineLoop"
    loop: asyncio.AbstractEventLoop
    prompt: str | None
    sequences: list[Sequence] = field(default_factory=list)
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    finished: bool = False

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        """The request's cumulative output after each step that changed it; the last one is finished."""
        try:
            while not self.finished:
                item = await self.queue.get()
                if isinstance(item, BaseException):
                    raise item
                self.finished = item.finished
                yield item
        finally:
            self.close()

    def close(self) -> None:
        """Abort the request unless it finished: its consumer left (client gone) or failed."""
        if not self.finished:
            self.finished = True
            self.owner.abort(self.request_id)

    def send(self, item: RequestOutput | BaseException) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:
            pass  # that event loop is closed: nobody is listening any more


class EngineLoop:
    """Only the engine thread touches the engine: requests, aborts and shutdown reach it as commands run
    between steps, so the event loop never waits for a step and a new request joins at the next one (a
    lock around the step starved them: the stepping thread took it straight back)."""

    def __init__(self, engine: Engine, on_finished: Callable[[RequestOutput], None] | None = None) -> None:
        self.engine = engine
        self._on_finished = on_finished  # called on the engine thread with each finished request's output
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        self._inbox: deque[Callable[[], None]] = deque()  # commands from any thread, run by the engine thread
        self._wake = threading.Event()
        self._ids = itertools.count()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="specdec-engine", daemon=True)
        self._thread.start()

    async def submit(self, prompt_token_ids: list[int], params: SamplingParams,
                     prompt: str | None = None) -> RequestStream:
        """Queue a request. Raises ValueError, changing nothing, for a request the engine refuses."""
        if self._stopping:
            raise EngineError("the server is shutting down")
        loop = asyncio.get_running_loop()
        stream = RequestStream(f"req-{next(self._ids)}", self, loop, prompt)
        added: asyncio.Future = loop.create_future()

        def add() -> None:
            try:
                if self._stopping:
                    raise EngineError("the server is shutting down")
                stream.sequences = self.engine.add_request(stream.request_id, prompt_token_ids, params)
                self._streams[stream.request_id] = stream
            except Exception as error:
                loop.call_soon_threadsafe(_settle, added, error)
            else:
                loop.call_soon_threadsafe(_settle, added, None)

        self._post(add)
        try:
            await added
        except asyncio.CancelledError:  # the client left while the request was being queued
            self.abort(stream.request_id)
            raise
        return stream

    def abort(self, request_id: str) -> None:
        """Abort before the next step (callable from any thread, never blocks)."""

        def abort() -> None:
            self._streams.pop(request_id, None)
            self.engine.abort(request_id)

        self._post(abort)

    def shutdown(self) -> None:
        """Cancel what still runs and stop the engine thread."""
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout=60)

    def _post(self, command: Callable[[], None]) -> None:
        self._inbox.append(command)
        self._wake.set()

    def _run(self) -> None:
        while True:
            while self._inbox:
                self._inbox.popleft()()
            if self._stopping:
                self._cancel_all(EngineError("the server shut down before the request finished"))
                return
            if not self.engine.has_unfinished():
                self._wake.wait()
                self._wake.clear()  # before the inbox is read again: a later post sets it anew
                continue
            try:
                ready = self.engine.step()
            except Exception as error:  # a bug must fail its requests, not the server
                self._cancel_all(EngineError(f"the engine failed: {type(error).__name__}: {error}"))
                continue
            for request_id in {s.request_id for s in ready}:
                stream = self._streams.get(request_id)
                if stream is None:
                    continue
                output = RequestOutput.from_sequences(stream.sequences, stream.prompt)
                if output.finished:
                    del self._streams[request_id]
                    if self._on_finished is not None:
                        self._on_finished(output)
                stream.send(output)

    def _cancel_all(self, error: EngineError) -> None:
        for request_id, stream in list(self._streams.items()):
            self.engine.abort(request_id)
            stream.send(error)
        self._streams.clear()


def _settle(future: asyncio.Future, error: BaseException | None) -> None:
    if future.cancelled():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)
