"""Tests of the one progress line (physicsnemo_shardext.tools.progress): drawing, the record file, the feed."""

from __future__ import annotations

import io
import subprocess
import sys
import threading
from pathlib import Path

from physicsnemo_shardext.tools import progress
from physicsnemo_shardext.tools.progress import ProgressBar, ProgressFeed, bar_text, parse_record, write_record

#: Python that loads the module file on its own, as ``module`` (the package's top level imports torch).
_ALONE = (
    "import importlib.util, sys\n"
    f"spec = importlib.util.spec_from_file_location('progress', {str(Path(progress.__file__))!r})\n"
    "module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module)\n"
)


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _clock(*times: float):
    values = iter(times)
    last = [0.0]

    def now() -> float:
        last[0] = next(values, last[0])
        return last[0]

    return now


def test_bar_text_fills_in_proportion_and_clips_at_the_total():
    assert bar_text("sharded forward", 3, 12) == "sharded forward [#####---------------] 3/12"
    assert bar_text("x", 0, 4, width=4) == "x [----] 0/4"
    assert bar_text("x", 4, 4, width=4, unit="ops") == "x [####] 4/4 ops"
    assert bar_text("x", 9, 4, width=4) == "x [####] 4/4"  # never past the total
    assert bar_text("comparing", 5, 0) == "comparing"  # no total: no bar


def test_a_log_gets_only_the_log_texts_one_line_each_with_the_elapsed_seconds():
    log = io.StringIO()
    bar = ProgressBar(log, clock=_clock(100.0, 103.4, 107.0))  # read when made and per line written
    bar.update("fft [#---] 1/4")  # a redraw: nothing in a log
    bar.update("fft [##--] 2/4", log="[2/4] fft done")
    bar.update("fft [##--] 2/4", log="[2/4] fft done")  # the same line twice is written once
    bar.update("conv [###-] 3/4", log="[3/4] conv done")
    bar.close()  # a log needs no line end
    assert log.getvalue() == "[    3s] [2/4] fft done\n[    7s] [3/4] conv done\n"


def test_a_terminal_line_is_redrawn_in_place_and_ended_by_close():
    tty = _Terminal()
    bar = ProgressBar(tty, clock=_clock(0.0, 1.0, 2.0))
    bar.update("fft [#---] 1/4")
    bar.update("fft [##--] 2/4", log="[2/4] fft done")  # a terminal shows the text, not the log line
    bar.close()
    drawn = tty.getvalue()
    assert drawn.startswith("\r[    1s] fft [#---] 1/4")
    assert "\r[    2s] fft [##--] 2/4" in drawn and "done" not in drawn
    assert drawn.endswith("\n") and drawn.count("\n") == 1
    assert all(len(part) == 78 for part in drawn.rstrip("\n").split("\r")[1:])  # padded over the previous text


def test_a_disabled_bar_draws_nothing():
    for stream in (io.StringIO(), _Terminal()):
        bar = ProgressBar(stream, enabled=False)
        bar.update("x", log="x")
        bar.close()
        assert stream.getvalue() == ""


def test_records_round_trip_and_partial_lines_are_not_records(tmp_path):
    path = tmp_path / "progress"
    write_record(path, "sharded forward", 4, 12)
    write_record(path, "2 ranks: fft", 1, 3)
    lines = path.read_text().splitlines(keepends=True)
    assert [parse_record(line) for line in lines] == [("sharded forward", 4, 12), ("2 ranks: fft", 1, 3)]
    assert parse_record("sharded forward\t4\t12") is None  # no line end yet: still being written
    assert parse_record("phase\tfour\t12\n") is None
    assert parse_record("\t1\t2\n") is None


def test_the_feed_hands_on_every_record_in_order_and_the_last_at_stop(tmp_path):
    path = tmp_path / "progress"
    seen: list[tuple[str, int, int]] = []
    arrived = threading.Event()

    def on_record(phase: str, done: int, total: int) -> None:
        seen.append((phase, done, total))
        arrived.set()

    feed = ProgressFeed(path, on_record, interval=0.01)
    feed.start()  # the file does not exist yet
    write_record(path, "building the model", 0, 0)
    assert arrived.wait(5.0)
    with open(path, "a") as handle:
        handle.write("single-process reference\t0\t0\nsharded forw")  # a writer caught mid-line
    feed.poll()
    assert seen == [("building the model", 0, 0), ("single-process reference", 0, 0)]
    with open(path, "a") as handle:
        handle.write("ard\t2\t8\n")
    write_record(path, "done", 8, 8)
    feed.stop()  # reads what is left: the last record is never lost
    assert seen[2:] == [("sharded forward", 2, 8), ("done", 8, 8)]
    write_record(path, "again", 1, 1)
    feed.start()  # started again, it reads on from where it stopped
    feed.stop()
    assert seen[4:] == [("again", 1, 1)]


def test_records_written_by_another_process_reach_the_bar(tmp_path):
    path = tmp_path / "progress"
    log = io.StringIO()
    bar = ProgressBar(log, clock=lambda: 0.0)
    feed = ProgressFeed(
        path, lambda phase, done, total: bar.update(bar_text(phase, done, total), log=f"[{done}/{total}] {phase} done")
    )
    feed.start()
    writer = _ALONE + f"for done in (1, 2):\n    module.write_record({str(path)!r}, f'task {{done}}', done, 2)\n"
    subprocess.run([sys.executable, "-c", writer], check=True, timeout=60)
    feed.stop()
    assert log.getvalue().splitlines() == ["[    0s] [1/2] task 1 done", "[    0s] [2/2] task 2 done"]


def test_the_module_needs_no_torch():
    code = _ALONE + "print(module.bar_text('x', 1, 2, width=2), 'torch' in sys.modules)\n"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.split() == ["x", "[#-]", "1/2", "False"]
