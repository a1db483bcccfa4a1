"""The HTML page of `shardext verify`: self-contained, escaped, with the table and byte bars."""

from __future__ import annotations

from verify_support.records import rank_record as _rank

from physicsnemo_shardext.tools.model_check import VerifyConfig, build_report
from physicsnemo_shardext.tools.verify_html import render_html, write_html


def test_page_has_summary_ops_with_bars_and_comparison(tmp_path):
    report = build_report(VerifyConfig("models.py:<script>"), [_rank(), _rank(rel=0.5)])
    page = render_html(report)
    assert page.startswith("<!DOCTYPE html>") and "MISMATCH" in page
    assert "<script>" not in page and "&lt;script&gt;" in page  # user text is escaped
    assert page.count('class="bar bwd"') == 2 and "torch.tanh" in page  # the op row and the legend
    path = tmp_path / "r.html"
    write_html(report, str(path))
    assert path.read_text() == page


def test_page_states_both_parts_of_the_tolerance():
    page = render_html(build_report(VerifyConfig("m:f"), [_rank(), _rank()]))
    assert "rtol 1e-04, atol 1e-05" in page and "atol + rtol&middot;|r|" in page
