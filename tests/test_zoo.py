"""opt-stdlib, the small OPT trained on the Python stdlib (project addition, used for §6.3-style beam search results).

Trains the quick variant into a pytest tmp folder (about 40 s on 2 cores) and checks the committed full checkpoint.
"""
from __future__ import annotations

import json
import shutil
import warnings

import pytest
import torch
from transformers import OPTForCausalLM, PreTrainedTokenizerFast

from pagedattn.repro.experiments import zoo

QUICK_RATIO = 2.0  # the quick model's validation perplexity must be at least 2x below the unigram model's
FULL_RATIO = 5.0   # the committed model's: at least 5x below


@pytest.fixture(scope="module")
def quick_dir(tmp_path_factory):
    return zoo.train("opt-stdlib", quick=True, root=tmp_path_factory.mktemp("models"), progress=False)


@pytest.fixture(scope="module")
def committed_dir():
    path = zoo.model_path("opt-stdlib")
    assert (path / "record.json").is_file(), f"the committed checkpoint is missing: {path}"
    return path


@pytest.mark.slow
def test_quick_model_beats_unigram_and_reproduces_its_record(quick_dir):
    record = zoo.verify(quick_dir)
    ev = record["eval"]
    assert ev["val_ppl"] * QUICK_RATIO <= ev["unigram_val_ppl"], ev

    # Recompute the validation perplexity from what was saved (fp16 weights, the saved tokenizer).
    model, tok = zoo.load_model("opt-stdlib", quick=True, root=quick_dir.parent)
    cfg = zoo.get_config("opt-stdlib", quick=True)
    root, rels = zoo.corpus_files()
    _, val_rels = zoo.split_files(rels, cfg)
    x, y = zoo.val_windows(zoo.encode_stream(tok, zoo.read_texts(root, val_rels)), cfg.seq_len)
    assert y.numel() == record["corpus"]["tokens"]["val_scored"]
    assert zoo.perplexity(model, x, y) == pytest.approx(ev["val_ppl"], rel=1e-3)


@pytest.mark.slow
def test_quick_model_loads_as_a_plain_hf_checkpoint(quick_dir):
    model = OPTForCausalLM.from_pretrained(quick_dir, dtype=torch.float32)
    tok = PreTrainedTokenizerFast.from_pretrained(quick_dir)
    text = "class Foo:\n    def __init__(self, x=1):\n        self.x = x  # é\n"
    ids = tok(text).input_ids
    assert ids[0] == tok.eos_token_id == model.config.bos_token_id == 2  # OPT convention: </s> first
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert max(ids) < model.config.vocab_size


def test_split_is_by_file_and_deterministic():
    _, rels = zoo.corpus_files()
    full, quick = zoo.get_config("opt-stdlib"), zoo.get_config("opt-stdlib", quick=True)
    train, val = zoo.split_files(rels, full)
    assert not set(train) & set(val) and len(train) + len(val) == len(rels)
    assert 0.02 < len(val) / len(rels) < 0.10
    assert (train, val) == zoo.split_files(list(rels), full)
    q_train, q_val = zoo.split_files(rels, quick)
    assert q_val == val and set(q_train) <= set(train)
    assert not any(part in zoo.SKIP_DIRS for r in rels for part in r.split("/")[:-1])


def test_committed_checkpoint_verifies_loads_and_generates(committed_dir):
    record = zoo.verify(committed_dir)
    assert record["eval"]["val_ppl"] * FULL_RATIO <= record["eval"]["unigram_val_ppl"], record["eval"]
    assert sum((committed_dir / f).stat().st_size for f in record["sha256"]) <= 20 * 2**20
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, tok = zoo.load_model("opt-stdlib")
    assert not [w for w in caught if "differs from zoo.py" in str(w.message)]  # the record matches zoo.py's config
    assert isinstance(model, OPTForCausalLM) and model.dtype == torch.float32
    ids = tok("def __init__(self", return_tensors="pt").input_ids
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                         pad_token_id=tok.pad_token_id)
    assert out.shape == (1, ids.shape[1] + 8)
    assert isinstance(tok.decode(out[0]), str)


def _copy_committed(committed_dir, tmp_path):
    dst = tmp_path / "opt-stdlib"
    shutil.copytree(committed_dir, dst)
    return dst


def test_corrupted_checkpoint_raises_with_retrain_hint(committed_dir, tmp_path):
    f = _copy_committed(committed_dir, tmp_path) / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.raises(zoo.CheckpointError, match=r"make model.*python -m pagedattn\.repro\.experiments\.zoo train opt-stdlib"):
        zoo.load_model("opt-stdlib", root=tmp_path)


def test_truncated_checkpoint_raises(committed_dir, tmp_path):
    f = _copy_committed(committed_dir, tmp_path) / "model.safetensors"
    with open(f, "r+b") as fh:
        fh.truncate(f.stat().st_size // 2)
    with pytest.raises(ValueError, match="truncated"):
        zoo.load_model("opt-stdlib", root=tmp_path)


def test_missing_record_raises(committed_dir, tmp_path):
    (_copy_committed(committed_dir, tmp_path) / "record.json").unlink()
    with pytest.raises(zoo.CheckpointError, match="record.json"):
        zoo.load_model("opt-stdlib", root=tmp_path)


def test_unknown_name_lists_known_models(tmp_path):
    with pytest.raises(ValueError, match="opt-stdlib"):
        zoo.load_model("gpt-17", root=tmp_path)
    with pytest.raises(ValueError, match="known models"):
        zoo.model_path("nope")
