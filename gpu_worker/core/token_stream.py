"""One Generate stream between the engine thread that produces its tokens and its consumer.

Hazard: one engine thread steps every stream of a model. If handing a token to a stream could
wait for that stream's reader, one slow or stalled client would stall the whole batch; if it
could grow without end, one stalled client would grow the worker's memory without end.
Contract:
- The engine never waits on a consumer: `TokenBuffer.put` appends under a lock and returns.
- A stream buffers at most `limit` tokens its consumer has not taken (the edge's
  `--max-stream-buffer-tokens`). The token after that overflows it: the sequence is cancelled
  at once (the scheduler reaps it and frees its KV blocks within one step), later tokens are
  dropped, and the consumer's next take reports the overflow (the edge answers
  RESOURCE_EXHAUSTED naming the bound).
- An async consumer (the gRPC edge, one event loop for every stream) is woken through a
  `Waker`: `put` only marks the buffer ready, and at most one `call_soon_threadsafe` is pending
  per loop whatever the number of streams with news. Only a consumer that waits is woken: one
  busy writing to a lagging client takes everything buffered at its next take, so the tokens of
  a lagging client are coalesced into fewer messages.
- `interval` (the edge's `--stream-interval`, default 1): after the stream's first token a
  consumer is handed tokens only once `interval` of them are buffered, or the stream ended,
  failed or overflowed. One message then carries `interval` tokens, so a step of B streams
  costs the loop B / `interval` writes (each one is gRPC's per-message work under the GIL the
  engine thread needs too). The first token is never held: time to first token is unchanged.
- A sync consumer (tests, scripts) blocks on the buffer's condition, one token per item.
- The single-sequence path (batching off) has no engine thread: `pump()` runs the model's
  generator on the caller's thread into the same buffer.
Cost: per token one uncontended lock and an append on the engine thread; per loop iteration at
most one self-pipe write, however many streams advanced in the step.
"""
from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from gpu_worker.core.loaded_model import LoadedModel
from gpu_worker.engines.scheduler.histogram import Histogram
from gpu_worker.engines.scheduler.scheduler import Sequence
from gpu_worker.engines.serial import SerialRequest
from services.common.errors import InvalidArgument, ResourceExhausted

# Tokens a stream may hold for a reader that does not keep up (the serve flag's default). At
# 4 bytes of payload per token a full buffer is ~16 KiB of message; at 200 tokens/s it is 20 s
# of lag, far more than a reading client ever accumulates, far less than a stalled one would.
DEFAULT_STREAM_BUFFER_TOKENS = 4096
MAX_STREAM_BUFFER_TOKENS = 1 << 20
# Tokens a message carries at most by `--stream-interval` (a larger interval is a stream that
# only arrives at its end: use a unary call for that).
MAX_STREAM_INTERVAL = 1024


def overflow_error(limit: int) -> ResourceExhausted:
    """The status of a stream whose reader fell `limit` tokens behind."""
    return ResourceExhausted(
        f"the client did not read this stream's tokens: {limit} were buffered for it "
        f"(--max-stream-buffer-tokens {limit}), so it was cancelled and its KV cache freed; "
        "read the stream as it arrives, or raise the bound on the worker",
        asked_bytes=0, free_bytes=0, zone="")


@dataclass(frozen=True)
class Taken:
    """What a consumer took from a buffer in one go."""

    tokens: list[int]
    ended: bool = False                       # the engine ended the stream (after `tokens`)
    error: BaseException | None = None        # the engine's error, then ended
    overflowed: bool = False                  # the reader fell behind the bound: cancelled


