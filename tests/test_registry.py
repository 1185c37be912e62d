"""Issue 61, one paper number, one claim: the registry of the paper's numbers (``repro.paper.REGISTRY``), how
``summary.json`` names them (``results.apply_registry``), and the committed results held to it: every reproduction
claim names one number, no number is judged twice, every number is judged by its owner or marked not measured, and
every cross-check agrees with its owner or says why not."""
import json
import re

import pytest

from pagedattn.repro import paper
from pagedattn.repro.paper import REGISTRY, PaperNumber
from pagedattn.repro.report import scoreboard
from pagedattn.repro.report.results import (HOLDS, NOT_MEASURED, RECORDED, RESULTS_DIR, Claim, apply_registry,
                                            difference_pct, verdict, write_summary)

NOTEBOOKS = {p.stem for p in (RESULTS_DIR.parent / "notebooks").glob("[0-9][0-9]_*.ipynb")}


# ------------------------------------------------------------------------------------------------ the registry
def test_each_entry_has_a_stable_id_one_owner_and_a_place_in_the_paper():
    assert len(REGISTRY) == len({e.paper_id for e in REGISTRY.values()})
    for pid, e in REGISTRY.items():
        assert re.fullmatch(r"[a-z0-9]+(\.[a-z0-9_]+)+", pid), pid
        assert e.figure and e.quantity and e.printed and e.where, pid
        assert (e.owner in NOTEBOOKS and e.claim) or (e.owner is None and e.not_measured), pid
        for x in e.cross_checks:
            assert x.notebook in NOTEBOOKS and x.notebook != e.owner and (x.agree is not None) != bool(x.why), pid
    owned = [(e.owner, e.claim) for e in REGISTRY.values() if e.owner]
    assert len(owned) == len(set(owned)), "one claim judges one number"


def test_an_entry_needs_an_owner_or_a_reason():
    with pytest.raises(ValueError, match="not measured"):
        PaperNumber("x.y", "Fig. 1", "q", 1.0, "1", "§1")
    with pytest.raises(ValueError, match="together"):
        PaperNumber("x.y", "Fig. 1", "q", 1.0, "1", "§1", owner="03_throughput", not_measured="")


def test_values_are_read_from_the_papers_constants():
    assert REGISTRY["fig2.vllm.token_states"].value == paper.FIG2_SHARES["paged"]["token_states"] == 96.3
    assert REGISTRY["fig12.opt175b.sharegpt.vs_orca_max"].value == paper.FIG12_RATE_RATIO["paged_vs_orca_max"]
    assert REGISTRY["fig13.alpaca.vllm"].value == paper.FIG13_MEAN_BATCH["alpaca"]["paged"]
    assert REGISTRY["fig14.alpaca.beam_growth"].value == round(2.3 / 1.3, 2)
    assert REGISTRY["fig15.sharegpt.parallel_n4"].value == paper.FIG15_SAVING["sharegpt"]["parallel"]


# ------------------------------------------------------------------------------------------------ apply_registry
def test_apply_registry_names_the_number_records_cross_checks_and_folds_variants():
    claims = [Claim("rate_ratio.sharegpt.paged_vs_orca_oracle", "1.7-2.7", 2.1, "x", "", True, accept=[1.3, 3.4]),
              Claim("rate_ratio.sharegpt.paged_vs_orca_oracle.synthetic", "1.7-2.7", 1.9, "x", "", False),
              Claim("rate_ratio.sharegpt.paged_vs_ft", "up to 22", 10.0, "x", "", None, kind="tracking")]
    got = {c.name: c for c in apply_registry("03_throughput", claims)}
    assert set(got) == {"rate_ratio.sharegpt.paged_vs_orca_oracle", "rate_ratio.sharegpt.paged_vs_ft"}
    c = got["rate_ratio.sharegpt.paged_vs_orca_oracle"]
    assert c.paper_id == "fig12.opt13b.sharegpt.vs_orca_oracle" and verdict(c) == HOLDS
    assert c.variants == [{"variant": "synthetic ShareGPT-like trace", "ours": 1.9, "holds": False, "band": None,
                           "name": "rate_ratio.sharegpt.paged_vs_orca_oracle.synthetic"}]
    # notebook 10 measures the same number again: recorded, never judged, pointing at 03's
    again = apply_registry("10_table1_fig12", [Claim("rate_ratio.OPT-13B.sharegpt.paged_vs_orca_oracle", "1.7-2.7",
                                                     2.1, "x", "", True)])[0]
    assert again.kind == "tracking" and again.holds is None and verdict(again) == RECORDED
    assert again.cross_check == "fig12.opt13b.sharegpt.vs_orca_oracle" and "03_throughput" in again.reason


