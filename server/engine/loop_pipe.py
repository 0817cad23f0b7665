"""The API process's end of the engine core's pipe, read and written by the event loop without ever blocking it.

Why: `loop.add_reader` under uvloop switches the socket to non-blocking, and `multiprocessing.Connection` assumes a
blocking one: a step report larger than the socket's buffer (prompt logprobs over a long prompt, 32 embeddings)
made `Connection.recv` raise BlockingIOError halfway through the message, which read as the core having died. A
blocking socket is no cure either: a large request sent while the core writes a large report would block both
processes in `send` at once. So this end keeps the socket non-blocking, gathers what arrives until a message is
whole, and queues what it cannot write yet until the socket takes it.

The framing is `multiprocessing.Connection`'s (a 4-byte big-endian signed length, or -1 and an 8-byte length, then
the pickle), so the core's end stays a plain Connection.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import struct
from collections.abc import Callable
from multiprocessing.reduction import ForkingPickler

log = logging.getLogger(__name__)

_READ_CHUNK = 1 << 16
_SHORT, _LONG = struct.Struct("!i"), struct.Struct("!Q")


def frame(obj) -> bytes:
    """`obj` framed as `Connection.send` frames it."""
    body = ForkingPickler.dumps(obj)
    if len(body) > 0x7FFFFFFF:
        return _SHORT.pack(-1) + _LONG.pack(len(body)) + body
    return _SHORT.pack(len(body)) + body


class LoopPipe:
    """A Connection's socket served by `loop`: `on_message(obj)` for each message that arrives, `on_closed(exc)` once
    when the other end goes (EOF, or the OSError that says so); `send` never blocks."""

    def __init__(self, fd: int, loop: asyncio.AbstractEventLoop, on_message: Callable[[object], None],
                 on_closed: Callable[[BaseException | None], None]):
        self._fd, self._loop = fd, loop
        self._on_message, self._on_closed = on_message, on_closed
        self._in = bytearray()
        # Read into one buffer kept for the pipe's life: os.read(n) allocates n bytes a call, and past malloc's mmap
        # threshold that is an mmap and a munmap a message (a few hundred bytes at c=1).
        self._chunk = bytearray(_READ_CHUNK)
        self._chunk_view = memoryview(self._chunk)
        self._out = bytearray()  # frames the socket has not taken yet, in order
        self._open = True
        os.set_blocking(fd, False)
        loop.add_reader(fd, self._on_readable)

    @property
    def is_open(self) -> bool:
        return self._open

    def send(self, obj) -> None:
        """Write `obj` now, or as soon as the socket takes it (after what is queued); OSError if the pipe is closed."""
        if not self._open:
            raise BrokenPipeError("the pipe is closed")
        data = frame(obj)
        if self._out:
            self._out += data
            return
        written = self._write(data)
        if written < len(data):
            self._out += data[written:]
            self._loop.add_writer(self._fd, self._on_writable)

    def close(self, flush_timeout: float = 1.0) -> None:
        """Stop serving the socket: what is queued is written first (blocking, at most `flush_timeout` seconds)."""
        if not self._open:
            return
        self._detach()
        if self._out:
            try:
                with socket.socket(fileno=os.dup(self._fd)) as sock:
                    sock.settimeout(flush_timeout)
                    sock.sendall(self._out)
            except OSError:
                pass
            self._out.clear()

    def _write(self, data) -> int:
        try:
            return os.write(self._fd, data)
        except BlockingIOError:
            return 0

    def _on_writable(self) -> None:
        try:
            written = self._write(self._out)
        except OSError as exc:
            self._closed(exc)
            return
        del self._out[:written]
        if not self._out:
            self._loop.remove_writer(self._fd)

    def _on_readable(self) -> None:
        # Level-triggered: what is left unread now calls this again, so one read a call keeps a long report from
        # holding the loop while other work waits.
        try:
            count = os.readv(self._fd, [self._chunk])
        except BlockingIOError:
            return
        except OSError as exc:
            self._closed(exc)
            return
        if not count:
            self._closed(None)
            return
        self._in += self._chunk_view[:count]
        for message in self._whole_messages():
            if not self._open:  # (a handler closed the pipe)
                return
            try:
                self._on_message(message)
            except Exception:  # one handler's failure must not lose the messages after it
                log.exception("handling a message from the pipe failed")

    def _whole_messages(self) -> list:
        """The messages complete in the input buffer, removed from it."""
        messages, start, buf = [], 0, self._in
        while len(buf) - start >= _SHORT.size:
            (size,) = _SHORT.unpack_from(buf, start)
            header = _SHORT.size
            if size == -1:
                if len(buf) - start < header + _LONG.size:
                    break
                (size,) = _LONG.unpack_from(buf, start + header)
                header += _LONG.size
            end = start + header + size
            if len(buf) < end:
                break
            messages.append(ForkingPickler.loads(bytes(buf[start + header:end])))
            start = end
        del buf[:start]
        return messages

    def _detach(self) -> None:
        self._open = False
        self._loop.remove_reader(self._fd)
        self._loop.remove_writer(self._fd)

    def _closed(self, exc: BaseException | None) -> None:
        if not self._open:
            return
        self._detach()
        self._out.clear()
        self._on_closed(exc)
