"""KV arithmetic: the study note's and the paper's worked examples."""
import pytest
from transformers import LlamaConfig, OPTConfig

from pagedattn.config import ModelSpec, SchedulerConfig, block_fills, blocks_needed, format_bytes, last_block_fill
from pagedattn.repro.paper import LLAMA2_70B, LLAMA_7B, OPT_13B, paper_slots


def test_opt13b_800kb_per_token_and_1_6gb_per_request():
    assert OPT_13B.kv_bytes_per_token == 2 * 5120 * 40 * 2 == 800 * 1024
    assert format_bytes(OPT_13B.kv_bytes_per_token) == "800 KB"
    assert format_bytes(OPT_13B.kv_bytes(2048)) == "1.6 GB"


def test_llama2_70b_gqa8_320kb_and_7b_512kb():
    assert LLAMA2_70B.kv_bytes_per_token == 2 * 80 * 8 * 128 * 2 == 320 * 1024
    assert LLAMA_7B.kv_bytes_per_token == 512 * 1024


def test_block_examples():
    assert blocks_needed(40, 16) == 3 and block_fills(40, 16) == [16, 16, 8]
    assert blocks_needed(1000, 16) == 63 and last_block_fill(1000, 16) == 0.5
    assert blocks_needed(0, 16) == 0 and last_block_fill(32, 16) == 1.0


def test_paper_table1_slots():
    assert round(paper_slots() / 1000, 1) == 15.7


def test_spec_from_hf_configs():
    opt = OPTConfig(hidden_size=5120, num_attention_heads=40, num_hidden_layers=40, max_position_embeddings=2048)
    assert ModelSpec.from_hf_config(opt, dtype="float16").kv_bytes_per_token == OPT_13B.kv_bytes_per_token
    llama = LlamaConfig(hidden_size=8192, num_attention_heads=64, num_key_value_heads=8, num_hidden_layers=80,
                        max_position_embeddings=4096)
    spec = ModelSpec.from_hf_config(llama, dtype="bfloat16")
    assert spec.kv_bytes_per_token == LLAMA2_70B.kv_bytes_per_token and spec.max_model_len == 4096
    assert ModelSpec.from_hf_config(llama, dtype="float32").kv_bytes_per_token == 2 * LLAMA2_70B.kv_bytes_per_token


@pytest.mark.parametrize("bad", [0, -1, 1.5])
def test_bad_block_size(bad):
    with pytest.raises(ValueError, match="block_size"):
        blocks_needed(10, bad)


def test_bad_configs():
    with pytest.raises(ValueError, match="preemption_mode"):
        SchedulerConfig(preemption_mode="drop")
