"""Sphinx configuration of the project's static site (`make site`, issue 51 item 3):

    sphinx-build -c site . _site

The source directory is the repository root, so that the relative links between README.md, docs/*.md,
results/SUMMARY.md and the executed notebooks results/NN_name/NN_name.ipynb work unchanged; ``include_patterns``
keeps the site to those files. README.md is the root document (``_site/index.html`` redirects to it); the
navigation (a hidden toctree: the scoreboard, the notebooks, whatever docs/*.md exist) is appended to README's
text at build time, on ``source-read``, so that README.md itself carries no Sphinx markup.

Notebooks are rendered from their committed outputs and never executed (``nb_execution_mode = "off"``). Code cells
that only build prose (every output ``text/markdown``) are shown without their input: ``site_notebooks.read``, the
reader registered for ``.ipynb`` through ``nb_custom_formats``, adds the ``remove-input`` tag in memory (myst-nb
reads cell tags from the notebook it is given; a ``source-read`` hook would not see a notebook's cells).
"""
from __future__ import annotations

import sys
from pathlib import Path

from docutils import nodes
from sphinx import addnodes
from sphinx.transforms.post_transforms import SphinxPostTransform

SITE = Path(__file__).resolve().parent
ROOT = SITE.parent
sys.path.insert(0, str(SITE))

project = "pagedattn"
author = "pagedattn contributors"
copyright = "pagedattn contributors"

extensions = ["myst_nb"]
root_doc = "README"

include_patterns = ["README.md", "CHANGELOG.md", "docs/*.md", "results/SUMMARY.md", "results/DETAILS.md",
                    "results/[0-9][0-9]_*/[0-9][0-9]_*.ipynb"]
# Pruned while Sphinx walks the tree (include_patterns alone would still walk them).
exclude_patterns = ["_site", "_build", ".git", ".venv*", "**/.ipynb_checkpoints", "node_modules", "**/node_modules",
                    "src", "tests", "notebooks", "benchmarks", "models", "mutants", ".build", ".cache", "build",
                    "tmp", "site", "results/quick", "results/scratch", "results/benchmarks", "results/gpu_check"]

# myst-nb: the committed outputs, as they are.
nb_execution_mode = "off"
nb_custom_formats = {".ipynb": ("site_notebooks.read", {}, False)}
nb_merge_streams = True
# myst-parser: GitHub-style anchors (GLOSSARY.md#band) for headings down to ###.
myst_heading_anchors = 3
myst_enable_extensions = ["dollarmath", "colon_fence", "deflist"]

html_theme = "sphinx_book_theme"
html_title = "pagedattn"
# No download button: its "source file" entry points at _sources/, which html_copy_source = False leaves out.
html_theme_options = {"show_toc_level": 2, "home_page_in_toc": True, "use_download_button": False}
html_show_sourcelink = False
# Tables at the article's full width, their cells wrapped (issue 61: the scoreboard's verdict column in view at 1,280 px).
html_static_path = ["_static"]
html_css_files = ["wide_tables.css"]
html_copy_source = False


def toctree(caption: str, entries: list[str], glob: bool = False) -> str:
    options = [":hidden:", f":caption: {caption}"] + ([":glob:"] if glob else [])
    return "\n```{toctree}\n" + "\n".join(options + [""] + entries) + "\n```\n"


def navigation() -> str:
    results = ["results/SUMMARY"] + (["results/DETAILS"] if (ROOT / "results/DETAILS.md").exists() else [])
    return (toctree("Results", results)
            + toctree("Notebooks", ["results/[0-9][0-9]_*/[0-9][0-9]_*"], glob=True)
            + toctree("Docs", ["docs/*"] + (["CHANGELOG"] if (ROOT / "CHANGELOG.md").exists() else []), glob=True))


def add_navigation(app, docname: str, source: list[str]) -> None:
    if docname == app.config.root_doc:
        source[0] += "\n" + navigation()


REDIRECT = ('<!DOCTYPE html><html><head><meta charset="utf-8"><title>pagedattn</title>'
            '<meta http-equiv="refresh" content="0; url=README.html"></head>'
            '<body><a href="README.html">pagedattn</a></body></html>\n')


def write_index(app, exception) -> None:
    if exception is None and app.builder.format == "html":
        (Path(app.outdir) / "index.html").write_text(REDIRECT)


class FolderLinks(SphinxPostTransform):
    """A link to a folder of the repository (``[results/gpu_check/](../results/gpu_check/)``: on GitHub, its listing)
    has no page on the site: it is shown as its text, unlinked, instead of failing the build as a missing reference.
    Runs before myst-parser's resolver (priority 9); a link to a missing folder is left to it (and fails)."""

    default_priority = 8

    def run(self, **kwargs) -> None:
        here = (ROOT / self.env.docname).parent
        for node in list(self.document.findall(addnodes.pending_xref)):
            target = node.get("reftarget", "")
            if node.get("reftype") == "myst" and target.endswith("/") and (here / target).resolve().is_dir():
                node.replace_self(nodes.inline("", "", *node.children))


def setup(app):
    app.add_post_transform(FolderLinks)
    app.connect("source-read", add_navigation)
    app.connect("build-finished", write_index)