class Waker:
    """Wakes the async consumers of one event loop from any thread, with at most one
    `call_soon_threadsafe` pending (each costs a self-pipe write and a loop wake-up)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._ready: list[TokenBuffer] = []
        self._scheduled = False

    def wake(self, buffer: TokenBuffer) -> None:
        with self._lock:
            self._ready.append(buffer)
            if self._scheduled:
                return
            self._scheduled = True
        try:
            self._loop.call_soon_threadsafe(self._run)
        except RuntimeError:  # the loop closed (server stopped): nobody waits any more
            pass

    def _run(self) -> None:
        with self._lock:
            ready, self._ready = self._ready, []
            self._scheduled = False
        for buffer in ready:
            buffer._wake_on_loop()


class TokenBuffer:
    """A stream's tokens between `put` (the engine thread) and one consumer; bounded by
    `limit` tokens not yet taken. `waker`: how an async consumer on a loop is woken;
    `interval`: tokens a consumer waits for after the first (the end hands over the rest)."""

    def __init__(self, limit: int = DEFAULT_STREAM_BUFFER_TOKENS, waker: Waker | None = None,
                 interval: int = 1) -> None:
        if not 1 <= limit <= MAX_STREAM_BUFFER_TOKENS:
            raise InvalidArgument(f"a stream buffer of {limit} tokens: use 1.."
                                  f"{MAX_STREAM_BUFFER_TOKENS}")
        if not 1 <= interval <= min(limit, MAX_STREAM_INTERVAL):
            raise InvalidArgument(
                f"a stream interval of {interval} tokens: use 1..{min(limit, MAX_STREAM_INTERVAL)}"
                " (at most the stream buffer's bound, --max-stream-buffer-tokens)")
        self.limit, self.interval = limit, interval
        self._want = 1                            # tokens that make news: 1 until the first take
        self._waker = waker
        self._cond = threading.Condition(threading.Lock())
        self._tokens: list[int] = []
        self._ended = False
        self._error: BaseException | None = None
        self._overflowed = False
        self._async_waiting = False               # an async consumer awaits `_ready`
        self._ready: asyncio.Event | None = None  # created on the consumer's loop
        self.on_overflow: Callable[[], None] | None = None   # engine thread: cancel the sequence
        self.on_overflow_loop: Callable[[], None] | None = None  # on the loop, once
        self.peak = 0                             # most tokens ever held (stats, tests)

    # -- producer (the engine thread) ----------------------------------------------------------
    def put(self, item: object) -> None:
        """A token (int), the engine's error (an exception), or anything else: the end."""
        overflow = False
        with self._cond:
            if isinstance(item, int):
                if self._overflowed or self._ended:
                    return
                if len(self._tokens) >= self.limit:
                    self._overflowed = overflow = True
                else:
                    self._tokens.append(item)
                    self.peak = max(self.peak, len(self._tokens))
            elif isinstance(item, BaseException):
                self._error = item
            else:
                self._ended = True
            news = self._has_news()
            if news:
                self._cond.notify_all()
            wake = (self._async_waiting and news) or (overflow and self.on_overflow_loop is not None)
            if wake:
                self._async_waiting = False
        if overflow and self.on_overflow is not None:
            self.on_overflow()
        if wake and self._waker is not None:
            self._waker.wake(self)

    # -- consumers -----------------------------------------------------------------------------
    def _has_news(self) -> bool:
        return (len(self._tokens) >= self._want or self._ended or self._error is not None
                or self._overflowed)

    def _drain(self) -> Taken:
        tokens, self._tokens = self._tokens, []
        if tokens:
            self._want = self.interval
        return Taken(tokens, self._ended or self._error is not None, self._error,
                     self._overflowed)

    def take_nowait(self) -> Taken:
        with self._cond:
            return self._drain()

    def get(self, timeout: float | None = None) -> Taken:
        """Block until there is something, then take everything (a sync consumer)."""
        with self._cond:
            self._cond.wait_for(self._has_news, timeout)
            return self._drain()

    async def take(self) -> Taken:
        """Wait on the running loop until there is something, then take everything."""
        if self._ready is None:
            self._ready = asyncio.Event()
        while True:
            self._ready.clear()
            with self._cond:
                if self._has_news():
                    return self._drain()
                self._async_waiting = True
            await self._ready.wait()

    def _wake_on_loop(self) -> None:
        if self._ready is not None:
            self._ready.set()
        if self._overflowed and self.on_overflow_loop is not None:
            callback, self.on_overflow_loop = self.on_overflow_loop, None
            callback()

    @property
    def overflowed(self) -> bool:
        with self._cond:
            return self._overflowed


