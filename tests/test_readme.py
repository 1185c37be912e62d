"""README.md is a user's guide (issue 51): short, and with no result typed by hand.

Every number a run produces reaches the README through its generated blocks (``report.readme``); outside them a
decimal number would be typed by hand and go stale. Versions and identifiers are written as code (backticks), which
the check leaves out, as it leaves out links' targets.
"""
from __future__ import annotations

import re

from pagedattn.repro.report.results import REPO_ROOT

README = REPO_ROOT / "README.md"
MAX_LINES = 150

BLOCK = re.compile(r"<!-- results:begin (\w+) -->.*?<!-- results:end \1 -->", re.S)
FENCE = re.compile(r"```.*?```", re.S)
CODE = re.compile(r"`[^`\n]*`")
LINK_TARGET = re.compile(r"\]\([^)]*\)")
SECTION = re.compile(r"§\d+(?:\.\d+)*(?:-§\d+(?:\.\d+)*)?")  # the paper's sections: references, not results
DECIMAL = re.compile(r"(?<![\w.])\d+\.\d+(?!\.?\d)")


def hand_written(text: str) -> str:
    """The README's text without its generated blocks, code (fenced and inline) and links' targets."""
    for pattern in (BLOCK, FENCE, CODE, LINK_TARGET, SECTION):
        text = pattern.sub(" ", text)
    return text


def test_readme_is_short():
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_LINES, f"README.md has {len(lines)} lines; details belong in docs/ (at most {MAX_LINES})"


def test_no_decimal_number_outside_the_generated_blocks():
    found = DECIMAL.findall(hand_written(README.read_text()))
    assert not found, f"decimal numbers typed into README.md outside its generated blocks: {found}"


def test_the_check_sees_a_typed_number_and_ignores_blocks_code_and_links():
    text = ("ours holds at 1.83x.\n<!-- results:begin x -->\n2.5\n<!-- results:end x -->\n`torch==2.13.0` "
            "[arXiv](https://arxiv.org/abs/2309.06180) §4.2-§4.5\n```bash\npython3.11\n```")
    assert DECIMAL.findall(hand_written(text)) == ["1.83"]


def test_readme_names_the_two_commands_and_links_only_files_that_exist():
    text = README.read_text()
    assert "make reproduce" in text and "make test" in text and "00_tour" in text
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text):
        if not re.match(r"^[a-z]+:", target):
            assert (REPO_ROOT / target).exists(), f"README.md links to {target}, which does not exist"
