"""The research tier's sim/ (issue 49)."""
