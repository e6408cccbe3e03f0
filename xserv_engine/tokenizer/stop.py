"""Stop strings over streamed text: emit only what can no longer turn into a stop string."""


class StopStringMatcher:
    """Finds the first stop string in a stream of text pieces.

    feed() returns the text that is safe to show: a tail that could still be the start of a stop
    string is held back until the next piece settles it, so a stop string never leaks.
    """

    def __init__(self, stops: tuple[str, ...], include_stop: bool):
        self._stops = tuple(s for s in stops if s)
        self._include_stop = include_stop
        self._held = ""

    def feed(self, text: str) -> tuple[str, str | None]:
        """(text safe to emit now, the stop string matched or None). After a match, stop feeding."""
        if not self._stops:
            return text, None
        window = self._held + text
        match = self._earliest_match(window)
        if match is not None:
            start, stop = match
            self._held = ""
            end = start + len(stop) if self._include_stop else start
            return window[:end], stop
        keep = self._longest_stop_prefix_suffix(window)
        self._held = window[len(window) - keep :]
        return window[: len(window) - keep], None

    def flush(self) -> str:
        """Held-back text at the end of generation (when no stop string matched)."""
        held, self._held = self._held, ""
        return held

    def _earliest_match(self, window: str) -> tuple[int, str] | None:
        """(start, stop) of the stop string that begins first; the longest one on a tie."""
        best = None
        for stop in self._stops:
            start = window.find(stop)
            if start >= 0 and (best is None or (start, -len(stop)) < (best[0], -len(best[1]))):
                best = (start, stop)
        return best

    def _longest_stop_prefix_suffix(self, window: str) -> int:
        """Length of the longest tail of window that is a proper prefix of some stop string."""
        longest = 0
        for stop in self._stops:
            for k in range(min(len(stop) - 1, len(window)), longest, -1):
                if window.endswith(stop[:k]):
                    longest = k
                    break
        return longest
