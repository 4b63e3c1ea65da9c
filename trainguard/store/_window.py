"""The circular buffer's window, held by the run writer: a recording of ``buffer=N`` sends the
sink only the newest N executions (and what the recorder pins), not every one it makes."""

from __future__ import annotations

import bisect
import time
from collections import deque
from typing import Any

from trainguard.store._codec import EVICTION_SLACK

# How often the newest executions of a buffered recording reach the sink, which commits them.
SEND_INTERVAL = 0.5


class BufferWindow:
    """Mixin of :class:`trainguard.store._writer.RunWriter`: holds recent records, sends the window."""

    buffer: int
    _window: deque[list]
    _window_n: int
    _window_bad: bool
    _last_send: float
    _sent_max: int
    _sent_all: int
    _send: Any

    def _hold(self, records: list, bad: bool, pins: list | None = None, resend: list | None = None) -> None:
        """Keep executions here and send the sink only those the circular buffer keeps.

        A fast loop makes tens of thousands of executions per second, and with ``buffer=N``
        all but the newest N are evicted anyway: sending every one of them to the sink costs
        the training process several microseconds per op for rows that are deleted a second
        later. So the newest N are sent every ``SEND_INTERVAL`` seconds; older ones stay here
        (up to the eviction slack) and are sent when the recorder pins them (``pins``: the
        chain of a harmful value may be older than the newest N). A batch without ``pins``
        that is ``bad`` (another writer's non-finite batch) sends everything held, so that the
        sink can pin the producers of a NaN that were made long before it.
        """
        if records:
            self._window.append(records)
            self._window_n += len(records)
            limit = self.buffer + EVICTION_SLACK
            while self._window_n - len(self._window[0]) >= limit:
                self._window_n -= len(self._window.popleft())
        if pins is not None:
            # The recorder named what to keep: send those records now (they may be older than
            # the newest N that the next send takes), with the records sent again.
            if pins or resend:
                out = list(resend or [])
                out += [r for r in (self._held(seq) for seq in pins) if r is not None]
                self._send(("exec", out, pins))
                self._send(("commit",))
        elif bad:
            self._window_bad = True
        if (bad and pins is None) or time.monotonic() - self._last_send >= SEND_INTERVAL:
            self._send_window()

    def _held(self, seq: int) -> tuple | None:
        """The record ``seq`` if the window holds it (lists in order, each sorted by seq)."""
        for records in reversed(self._window):
            if records[0][0] <= seq:
                i = bisect.bisect_left(records, seq, key=_seq_of)
                if i < len(records) and records[i][0] == seq:
                    return records[i]
                # ops recorded on several threads may interleave out of order: look through it
                return next((r for r in records if r[0] == seq), None)
        return None

    def _send_window(self) -> None:
        """Send the newest ``buffer`` executions not sent yet (all held ones after a NaN), then commit."""
        self._last_send = time.monotonic()
        if not self._window_n:
            return
        sent = self._sent_max
        if self._window_bad:
            # Everything held and not sent in an earlier such round (the sink ignores repeats):
            # during a NaN storm each execution is sent at most twice, not on every batch.
            done = self._sent_all
            out = [r for records in self._window for r in records if r[0] > done]
            self._window_bad = False
            if out:
                self._sent_all = max(r[0] for r in out)
        else:
            chunks, need = [], self.buffer
            for records in reversed(self._window):
                fresh = records if records[0][0] > sent else [r for r in records if r[0] > sent]
                if len(fresh) > need:
                    fresh = fresh[-need:]
                if fresh:
                    chunks.append(fresh)
                need -= len(fresh)
                if need <= 0 or len(fresh) < len(records):
                    break
            out = [r for records in reversed(chunks) for r in records]
        if not out:
            return
        self._sent_max = max(sent, max(r[0] for r in out))
        self._send(("exec", out))
        self._send(("commit",))


def _seq_of(rec: tuple) -> int:
    return rec[0]
