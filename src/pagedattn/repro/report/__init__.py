"""The research tier's report/ (issue 49)."""
