"""Stop strings matched across token boundaries and never emitted.

Text that could be the beginning of a stop string is held back until the next delta decides it."""

from __future__ import annotations


class StopMatcher:
    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.held = ""

    def push(self, text: str) -> tuple[str, bool]:
        """Add a text delta -> (text safe to emit now, whether a stop string was hit)."""
        if not self.stops:
            return text, False
        full = self.held + text  # held is a proper prefix of some stop: a match starts at or after it
        cut = min((i for i in (full.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.held = ""
            return full[:cut], True
        keep = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(full)), keep, -1):
                if full.endswith(s[:n]):
                    keep = n
                    break
        self.held = full[len(full) - keep:] if keep else ""
        return full[: len(full) - keep], False

    def finish(self, tail: str) -> tuple[str, bool]:
        """End of stream: the detokenizer's last text -> (text to emit, whether a stop string was hit). A U+FFFD
        ending it stands for a character the stream cut in half: emitted, never matched as a stop string."""
        whole = tail.rstrip("\ufffd")
        text, hit = self.push(whole)
        if hit:
            return text, True
        held, self.held = self.held, ""  # no stop string: the held text is ordinary output
        return text + held + tail[len(whole):], False
