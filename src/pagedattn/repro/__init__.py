"""The paper's reproduction, apart from the engine core it measures (Kwon et al., SOSP 2023, §6-§7).

``pagedattn`` is the engine: the KV block manager and Orca's reservations (``memory/``), the scheduler, the model
runner, the kernels, the ``LLM`` / ``LLMEngine`` API and its server. ``pagedattn.repro`` is the research code built on
it: the simulator that drives the real scheduler at paper scale (``sim``), the workloads and the real ShareGPT trace,
the sustainable-rate measure (``capacity``), the sensitivity bands, one module per paper result (``experiments``),
the results and their provenance, the notebooks' plots, explorers and tour, and the model zoo. The core never imports
this package; an import contract (``make check``, pyproject's ``[tool.importlinter]``) enforces it.
"""
