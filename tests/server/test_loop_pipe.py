"""The API process's end of the core's pipe: whole messages both ways whatever their size, never a blocked loop."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import socket
import struct
import threading
import time
from multiprocessing.reduction import ForkingPickler

import pytest

from server.engine.loop_pipe import LoopPipe

BIG = b"x" * (8 << 20)  # far past any socket buffer: it crosses in many reads and writes


def _loops():
    yield pytest.param(asyncio.new_event_loop, id="asyncio")
    try:
        import uvloop
    except ImportError:  # (pyproject installs it on Linux; the server runs on it wherever it is)
        return
    yield pytest.param(uvloop.new_event_loop, id="uvloop")


@pytest.fixture(params=list(_loops()))
def loop(request):
    loop = request.param()
    yield loop
    loop.close()


class Ends:
    """Our LoopPipe over one end of a multiprocessing pipe, the other end a plain Connection (as the core holds)."""

    def __init__(self, loop):
        self.loop = loop
        self.mine, self.theirs = mp.Pipe()
        self.received, self.closed = [], []
        self.arrived = asyncio.Event()
        self.pipe = LoopPipe(self.mine.fileno(), loop, self._on_message, self.closed.append)

    def _on_message(self, message):
        self.received.append(message)
        self.arrived.set()

    async def receive(self, count: int, timeout: float = 30) -> list:
        async def enough():
            while len(self.received) < count:
                self.arrived.clear()
                await self.arrived.wait()
        await asyncio.wait_for(enough(), timeout)
        return self.received


def _in_thread(target) -> threading.Thread:
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread


def test_a_message_larger_than_the_socket_buffer_arrives_whole_among_small_ones(loop):
    """A report bigger than the socket's buffer comes in pieces; with uvloop's non-blocking socket a Connection.recv
    raised BlockingIOError halfway through it, which read as the core's death."""
    ends = Ends(loop)
    sent = [("step", 1), ("step", BIG), ("reply", (2, None)), ("step", BIG[:70_000])]
    writer = _in_thread(lambda: [ends.theirs.send(m) for m in sent])
    assert loop.run_until_complete(ends.receive(len(sent))) == sent
    writer.join(10)
    assert ends.closed == [] and ends.pipe.is_open


def test_a_message_whose_body_comes_after_its_header_waits_for_it(loop):
    """Connection.send writes a message past 16 KB as two writes, its length and then its body; a reader woken by
    the first must wait for the second (Connection.recv on uvloop's non-blocking socket raised BlockingIOError)."""
    ends = Ends(loop)
    body = ForkingPickler.dumps(("step", BIG[:100_000]))
    sock = socket.socket(fileno=os.dup(ends.theirs.fileno()))

    def split_write():
        sock.sendall(struct.pack("!i", len(body)))
        time.sleep(0.3)  # our loop reads the length alone meanwhile
        sock.sendall(body[:1000])
        time.sleep(0.1)
        sock.sendall(body[1000:])
    writer = _in_thread(split_write)
    assert loop.run_until_complete(ends.receive(1)) == [("step", BIG[:100_000])]
    writer.join(10)
    sock.close()
    assert ends.closed == []


def test_sending_never_blocks_the_loop_and_keeps_the_order(loop):
    """Messages the other end is not reading yet are queued (send returns at once) and go out in order once it
    reads."""
    ends = Ends(loop)
    for i in range(3):
        ends.pipe.send(("add", i, BIG))  # the first fills the socket; nobody reads yet: no call may block
    got = []
    reader = _in_thread(lambda: got.extend(ends.theirs.recv() for _ in range(3)))

    async def until_read():
        while reader.is_alive():
            await asyncio.sleep(0.01)
    loop.run_until_complete(asyncio.wait_for(until_read(), 30))
    assert got == [("add", i, BIG) for i in range(3)]


def test_both_ends_sending_large_messages_at_once_do_not_deadlock(loop):
    """The core blocks in send while our end is full, and we may be sending meanwhile: ours must keep reading."""
    ends = Ends(loop)
    got = []

    def core():
        ends.theirs.send(("step", BIG))
        got.append(ends.theirs.recv())
    thread = _in_thread(core)
    ends.pipe.send(("add", BIG))
    assert loop.run_until_complete(ends.receive(1)) == [("step", BIG)]

    async def until_done():
        while thread.is_alive():
            await asyncio.sleep(0.01)
    loop.run_until_complete(asyncio.wait_for(until_done(), 30))
    assert got == [("add", BIG)]


def test_the_other_end_closing_is_reported_once_and_later_sends_fail(loop):
    ends = Ends(loop)
    ends.theirs.send(("step", 1))
    ends.theirs.close()

    async def until_closed():
        while not ends.closed:
            await asyncio.sleep(0.01)
    loop.run_until_complete(asyncio.wait_for(until_closed(), 10))
    assert ends.received == [("step", 1)] and ends.closed == [None] and not ends.pipe.is_open
    with pytest.raises(OSError):
        ends.pipe.send(("add", 1))


def test_close_writes_what_the_socket_had_not_taken(loop):
    """stop() sends "stop" and closes: a message still queued then goes out before the pipe is let go."""
    ends = Ends(loop)
    got = []
    ends.pipe.send(("add", BIG))
    ends.pipe.send(("stop", None))
    reader = _in_thread(lambda: got.extend(ends.theirs.recv() for _ in range(2)))
    ends.pipe.close(flush_timeout=10)
    reader.join(30)
    assert got == [("add", BIG), ("stop", None)]
