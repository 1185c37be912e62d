"""Choosing a system is configuration (issue 49): ``EngineArgs.kv_manager`` names it (``memory.systems``), the
constructor's keywords are ``EngineArgs``' fields, and an option that a KV manager passed built would ignore is
refused, naming it."""
import dataclasses
import inspect

import pytest

from pagedattn.engine import EngineArgs, LLMEngine
from pagedattn.memory import BlockManager
from pagedattn.memory.contiguous import ContiguousKVManager
from pagedattn.sequence import SamplingParams
from tiny_models import tiny_opt


@pytest.fixture(scope="module")
def model():
    return tiny_opt()


def test_the_constructor_takes_exactly_engine_args_fields():
    params = inspect.signature(LLMEngine).parameters
    fields = [f.name for f in dataclasses.fields(EngineArgs)]
    assert [p for p in params if p not in ("model", "tokenizer")] == fields
    assert all(params[f].default == EngineArgs.__dataclass_fields__[f].default for f in fields if f != "kv_manager")


@pytest.mark.parametrize("system, policy, static", [("paged", None, False), ("orca_max", "max", False),
                                                    ("orca_pow2", "pow2", False), ("orca_oracle", "oracle", False),
                                                    ("static", "max", True)])
def test_each_system_by_name_on_one_slot_budget(model, system, policy, static):
    e = LLMEngine(model, kv_manager=system, num_slots=256, block_size=8, max_model_len=64, attention_backend="torch")
    assert e.scheduler.static_batching is static
    if policy is None:
        assert isinstance(e.kv, BlockManager) and e.kv.pool_counts().gpu_blocks == 256 // 8
    else:
        assert isinstance(e.kv, ContiguousKVManager) and e.kv.policy == policy
        assert e.kv.pool_counts().gpu_blocks == 256  # slots: the same budget
    out = None
    e.add_request("r", [1, 2, 3], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    while e.has_unfinished_requests():
        out = e.step(finished_only=True) or out
    assert out[0].outputs[0].token_ids and e.kv.num_used_gpu_blocks == 0


def test_options_a_built_manager_would_ignore_are_refused(model):
    kv = BlockManager(8, 32)
    for kw, name in [(dict(block_size=16), "block_size=16"), (dict(num_gpu_blocks=4), "num_gpu_blocks=4"),
                     (dict(num_slots=64), "num_slots=64"), (dict(num_cpu_blocks=4), "num_cpu_blocks=4"),
                     (dict(kv_cache_memory=1 << 20), "kv_cache_memory"),
                     (dict(enable_prefix_caching=True), "enable_prefix_caching=True")]:
        with pytest.raises(ValueError, match=f"{name}.*would be ignored"):
            LLMEngine(model, kv_manager=kv, attention_backend="torch", **kw)
    e = LLMEngine(model, kv_manager=kv, block_size=8, attention_backend="torch")  # the manager's own: no conflict
    assert e.kv is kv and e.args.kv_manager == "paged"


def test_unknown_system_and_a_budget_given_twice_are_errors(model):
    with pytest.raises(ValueError, match="unknown system kv_manager='tgi'"):
        LLMEngine(model, kv_manager="tgi")
    with pytest.raises(ValueError, match="num_slots or num_gpu_blocks, not both"):
        LLMEngine(model, num_slots=64, num_gpu_blocks=4, attention_backend="torch")


def test_from_engine_args_names_the_system(model):
    e = LLMEngine.from_engine_args(model, EngineArgs(kv_manager="orca_oracle", num_slots=128, max_model_len=64,
                                                     attention_backend="torch"))
    assert isinstance(e.kv, ContiguousKVManager) and e.kv.policy == "oracle"
