"""Baselines run on the same model, workload and KV budget as our engine (paper §6.1)."""
