"""One module per paper result: ``run(...) -> pandas.DataFrame``, written to ``results/<notebook name>/``."""
