"""A real pseudo-terminal of a chosen size, for views that ask the terminal how wide it is."""

from __future__ import annotations

import contextlib
import fcntl
import os
import pty
import struct
import termios
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TextIO


@dataclass
class PseudoTerminal:
    """``stream`` writes to the terminal; ``output`` is everything it showed, once the terminal is closed."""

    stream: TextIO
    output: str = ""
    _received: bytearray = field(default_factory=bytearray)


@contextlib.contextmanager
def pseudo_terminal(columns: int, rows: int) -> Iterator[PseudoTerminal]:
    """A pty whose size is ``columns`` x ``rows`` (0 x 0 is what a bare pty, as some CI runners give, reports).

    Output post-processing is off, so ``output`` holds the text exactly as written (``\\n`` stays ``\\n``).
    A thread reads the other side as it comes, so a writer never blocks on a full buffer.
    """
    controller, terminal = pty.openpty()
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
    attributes = termios.tcgetattr(terminal)
    attributes[1] &= ~termios.OPOST
    termios.tcsetattr(terminal, termios.TCSANOW, attributes)
    screen = PseudoTerminal(open(terminal, "w", encoding="utf-8", closefd=True))  # noqa: SIM115 - closed below

    def read_until_closed() -> None:
        with contextlib.suppress(OSError):  # EIO once the terminal side is closed
            while chunk := os.read(controller, 4096):
                screen._received.extend(chunk)

    reader = threading.Thread(target=read_until_closed, daemon=True)
    reader.start()
    try:
        yield screen
    finally:
        screen.stream.close()
        reader.join()
        os.close(controller)
        screen.output = screen._received.decode("utf-8", errors="replace")
