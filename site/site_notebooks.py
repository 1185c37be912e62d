"""The site's notebook reader (``nb_custom_formats`` in ``conf.py``): the executed notebook as committed, with the
``remove-input`` tag added in memory to every code cell whose outputs are all Markdown (``IPython.display.Markdown``:
prose, a verdict table, a caption built by code). The committed notebooks are never modified; the site never runs
them (``nb_execution_mode = "off"``)."""
from __future__ import annotations

import re

import nbformat

MARKDOWN = "text/markdown"
TAG = "remove-input"


def prose_only(cell) -> bool:
    """A code cell that has outputs, all of them rich outputs that carry Markdown."""
    outputs = cell.get("outputs") or []
    return cell.get("cell_type") == "code" and bool(outputs) and all(
        o.get("output_type") in ("display_data", "execute_result") and MARKDOWN in o.get("data", {})
        for o in outputs)


def tag_prose_cells(nb):
    for cell in nb.cells:
        if prose_only(cell):
            tags = cell.setdefault("metadata", {}).setdefault("tags", [])
            if TAG not in tags:
                tags.append(TAG)
    return nb


_MD_LINK = re.compile(r"(\]\((?![a-z]+:)[^)\s#]*?)\.md((?:#[^)\s]*)?\))")


def link_pages(nb):
    """Markdown outputs' links to ``.md`` files point at their built pages (``.html``): myst-nb resolves the links of
    Markdown cells but renders a Markdown output's links as written."""
    for cell in nb.cells:
        for o in cell.get("outputs") or []:
            if MARKDOWN in o.get("data", {}):
                o["data"][MARKDOWN] = _MD_LINK.sub(r"\1.html\2", o["data"][MARKDOWN])
    return nb


def read(text: str):
    """myst-nb's reader for ``.ipynb`` (its ``standard_nb_read``), then ``tag_prose_cells`` and ``link_pages``."""
    return link_pages(tag_prose_cells(nbformat.reads(text, as_version=nbformat.NO_CONVERT)))
