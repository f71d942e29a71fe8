"""The text layer: emitted token ids -> text pieces, decoded incrementally, cut at stop strings.

It never sees the decoding loop, only the blocks of tokens the loop emits.  Each token is decoded with
a window of a few tokens (not the whole output again), so streaming ``n`` tokens costs O(n) tokenizer
work instead of O(n^2); the text equals ``tokenizer.decode(all ids, skip_special_tokens=True)``.
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Token ids -> text, decoding only a short window of recent tokens per new token.

    The text a token adds is ``decode(ids[prefix:]) - decode(ids[prefix:read])``, where ``read`` is the
    end of the text emitted so far and ``prefix`` the ``read`` before it (the incremental detokenizer of
    vLLM / Hugging Face TGI).  The window starts one emission back so that tokenizers which drop a leading
    space at the start of a decode (SentencePiece) still space words right.  Text ending in an
    incomplete UTF-8 sequence (decoded as U+FFFD) is held back until a later token completes it; the complete
    characters before those bytes are known already (:attr:`pending`), and :attr:`ends` counts them, so a
    token's end is where its own complete characters end.

    Attributes:
        ids: every token id added.
        text: the text of ``ids`` emitted so far (held-back bytes excluded until :meth:`flush`).
        pending: complete characters decoded after ``text``, held back with the incomplete bytes after them.
        ends: ``len(text + pending)`` after each token [characters], one entry per id.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.text = ""
        self.pending = ""
        self.ends: list[int] = []
        self._prefix = self._read = 0

    @property
    def known_text(self) -> str:
        """``text + pending``: every complete character of ``ids`` (a prefix of the final text)."""
        return self.text + self.pending

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens) if ids else ""

    def _step(self, final: bool) -> str:
        before = self._decode(self.ids[self._prefix:self._read])
        now = self._decode(self.ids[self._prefix:])
        if now.endswith(REPLACEMENT) and not final:
            stable = now.rstrip(REPLACEMENT)
            self.pending = stable[len(before):] if len(stable) > len(before) else ""
            return ""
        if len(now) <= len(before):
            return ""
        new = now[len(before):]
        self._prefix, self._read = self._read, len(self.ids)
        self.text += new
        self.pending = ""
        return new

    def add(self, token: int) -> str:
        """Append ``token``; returns the text it completes (may be empty)."""
        self.ids.append(int(token))
        new = self._step(final=False)
        self.ends.append(len(self.text) + len(self.pending))
        return new

    def flush(self) -> str:
        """Emit held-back text as the full decode shows it (an incomplete character becomes U+FFFD)."""
        new = self._step(final=True) if self.ids else ""
        self.pending = ""
        if self.ends:
            self.ends[-1] = len(self.text)
        return new


def find_stop(text: str, stops, start: int = 0) -> int | None:
    """Index of the first occurrence in ``text[start:]`` of any of ``stops`` (``None`` if none)."""
    hits = [i for i in (text.find(s, start) for s in stops) if i >= 0]
    return min(hits) if hits else None


class StopStringText:
    """The text of a growing output, cut just before the first stop string; tracks what may be shown.

    Text within ``max(len(stop)) - 1`` characters of the end is held back (a stop string may start
    there).  When a stop string completes, the output keeps the fewest tokens whose text contains it and
    the text ends just before it.

    Attributes:
        stopped: a stop string was found.
        token_ids: the output's tokens (cut after the token completing a stop string).
        text: the output's text, its complete characters (cut before the stop string once ``stopped``).
    """

    def __init__(self, tokenizer, stops: tuple[str, ...] = ()):
        self.detok = IncrementalDetokenizer(tokenizer)
        self.stops = tuple(stops)
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.shown = 0
        self.stopped = False
        self._cut: int | None = None

    @property
    def token_ids(self) -> list[int]:
        return self.detok.ids

    @property
    def text(self) -> str:
        return self.detok.known_text if self._cut is None else self.detok.known_text[:self._cut]

    def add(self, block: list[int]) -> str:
        """Add a block of emitted tokens; returns the text newly safe to show (may be empty; after a stop string,
        always: the output has ended)."""
        if self.stopped:
            return ""
        first = len(self.detok.ids)
        for tok in block:
            self.detok.add(tok)
        return self._advance(first, final=False)

    def finish(self) -> str:
        """End of output: returns all text not shown yet (held-back characters included)."""
        if self.stopped:
            return ""
        first = len(self.detok.ids) - 1
        self.detok.flush()
        return self._advance(max(first, 0), final=True)

    def _advance(self, first: int, final: bool) -> str:
        text, start = self.detok.known_text, max(0, self.shown - self.hold)
        if self.stops and find_stop(text, self.stops, start) is not None:
            # the fewest tokens whose text contains a stop string, and the text just before it
            k = next(k for k in range(first + 1, len(self.detok.ids) + 1)
                     if find_stop(text[:self.detok.ends[k - 1]], self.stops, start) is not None)
            self._cut = find_stop(text[:self.detok.ends[k - 1]], self.stops, start)
            del self.detok.ids[k:], self.detok.ends[k:]
            self.stopped = True
            safe = self._cut
        else:
            safe = len(text) if final or not self.stops else len(text) - self.hold
        if safe <= self.shown:
            return ""
        piece = text[self.shown:safe]
        self.shown = safe
        return piece
