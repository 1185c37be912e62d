"""Whether progress bars are shown: to a person at a terminal or in an interactive Jupyter session, never in a
papermill run's executed copy or a test (issue 51, item 6). Every tqdm bar in ``pagedattn`` asks
:func:`interactive`."""
from __future__ import annotations

import os
import sys

#: Set by ``report.reproduce.run_notebook`` for the notebook it executes (the notebook's path, relative to the
#: repository root): a kernel that has it runs under papermill, and its output is an executed copy.
NOTEBOOK_ENV = "PAGEDATTN_NOTEBOOK"


def interactive() -> bool:
    """True when stderr is a terminal, or in a Jupyter kernel that ``reproduce`` did not start (a person's
    JupyterLab); False under ``make reproduce``'s papermill runs and in tests."""
    if os.environ.get(NOTEBOOK_ENV):
        return False
    if "ipykernel" in sys.modules:
        return True
    try:
        return bool(sys.stderr.isatty())
    except (AttributeError, ValueError):
        return False


def quiet_transformers() -> None:
    """Turn transformers' own progress bars ("Loading weights", "Writing model shards") off unless
    :func:`interactive`: an executed copy shows none (issue 51)."""
    if not interactive():
        import importlib  # by name: the simulator imports this module and must not import transformers (layering)

        importlib.import_module("transformers.utils.logging").disable_progress_bar()
