"""Bad inputs get clear errors that name the input, raised before any work is done: traces, checkpoint folders,
and every experiment's parameters (``run(quick, **params)`` builds them the same way)."""
import math

import numpy as np
import pytest

from pagedattn.repro.experiments import attention_kernel, block_size, kv_waste, preemption, shared_prefix, sharing, throughput
from pagedattn.repro.experiments import FROM_ZERO
from pagedattn.model import load_model
from pagedattn.repro.workloads.traces import make_trace


@pytest.mark.parametrize("args,match", [
    (("sharegpt", 0), r"make_trace\('sharegpt', num_requests=0\): num_requests must be an integer >= 1"),
    (("sharegpt", -5), "num_requests=-5"),
    (("alpaca", 2.5), "num_requests=2.5"),
    (("wikipedia", 3), "unknown trace 'wikipedia'; known: \\[.*'sharegpt'.*'alpaca'\\]"),
    (("sharegpt", 3, -1.0), r"rate=-1.0\): the request rate must be > 0"),
    (("sharegpt", 3, 0), "rate=0"),
    (("sharegpt", 3, math.nan), "rate=nan"),
])
def test_make_trace(args, match):
    with pytest.raises(ValueError, match=match):
        make_trace(*args)


def test_make_trace_takes_numpy_counts():
    assert len(make_trace("alpaca", np.int64(3))) == 3


def test_load_model_needs_a_local_folder_with_config_json(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="folder has no config.json"):
        load_model(tmp_path)
    with pytest.raises(FileNotFoundError, match=f"load_model\\('{tmp_path / 'nope'}'\\): .*does not exist"):
        load_model(tmp_path / "nope")


PARAMS = [kv_waste.Params, block_size.Params, preemption.Params, shared_prefix.Params, sharing.Params,
          throughput.SimParams, throughput.RealParams]


@pytest.mark.parametrize("make", PARAMS, ids=lambda p: f"{p.__module__.rsplit('.', 1)[-1]}.{p.__name__}")
def test_experiment_parameters(make):
    """Defaults (full and quick) are valid; a negative seed, a zero count, a non-positive rate or an empty sweep in
    any field is a ValueError naming the experiment and the field."""
    where = f"{make.__module__.rsplit('.', 1)[-1]}.{make.__name__}"
    full = make.make(False)
    make.make(True)
    with pytest.raises(ValueError, match=f"{where}.seed must be an integer >= 0, got -1"):
        make.make(True, seed=-1)
    for name, value in vars(full).items():
        if isinstance(value, (list, tuple)) and value and isinstance(value[0], (int, float)):
            with pytest.raises(ValueError, match=f"{where}.{name} must not be empty"):
                make.make(True, **{name: type(value)()})
        elif isinstance(value, int) and not isinstance(value, bool) and name in FROM_ZERO:
            with pytest.raises(ValueError, match=f"{where}.{name} must be an integer >= 0, got -1"):
                make.make(True, **{name: -1})
        elif isinstance(value, int) and not isinstance(value, bool):
            with pytest.raises(ValueError, match=f"{where}.{name} must be an integer >= 1, got 0"):
                make.make(True, **{name: 0})
        elif isinstance(value, float):
            with pytest.raises(ValueError, match=f"{where}.{name} must be > 0, got -1.0"):
                make.make(True, **{name: -1.0})
        elif isinstance(value, dict) and value and all(isinstance(v, (int, float, list)) for v in value.values()):
            key = next(iter(value))
            bad = {**value, key: [0.0] if isinstance(value[key], list) else 0.0}
            with pytest.raises(ValueError, match=f"{where}.{name}\\['{key}'\\]"):
                make.make(True, **{name: bad})
    with pytest.raises(TypeError, match="unexpected keyword argument 'num_reqests'"):  # a typo is named too
        make.make(True, num_reqests=10)


def test_kernel_benchmark_config():
    with pytest.raises(ValueError, match=r"attention_kernel.BenchConfig.batch_sizes\[1\] must be an integer >= 1"):
        attention_kernel.BenchConfig(batch_sizes=(8, 0))
