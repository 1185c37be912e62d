"""Test-wide set-up. Triton decides interpreted vs compiled when it is first imported and when a kernel is defined,
and other modules (transformers, torch) may import it early, so on a machine without CUDA the interpreter is switched
on here, before any test module is collected."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def triton():
    """The ``triton`` module. Without it a kernel test is skipped on a developer's machine, but fails under CI=true:
    a CI run must not pass by skipping every Triton case."""
    if os.environ.get("CI", "").lower() in ("true", "1"):
        import triton as module  # an ImportError here fails the test

        return module
    return pytest.importorskip("triton")
