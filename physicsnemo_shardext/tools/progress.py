"""The one progress line: ``shardext verify`` and the benchmark runner draw their progress with it.

Torch-free (``shardext verify`` imports it in the parent, before any rank starts).

* `ProgressBar` draws one status line on a stream, prefixed with the seconds
  since it was made: redrawn in place on a terminal; in a log (a stream that is
  not a terminal) only the texts a caller marks for the log, one line each.
* `bar_text` formats ``label [#####-----] 5/10 unit``.
* Progress that happens in another process (rank 0 of a worker pool) travels
  through a file of ``phase<TAB>done<TAB>total`` lines: the rank appends with
  `write_record`, the parent's `ProgressFeed` reads the new complete lines on
  a thread and hands each record to a callback, which draws it on the bar.

Examples:
    >>> import io
    >>> log = io.StringIO()  # not a terminal: only the texts marked for the log are written
    >>> bar = ProgressBar(log, clock=lambda: 0.0)
    >>> bar.update(bar_text("2 ranks: fft", 0, 2))               # a terminal would show this
    >>> bar.update(bar_text("2 ranks: fft", 1, 2), log="[1/2] 2 ranks: fft done")
    >>> log.getvalue()
    '[    0s] [1/2] 2 ranks: fft done\\n'
    >>> bar_text("sharded forward", 5, 10, unit="ops")
    'sharded forward [##########----------] 5/10 ops'
    >>> parse_record("comparing\\t0\\t12\\n"), parse_record("half a li")
    (('comparing', 0, 12), None)
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

__all__ = ["ProgressBar", "ProgressFeed", "bar_text", "parse_record", "write_record"]

#: Width of the line on a terminal (the elapsed seconds included).
LINE_WIDTH = 78


def bar_text(label: str, done: int, total: int, *, width: int = 20, unit: str = "") -> str:
    """``label [####------] done/total unit``; only ``label`` while there is no total.

    Args:
        label: what is in progress.
        done: steps finished (shown at most ``total``).
        total: steps in all; 0 or less draws no bar.
        width: characters of the bar between the brackets.
        unit: a word after the counts (``"ops"``).

    Returns:
        The text, for `ProgressBar.update`.

    Examples:
        >>> bar_text("2 ranks: conv", 1, 4, width=8)
        '2 ranks: conv [##------] 1/4'
        >>> bar_text("building the model", 0, 0)
        'building the model'
    """
    if total <= 0:
        return label
    filled = max(0, min(width, width * done // total))
    counts = f"{min(done, total)}/{total}" + (f" {unit}" if unit else "")
    return f"{label} [{'#' * filled}{'-' * (width - filled)}] {counts}"


class ProgressBar:
    """One status line on ``stream`` (standard error by default), prefixed with the seconds elapsed.

    On a terminal every new text redraws the line in place; `close` ends it. In a
    log only the ``log`` texts of `update` are written, one line each, so that a
    log file gets a line per finished step, not one per redraw.

    Args:
        stream: where to draw; ``None`` is ``sys.stderr`` at the time of each write.
        enabled: ``False`` draws nothing (``--no-progress``, or a rank other than 0).
        clock: seconds, for the elapsed time (``time.monotonic``).

    Examples:
        >>> import io
        >>> log = io.StringIO()
        >>> bar = ProgressBar(log, clock=iter([0.0, 12.4]).__next__)
        >>> bar.update("starting 2 ranks", log="starting 2 ranks")
        >>> bar.close()
        >>> log.getvalue()
        '[   12s] starting 2 ranks\\n'
    """

    def __init__(
        self, stream: TextIO | None = None, *, enabled: bool = True, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._stream = stream
        self.enabled = enabled
        self._clock = clock
        self._started = clock()
        self._last = ""
        self._drawn = False
        self._lock = threading.Lock()  # a ProgressFeed draws from its thread

    @property
    def stream(self) -> TextIO:
        """The stream drawn on."""
        return self._stream if self._stream is not None else sys.stderr

    @property
    def tty(self) -> bool:
        """Whether the stream is a terminal (the line is redrawn in place)."""
        try:
            return self.stream.isatty()
        except (AttributeError, ValueError):
            return False

    def update(self, text: str, *, log: str | None = None) -> None:
        """Show ``text``; in a log write ``log`` instead (nothing when it is ``None``).

        The same text twice in a row is drawn once.
        """
        if not self.enabled:
            return
        with self._lock:
            tty = self.tty
            shown = text if tty else log
            if shown is None or shown == self._last:
                return
            self._last = shown
            line = f"[{self._clock() - self._started:5.0f}s] {shown}"
            if tty:
                self.stream.write("\r" + line.ljust(LINE_WIDTH)[:LINE_WIDTH])
                self._drawn = True
            else:
                self.stream.write(line + "\n")
            self.stream.flush()

    def close(self) -> None:
        """End the line on a terminal (so that what follows starts on a fresh line)."""
        with self._lock:
            if self.enabled and self._drawn:
                self.stream.write("\n")
                self.stream.flush()
            self._drawn = False


def write_record(path: str | os.PathLike[str], phase: str, done: int, total: int) -> None:
    """Append one ``phase<TAB>done<TAB>total`` line to ``path`` (the rank's side of a `ProgressFeed`).

    Examples:
        >>> import tempfile
        >>> path = Path(tempfile.mkdtemp()) / "progress"
        >>> write_record(path, "sharded forward", 4, 12)
        >>> path.read_text()
        'sharded forward\\t4\\t12\\n'
    """
    with open(path, "a", encoding="utf-8") as handle:
        handle.write(f"{phase}\t{done}\t{total}\n")


def parse_record(line: str) -> tuple[str, int, int] | None:
    """``(phase, done, total)`` of one complete record line; ``None`` for anything else (a line still being written).

    Examples:
        >>> parse_record("building the model\\t0\\t0\\n")
        ('building the model', 0, 0)
        >>> parse_record("sharded forward\\t4\\n") is None
        True
    """
    if not line.endswith("\n"):
        return None
    parts = line.rstrip("\n").split("\t")
    if len(parts) != 3 or not parts[0]:
        return None
    try:
        return parts[0], int(parts[1]), int(parts[2])
    except ValueError:
        return None


class ProgressFeed:
    """Follows a file of ``phase<TAB>done<TAB>total`` records that another process appends to.

    Between `start` and `stop` a thread reads the file's new complete lines every
    ``interval`` seconds and calls ``on_record(phase, done, total)`` for each, in
    order; `stop` reads what is left once more, so the last record is never
    missed. It may be started again (reading on from where it stopped).

    Args:
        path: the file (it need not exist yet).
        on_record: called with each record, from the feed's thread.
        interval: seconds between reads.

    Examples:
        >>> import tempfile
        >>> path = Path(tempfile.mkdtemp()) / "progress"
        >>> seen = []
        >>> feed = ProgressFeed(path, lambda *record: seen.append(record))
        >>> feed.start()
        >>> write_record(path, "single-process reference", 0, 0)
        >>> write_record(path, "sharded forward", 3, 12)
        >>> feed.stop()
        >>> seen
        [('single-process reference', 0, 0), ('sharded forward', 3, 12)]
    """

    def __init__(
        self, path: str | os.PathLike[str], on_record: Callable[[str, int, int], None], *, interval: float = 0.25
    ) -> None:
        self.path = Path(path)
        self.on_record = on_record
        self.interval = interval
        self._offset = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._read_lock = threading.Lock()

    def start(self) -> None:
        """Start following (a no-op while already started)."""
        if self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="shardext-progress")
        self._thread.start()

    def stop(self) -> None:
        """Stop following, after handing on every complete record written so far."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join(2.0)
            self._thread = None
        self.poll()

    def poll(self) -> None:
        """Read the new complete records now and hand each to ``on_record``."""
        with self._read_lock:
            try:
                with open(self.path, "rb") as handle:
                    handle.seek(self._offset)
                    data = handle.read()
            except OSError:
                return
            end = data.rfind(b"\n") + 1  # a line still being written is read next time
            self._offset += end
            for line in data[:end].decode("utf-8", "replace").splitlines(keepends=True):
                record = parse_record(line)
                if record is not None:
                    self.on_record(*record)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.poll()
