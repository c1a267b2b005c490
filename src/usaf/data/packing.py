"""Packing documents into fixed-length training sequences, one stream per source.

Documents of one source are concatenated (each already ends with an EOS separator) and cut into
windows of ``seq_len`` tokens; a chat conversation that fits in a window is never cut (``add_whole``).
With ``stride`` > 0, consecutive windows overlap by ``stride`` tokens and the repeated tokens get
label -100 in the later window, so every token is scored exactly once but with more left context.
Labels are unshifted (Hugging Face convention: the model shifts them); -100 means "no loss here".
"""

from __future__ import annotations

from dataclasses import dataclass, field

IGNORE_INDEX = -100
OPEN_WINDOWS = 16  # windows of whole documents open at once: 16 windows of seq_len tokens a source, at most


@dataclass
class Sequence:
    input_ids: list[int]
    labels: list[int]
    source: str

    @property
    def loss_tokens(self) -> int:
        """Positions with a loss (:func:`scored_targets`): the first one's label has no earlier position to predict
        it from (labels are unshifted), which this counted (found in review)."""
        return scored_targets(self.labels)


def scored_targets(labels: list[int]) -> int:
    """Positions with a loss: labels 1.. not -100 (label 0 has no earlier position to predict it)."""
    return max(len(labels) - 1, 0) - labels[1:].count(IGNORE_INDEX)  # list.count: one C pass over a long line


@dataclass
class SourcePacker:
    """Accumulates one source's tokens and emits full windows as soon as they exist.

    The buffer is consumed through a start offset and compacted only when the consumed head
    outgrows the rest, so a long document costs O(tokens), not O(tokens x windows).
    """

    source: str
    seq_len: int
    stride: int = 0
    _ids: list[int] = field(default_factory=list)
    _labels: list[int] = field(default_factory=list)
    _start: int = 0  # first buffered token not yet consumed
    _fresh: int = 0  # buffered tokens not yet emitted in any window
    _windows: list[Sequence] = field(default_factory=list)  # open windows of whole documents (add_whole)

    def __post_init__(self) -> None:
        if not 0 <= self.stride < self.seq_len:
            raise ValueError("stride must be in [0, seq_len)")

    def add(self, ids: list[int], labels: list[int]) -> list[Sequence]:
        self._ids.extend(ids)
        self._labels.extend(labels)
        self._fresh += len(ids)
        out = []
        step = self.seq_len - self.stride
        while len(self._ids) - self._start >= self.seq_len:
            start, end = self._start, self._start + self.seq_len
            labels_window = self._labels[start:end]
            out.append(Sequence(self._ids[start:end], labels_window, self.source))
            self._start += step
            self._fresh = len(self._ids) - end
            # The overlap kept for the next window was scored in this one.
            self._labels[self._start : end] = [IGNORE_INDEX] * self.stride
        if self._start > len(self._ids) // 2:
            del self._ids[: self._start], self._labels[: self._start]
            self._start = 0
        return out

    def add_whole(self, ids: list[int], labels: list[int]) -> list[Sequence]:
        """Add a document not to be cut where it fits in one window: a chat conversation cut at a window's end trained
        its second part's replies without their question (about 1 in 20 conversations; found in review).

        Whole documents fill windows of their own, apart from the text stream: each goes into the open window it
        fills best (best fit), and where none has room a new window opens, the fullest of :data:`OPEN_WINDOWS` being
        emitted to make room (closing a window at the first document that did not fit left about half a document of
        padding in each). One longer than a window is cut as text is; its last, short piece is placed like a whole
        document. Returns the windows emitted.
        """
        out: list[Sequence] = []
        if len(ids) > self.seq_len:
            cutter = SourcePacker(self.source, self.seq_len, self.stride)
            out += cutter.add(ids, labels)
            if (rest := cutter.flush()) is None:
                return out
            ids, labels = rest.input_ids, rest.labels
        room = [(self.seq_len - len(w.input_ids), i) for i, w in enumerate(self._windows)]
        fits = [(left, i) for left, i in room if left >= len(ids)]
        if fits:
            window = self._windows[min(fits)[1]]
            window.input_ids += ids
            window.labels += labels
            return out
        if len(self._windows) == OPEN_WINDOWS:
            out.append(self._windows.pop(min(room)[1]))
        self._windows.append(Sequence(list(ids), list(labels), self.source))
        return out

    def close(self) -> list[Sequence]:
        """Every window still open: the text stream's last (:meth:`flush`) and those of whole documents."""
        last = self.flush()
        windows, self._windows = self._windows, []
        return ([last] if last is not None else []) + [w for w in windows if len(w.input_ids) >= 2]

    def flush(self) -> Sequence | None:
        """The final, shorter window, if it holds tokens no earlier window had."""
        ids, labels = self._ids[self._start :], self._labels[self._start :]
        fresh = self._fresh
        self._ids, self._labels, self._start, self._fresh = [], [], 0, 0
        if fresh <= 0 or len(ids) < 2:
            return None
        return Sequence(ids, labels, self.source)