class TokenStream:
    """One Generate stream: its sequence, its buffer and what runs once it ends. Iterating it
    (sync) yields `[token]` items; the edge awaits `buffer.take()` instead. Closing it early (the
    client went away) cancels the sequence; its KV is freed within one step."""

    def __init__(self, loaded: LoadedModel, seq: Sequence | SerialRequest,
                 tracer_provider: object,
                 on_end: Callable[[], None], buffer: TokenBuffer,
                 tokens: Iterator[int] | None = None) -> None:
        """`on_end` runs once the stream ended, however (the runtime reports its memory then);
        `tokens`: the single-sequence path's generator, run by `pump()` or by iterating."""
        self._loaded, self.seq, self.buffer = loaded, seq, buffer
        self._on_end = on_end
        self._tokens = tokens
        self._pending: list[int] = []
        self._closed = False
        self._close_lock = threading.Lock()
        buffer.on_overflow = self._cancel
        self._span = _start_span(tracer_provider, "worker.generate", model=loaded.info.model_id,
                                 prompt_tokens=len(seq.prompt), max_new_tokens=seq.max_new_tokens)

    @property
    def needs_pump(self) -> bool:
        """True on the single-sequence path: someone must run `pump()` (it blocks)."""
        return self._tokens is not None

    def pump(self) -> None:
        """Run the single-sequence generator into the buffer (blocks for the whole stream; it
        stops at the next token once the stream is cancelled or its buffer overflowed)."""
        with self._close_lock:    # close() must not close the generator while it runs here
            tokens, self._tokens = self._tokens, None
        if tokens is None:        # closed before it started
            self.buffer.put(None)
            return
        try:
            for token in tokens:
                self.buffer.put(int(token))
                if self.seq.is_cancelled():
                    break
        except Exception as exc:  # noqa: BLE001 - the stream reports it to its consumer
            self.buffer.put(exc)
        finally:
            close = getattr(tokens, "close", None)
            if close is not None:
                close()       # leaves the model lock and the residency pin on this thread
            self.buffer.put(None)

    def __iter__(self) -> TokenStream:
        return self

    def __next__(self) -> list[int]:
        if self._tokens is not None:          # sync single-sequence: run it right here
            try:
                return [int(next(self._tokens))]
            except BaseException:
                self.close()
                raise
        while not self._pending:
            taken = self.buffer.get()
            self._pending.extend(taken.tokens)
            if self._pending:
                break
            self.close()
            if taken.error is not None:
                raise taken.error
            if taken.overflowed:
                raise overflow_error(self.buffer.limit)
            raise StopIteration
        return [self._pending.pop(0)]

    def close(self) -> None:
        """End the stream (idempotent): cancel the sequence unless it finished, then report."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
            tokens, self._tokens = self._tokens, None   # not running: pump() took it otherwise
        self._cancel()
        close = getattr(tokens, "close", None)
        if close is not None:
            close()
        self._loaded.last_used = time.monotonic()
        try:
            self._on_end()
        finally:
            if self._span is not None:
                self._span.end()

    def _cancel(self) -> None:
        if self.seq.state != "finished":
            self.seq.cancel()
            if self._loaded.scheduler is not None:
                self._loaded.scheduler.wake()

    @property
    def finish_reason(self) -> str:
        """"length", "stop" or "cancelled" once the stream ended ("" before)."""
        reason = self.seq.finish_reason
        return reason if reason in ("length", "stop", "cancelled") else ""


def _start_span(provider: object, name: str, **attributes: object) -> object | None:
    """A span started now and ended by `close()` (on whichever thread ends the stream, so it is
    never made current: a context attached on one thread cannot be detached on another)."""
    try:
        from opentelemetry import trace
    except ImportError:      # tracing is optional on the GPU machine
        return None
    tracer = (provider or trace.get_tracer_provider()).get_tracer("gpu_worker.core.runtime")
    return tracer.start_span(name, attributes={k: v for k, v in attributes.items()
                                               if v is not None})


@dataclass
class StreamStats:
    """What the edge measures of Generate streams, as the client sees them (fed by the edge,
    read by the Prometheus collector): time to first token and per output token, end to end,
    open streams, and streams cancelled for not reading."""

    ttft: Histogram = field(default_factory=Histogram)
    tpot: Histogram = field(default_factory=Histogram)
    e2e: Histogram = field(default_factory=Histogram)
    open_streams: int = 0
    overflowed: int = 0
    messages: int = 0
    tokens: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def opened(self) -> None:
        with self._lock:
            self.open_streams += 1

    def closed(self) -> None:
        with self._lock:
            self.open_streams -= 1

    def sent(self, tokens: int) -> None:
        with self._lock:
            self.messages += 1
            self.tokens += tokens

    def overflow(self) -> None:
        with self._lock:
            self.overflowed += 1

    def finished(self, started: float, first: float | None, last: float | None,
                 tokens: int) -> None:
        """One stream's latencies (perf_counter times): TTFT, mean TPOT, end to end."""
        now = time.perf_counter()
        self.e2e.observe(now - started)
        if first is None:
            return
        self.ttft.observe(first - started)
        if last is not None and tokens > 1:
            self.tpot.observe((last - first) / (tokens - 1))

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {"open_streams": self.open_streams, "overflowed": self.overflowed,
                    "messages": self.messages, "tokens": self.tokens}
