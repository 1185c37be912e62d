"""The optional parts of the package and what they need (``pyproject.toml``'s extras): ``pip install pagedattn``
installs the engine alone (torch, transformers, numpy, tqdm); ``[serve]`` the OpenAI-compatible server, its metrics
and the trace replayer; ``[gpu]`` the Triton kernels; ``[repro]`` the reproduction (simulator, notebooks, data sets).

A module of an extra whose packages are missing stops at its import with one line naming the extra
(``missing_extra``), not a traceback into a third-party import."""
from __future__ import annotations

import sys
from typing import NoReturn


def missing_extra(extra: str, module: str, error: ImportError, main: bool = False) -> NoReturn:
    """Stop ``module`` (the caller's own name), whose import of an ``extra``'s package failed with ``error``: an
    ``ImportError`` naming the extra to install, or, when the module runs as a program (``main``: ``python -m``),
    that one line on stderr and exit status 1."""
    message = (f"{module} needs the {extra} extra ({error.name or error} is not installed): "
               f"pip install 'pagedattn[{extra}]'")
    if main:
        sys.exit(message)
    raise ImportError(message, name=error.name) from error
