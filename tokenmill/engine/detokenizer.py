"""Incremental detokenization and stop strings, one request at a time (front-end side)."""

from __future__ import annotations

# Prompt tokens decoded along with the first output tokens, so that tokenizers that mark word
# boundaries on the token (SentencePiece "▁", byte-level "Ġ") render the first word's space right.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Decodes a short window (`prefix_offset:`) rather than everything each step, and holds text
    back while it ends in an incomplete UTF-8 sequence (decoded as U+FFFD).
    """

    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True,
                 stop: list[str] | None = None, include_stop_str_in_output: bool = False):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""
        self.stop = [s for s in (stop or []) if s]
        self.include_stop = include_stop_str_in_output
        self.max_stop_len = max((len(s) for s in self.stop), default=0)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add_tokens(self, token_ids: list[int]) -> str | None:
        """Append tokens; returns the stop string if one now appears in the text (text is cut there)."""
        for token in token_ids:
            self.ids.append(token)
            prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
            full = self._decode(self.ids[self.prefix_offset :])
            if len(full) > len(prefix) and not full.endswith("\ufffd"):
                delta = full[len(prefix) :]
                self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
                stop = self._append(delta)
                if stop is not None:
                    return stop
        return None

    def _append(self, delta: str) -> str | None:
        start = max(0, len(self.text) - self.max_stop_len + 1)
        self.text += delta
        if not self.stop:
            return None
        for stop in self.stop:
            idx = self.text.find(stop, start)
            if idx != -1:
                self.text = self.text[: idx + len(stop)] if self.include_stop else self.text[:idx]
                return stop
        return None

    def streamable_length(self, finished: bool) -> int:
        """How much of the text may be sent now: all of it when finished; otherwise hold back
        what could still turn out to be the start of a stop string."""
        if finished or not self.stop or self.include_stop:
            return len(self.text)
        return max(0, len(self.text) - self.max_stop_len + 1)
