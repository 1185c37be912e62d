"""The research tier's workloads/ (issue 49)."""
