"""The paper's reproduction, apart from the engine core it measures (Kwon et al., SOSP 2023, §6-§7).

``pagedattn`` is the engine: the KV block manager and Orca's reservations (``memory/``), the scheduler, the model
runner, the kernels, the ``LLM`` / ``LLMEngine`` API and its server. ``pagedattn.repro`` is the research code built on
it, in four folders, each importing only those below it (an import-linter ``layers`` contract, pyproject's
``[tool.importlinter]``; the core never imports this package):

- ``experiments/``: one module per paper result, the sensitivity bands, the GPU check, the vLLM-CPU peer, the model
  zoo, the tour and the explorers;
- ``report/``: claims and their provenance (``results``), the notebooks' plots, ``SUMMARY.md`` and the README's
  generated blocks, the papermill runner (``reproduce``) and the restamp;
- ``sim/``: the simulator, the real engine core on a simulated clock (``simulator``), its step-time model and A100
  profile, the sustainable-rate measure (``capacity``), its compiled build and the sweeps' process pool;
- ``workloads/``: request traces, the real ShareGPT data set;

and, below them all, the paper's published numbers and model shapes (``paper``).
"""
from pathlib import Path

from pagedattn.extras import missing_extra

try:
    import pandas  # noqa: F401  (every folder's tables: the first of the repro extra's packages a module imports)
except ImportError as e:  # ``pip install pagedattn`` alone: the engine without its reproduction
    missing_extra("repro", "pagedattn.repro", e)

#: The checkout's root (results/, notebooks/, .cache/ are found from it).
REPO_ROOT = Path(__file__).resolve().parents[3]
