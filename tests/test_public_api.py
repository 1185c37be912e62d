"""The public API (vLLM's names): ``from pagedattn import LLM, LLMEngine, SamplingParams`` and friends, each the class
its module defines; the simulator imports no torch through it; the old forwarding of ``LLM`` through
``pagedattn.engine`` is gone."""
import subprocess
import sys

import pytest

import pagedattn


def test_public_names_are_the_defining_classes():
    from pagedattn import LLM, CompletionOutput, EngineArgs, LLMEngine, RequestOutput, SamplingParams
    from pagedattn import engine, llm, sequence

    assert (LLM, LLMEngine, EngineArgs) == (llm.LLM, engine.LLMEngine, engine.EngineArgs)
    assert (SamplingParams, RequestOutput, CompletionOutput) == (sequence.SamplingParams, sequence.RequestOutput,
                                                                 sequence.CompletionOutput)
    assert set(pagedattn.__all__) <= set(dir(pagedattn))
    with pytest.raises(AttributeError, match="no attribute 'Engine'"):
        pagedattn.Engine  # noqa: B018


def test_no_shim_in_the_engine_module():
    from pagedattn import engine

    assert not hasattr(engine, "__getattr__") and not hasattr(engine, "LLM")


def test_the_simulator_stays_free_of_torch():
    code = "import sys, pagedattn.repro.sim.simulator, pagedattn.repro.sim.parallel; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
