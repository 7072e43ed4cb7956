"""Turning generated tokens into text that is safe to show: whole UTF-8 characters, no stop string.

A token is a run of bytes, not of characters: SentencePiece byte-fallback tokens (`<0xF0>`) and
byte-level BPE tokens can end in the middle of an emoji or a CJK character. Bytes go through an
incremental UTF-8 decoder that keeps an unfinished character until its last byte arrives.

Stop strings are matched on the decoded text, so one may span several tokens. The assembler holds
back the longest tail of the text that is still the beginning of some stop string; everything
before it can never become part of a match and is released. When a stop string appears, the text
before it is released and the rest (the stop string and anything after it) is dropped. Generation
stops at the first stop string to be completed, as it would if the text came one character at a time.
"""

from __future__ import annotations

import codecs
from typing import Callable


class TextAssembler:
    """Feed token ids in order with `push`; it returns the text that may be shown now."""

    def __init__(self, token_bytes: Callable[[int], bytes], stop: list[str] | tuple[str, ...] = ()):
        self.token_bytes = token_bytes
        self.stop = [s for s in stop if s]
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.pending = ""  # decoded text not released yet
        self.stopped = False  # a stop string was found: push must not be called again

    def push(self, token_id: int) -> str:
        """Add one token and return the text it releases (often "", sometimes several tokens' worth)."""
        if self.stopped:
            raise RuntimeError("push after a stop string was found")
        self.pending += self.decoder.decode(self.token_bytes(token_id))
        return self._release()

    def finish(self) -> str:
        """The end of generation without a stop string: release everything, unfinished bytes as U+FFFD."""
        if self.stopped:
            return ""
        self.pending += self.decoder.decode(b"", final=True)
        text, self.pending = self.pending, ""
        return text

    def _release(self) -> str:
        match = self._first_stop()
        if match is not None:
            text = self.pending[:match]
            self.pending = ""
            self.stopped = True
            return text
        keep = self._held_tail()
        cut = len(self.pending) - keep
        text, self.pending = self.pending[:cut], self.pending[cut:]
        return text

    def _first_stop(self) -> int | None:
        """Where the stop string that was completed first begins (the longer one on a tie).

        Choosing by end, not start, makes the result the same however the text was cut into tokens.
        """
        found = [(i + len(s), i) for s, i in ((s, self.pending.find(s)) for s in self.stop) if i >= 0]
        return min(found)[1] if found else None

    def _held_tail(self) -> int:
        """Length of the longest tail of `pending` that a stop string begins with."""
        longest = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(self.pending)), longest, -1):
                if self.pending.endswith(s[:n]):
                    longest = n
                    break
        return longest
