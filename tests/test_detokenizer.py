"""Incremental detokenisation (``pagedattn.detokenizer``): at every step the streamed text equals a full decode of
the tokens so far (wherever that decode does not end in an incomplete character), the final text is exactly the
full decode, and the tokens decoded per step stay bounded instead of growing with the output."""
from __future__ import annotations

import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from pagedattn.detokenizer import IncrementalDetokenizer

REPO = Path(__file__).resolve().parents[1]


def byte_level_bpe():
    """The small OPT's tokenizer (byte-level BPE: one UTF-8 character may span several tokens)."""
    return PreTrainedTokenizerFast(tokenizer_file=str(REPO / "models" / "opt-stdlib" / "tokenizer.json"),
                                   eos_token="</s>", pad_token="<pad>", unk_token="<unk>", bos_token="<s>")


def metaspace_words():
    """A SentencePiece-like tokenizer: words marked with a leading "▁" that decodes to a space, except at the start
    of a decode (the case where decoding the new token alone loses its space)."""
    words = ["<unk>", "</s>", "▁the", "▁cat", "▁sat", "s", "▁on", ".", "▁a", "mat", "▁é", "ü", "▁", "42"]
    # ids 14-15 are missing from the vocabulary (a model's vocabulary may be larger than its tokenizer's)
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>")


@pytest.mark.parametrize("make", [byte_level_bpe, metaspace_words])
def test_streamed_text_equals_a_full_decode_at_every_step(make):
    tokenizer = make()
    vocab = len(tokenizer) + 2
    rng = random.Random(0)
    detok = IncrementalDetokenizer(tokenizer)
    for seq_id in range(6):  # random ids: byte tokens that split characters, special tokens, words
        ids: list[int] = []
        for _ in range(120):
            ids.append(rng.randrange(vocab))
            text = detok.text(seq_id, ids)
            full = tokenizer.decode(ids, skip_special_tokens=True)
            if not full.endswith("\ufffd"):
                assert text == full, (seq_id, ids)
            else:  # waiting for the rest of a character: what was streamed is a prefix
                assert full.startswith(text)
        assert detok.text(seq_id, ids, final=True) == tokenizer.decode(ids, skip_special_tokens=True)
        assert seq_id not in detok.states
    assert detok.text(9, []) == ""


def test_a_shorter_output_starts_over_and_forget_drops_the_state():
    tokenizer = metaspace_words()
    detok = IncrementalDetokenizer(tokenizer)
    a, b = [2, 3, 4, 6, 8, 9], [8, 9, 7]
    for k in range(1, len(a) + 1):
        detok.text(0, a[:k])
    assert detok.text(0, a) == "the cat sat on amat" == tokenizer.decode(a)
    assert detok.text(0, b) == tokenizer.decode(b)  # a beam-like rewrite to a shorter history
    detok.forget(0)
    assert 0 not in detok.states


def test_work_per_step_is_bounded():
    """Tokens decoded per step stay a handful: over a 600-token output the total stays linear (a full decode per
    step would be 180,300 tokens)."""
    tokenizer = byte_level_bpe()
    decoded = []
    detok = IncrementalDetokenizer(tokenizer)
    real = detok._decode
    detok._decode = lambda ids: decoded.append(len(ids)) or real(ids)
    ids = tokenizer("def f(x):\n    return x + 1  # é ü\n" * 60)["input_ids"][:600]
    assert len(ids) == 600
    for k in range(1, len(ids) + 1):
        detok.text(0, ids[:k])
    assert detok.states[0].text == tokenizer.decode(ids, skip_special_tokens=True)
    assert sum(decoded) < 10 * len(ids) and max(decoded) < 16
