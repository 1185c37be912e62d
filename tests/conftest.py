"""Test-wide set-up. Triton decides interpreted vs compiled when it is first imported and when a kernel is defined,
and other modules (transformers, torch) may import it early, so on a machine without CUDA the interpreter is switched
on here, before any test module is collected."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
