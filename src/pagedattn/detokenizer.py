"""Incremental detokenisation: a sequence's text grows with its tokens, without decoding the whole output again at
every step (which costs O(length) per step and O(length^2) per request for ``LLMEngine.step`` callers that stream).

Decoding a token alone is wrong for many tokenizers: SentencePiece drops the leading space of the first token it
decodes, and byte-level BPE splits one UTF-8 character over several tokens. So the new text of a step is the
difference between two decodes that start at the same token: ``decode(ids[p:n])`` minus ``decode(ids[p:r])``, where
``ids[p:r]`` are tokens already turned into text and ``ids[r:n]`` the new ones. The window starts at one of the
last few tokens before ``r`` that decodes to some text on its own: a token that vanishes (a skipped special token,
an id the vocabulary lacks, a bare SentencePiece space) would make the next token the first one decoded, and the
tokenizer would drop that token's leading space in one decode and not in the other. Where the last 8 tokens all
vanish, the window starts at 0 (correct, not incremental). While the
new text ends in an incomplete character (U+FFFD), nothing is emitted and the window waits for the next token. If
the longer decode does not extend the shorter one (a tokenizer that cleans up spaces across the boundary), the
whole output is decoded once instead. A finished sequence's text is always one full decode, so final outputs are
exactly ``tokenizer.decode(output_token_ids, skip_special_tokens=True)``.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class _State:
    text: str = ""
    prefix_offset: int = 0  # output tokens [prefix_offset, read_offset): the start of the next decode window
    read_offset: int = 0  # output tokens before read_offset are in ``text``


class IncrementalDetokenizer:
    """The text of each sequence's output tokens, kept per sequence id between steps."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.states: dict[int, _State] = {}

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def text(self, seq_id: int, ids: list[int], final: bool = False) -> str:
        """The text of output tokens ``ids`` of sequence ``seq_id``, whose earlier calls saw a prefix of ``ids``
        (outputs only grow; a shorter list starts over). ``final``: the sequence finished; one full decode, and the
        state is dropped."""
        if final:
            self.states.pop(seq_id, None)
            return self._decode(ids)
        st = self.states.get(seq_id)
        if st is None or len(ids) < st.read_offset:
            st = self.states[seq_id] = _State()
        n = len(ids)
        if n == st.read_offset:
            return st.text
        prefix = self._decode(ids[st.prefix_offset:st.read_offset])
        full = self._decode(ids[st.prefix_offset:n])
        if full.endswith("\ufffd"):  # an incomplete character: wait for the token that completes it
            return st.text
        if full.startswith(prefix):
            st.text += full[len(prefix):]
        else:  # the tokenizer rewrote the boundary: decode everything once
            st.text = self._decode(ids)
        p = n - 1
        while p > 0 and not self._decode(ids[p:p + 1]):
            p = p - 1 if p > n - 8 else 0
        st.prefix_offset, st.read_offset = p, n
        return st.text

    def forget(self, seq_id: int) -> None:
        self.states.pop(seq_id, None)