def test_write_summary_stores_the_registry_fields(tmp_path):
    write_summary(tmp_path / "09_chatbot", "09_chatbot", "sim", "m", False,
                  [Claim("rate_ratio.chatbot.paged_vs_orca_oracle", 2.0, None, "x", note="not run")])
    c = json.loads((tmp_path / "09_chatbot" / "summary.json").read_text())["claims"][0]
    assert c["paper_id"] == "fig17.vs_orca_oracle" and verdict(c) == NOT_MEASURED


# ------------------------------------------------------------------------------------------------ committed results
def committed() -> dict[str, dict]:
    return scoreboard.summaries()


def test_every_committed_reproduction_claim_names_one_paper_number_judged_once():
    seen: dict[str, str] = {}
    for name, c in scoreboard.scored_claims(committed()):
        if c.get("kind", "reproduction") == "reproduction":
            assert c.get("paper_id") in REGISTRY, f"{name}/{c['name']} names no number of the paper"
        if c.get("paper_id"):
            assert c["paper_id"] not in seen, f"{c['paper_id']} judged twice: {seen[c['paper_id']]}, {name}"
            assert (name, c["name"]) == (REGISTRY[c["paper_id"]].owner, REGISTRY[c["paper_id"]].claim)
            seen[c["paper_id"]] = f"{name}/{c['name']}"


def test_every_registry_number_is_judged_by_its_owner_or_marked_not_measured():
    rows = scoreboard.rows(committed())
    unjudged = [r.entry.paper_id for r in rows if r.claim is None and not r.entry.not_measured]
    assert not unjudged, f"numbers no committed result judges (rerun their owner): {unjudged}"


def test_cross_checks_agree_with_their_owner_or_say_why_they_differ():
    docs = committed()
    for pid, entry in REGISTRY.items():
        owner = next((c for c in docs.get(entry.owner, {}).get("claims", []) if c.get("paper_id") == pid), None)
        for x in entry.cross_checks:
            mine = next((c for c in docs.get(x.notebook, {}).get("claims", []) if c["name"] == x.claim), None)
            assert mine is not None and mine.get("cross_check") == pid, f"{x.notebook} records no {x.claim}"
            if x.agree is None or owner is None or owner.get("ours") is None or mine.get("ours") is None:
                continue
            d = difference_pct(mine, owner["ours"])
            assert d is not None and abs(d) <= 100 * x.agree, \
                f"{pid}: {x.notebook}'s {mine['ours']} and {entry.owner}'s {owner['ours']} differ by {d:.1f} %"


# ------------------------------------------------------------------------------------------------ notebook pages
def test_each_notebook_shows_its_verdicts_first_and_reproduce_fills_them(tmp_path):
    import nbformat

    from pagedattn.repro.report.results import VERDICT_CELL_TAG, fill_verdicts

    for path in sorted((RESULTS_DIR.parent / "notebooks").glob("[0-9][0-9]_*.ipynb")):
        cells = nbformat.read(path, as_version=4).cells
        tags = [c.metadata.get("tags", []) for c in cells]
        params = next(i for i, t in enumerate(tags) if "parameters" in t)
        assert cells[0].cell_type == "markdown" and cells[0].source.startswith("# "), path.name
        assert VERDICT_CELL_TAG in tags[params + 1], f"{path.name}: the verdicts do not follow the parameters"
        assert f'show_verdicts("{path.stem}")' in cells[params + 1].source
        executed = RESULTS_DIR / path.stem / path.name
        if executed.exists():  # the page: the first output after the title is the verdict table
            shown = [c for c in nbformat.read(executed, as_version=4).cells if c.get("outputs")]
            assert shown and VERDICT_CELL_TAG in shown[0].metadata.get("tags", []), f"{executed.name}: not first"
            assert "**Verdicts of this run**" in shown[0].outputs[0].data["text/markdown"]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# 09 · x"),
                                         nbformat.v4.new_code_cell("show_verdicts('09_chatbot')")])
    nb.cells[1].metadata["tags"] = [VERDICT_CELL_TAG]
    nbformat.write(nb, tmp_path / "09_chatbot.ipynb")
    write_summary(tmp_path / "09_chatbot", "09_chatbot", "sim", "m", False,
                  [Claim("rate_ratio.chatbot.paged_vs_orca_oracle", 2.0, 1.9, "x", "", True, accept=[1.5, 2.5])])
    assert fill_verdicts(tmp_path / "09_chatbot.ipynb", tmp_path / "09_chatbot" / "summary.json")
    out = nbformat.read(tmp_path / "09_chatbot.ipynb", as_version=4).cells[1].outputs[0].data["text/markdown"]
    assert "| fig17.vs_orca_oracle | rate_ratio.chatbot.paged_vs_orca_oracle | 2 | 1.9 x | -5.0 % | reproduced |" in out
