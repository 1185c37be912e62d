"""pagedattn: a reproducible replication of vLLM / PagedAttention (Kwon et al., SOSP 2023, arXiv:2309.06180)."""
__version__ = "0.1.0"
