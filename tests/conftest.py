"""Test-wide set-up. Triton decides interpreted vs compiled when it is first imported and when a kernel is defined,
and other modules (transformers, torch) may import it early, so ``kernels.use_triton_interpreter`` (the one place
that decides: the interpreter on a machine without CUDA) runs here, before any test module is collected."""
import os

import pytest
import torch

from pagedattn.kernels import use_triton_interpreter

use_triton_interpreter()


@pytest.fixture(scope="module")
def one_thread():
    """The tiny models run several times faster on one thread on a shared 2-core VM."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def triton():
    """The ``triton`` module. Without it a kernel test is skipped on a developer's machine, but fails under CI=true:
    a CI run must not pass by skipping every Triton case."""
    if os.environ.get("CI", "").lower() in ("true", "1"):
        import triton as module  # an ImportError here fails the test

        return module
    return pytest.importorskip("triton")


@pytest.fixture(autouse=True)
def _matplotlib_settings_do_not_leak():
    """The plotting functions set a seaborn theme, which changes matplotlib's global settings; restore them after
    every test, so that what a test draws does not depend on which tests ran before it (the tour's tests compare
    PNGs pixel for pixel with the executed notebook's)."""
    import matplotlib

    with matplotlib.rc_context():
        yield


@pytest.fixture
def interpreted_simulator(monkeypatch):
    """Replays by the interpreted simulator, for tests that spy on its modules (``pagedattn.repro.sim.fastsim``'s compiled
    copy has modules of its own, which a monkeypatch of ``pagedattn.scheduler`` or ``pagedattn.repro.sim.simulator`` misses)."""
    from pagedattn.repro.sim import fastsim

    monkeypatch.setattr(fastsim, "status", lambda: (None, "interpreted by the test"))
