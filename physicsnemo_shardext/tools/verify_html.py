"""The ``shardext verify --html`` page: one self-contained file (no scripts, no external assets).

It shows the summary, the first error, a table of every op site with a bar of
the bytes it moved per rank (forward and backward, scaled to the busiest op),
and the comparison against single-process, worst first.

Examples:
    >>> page = render_html({"status": "bad-input", "summary": "BAD INPUT: no file", "config": {"factory": "m:f"},
    ...                     "ops": [], "comparison": [], "next_steps": [], "error": {"message": "no file"}})
    >>> page.startswith("<!DOCTYPE html>") and "BAD INPUT: no file" in page
    True
"""

from __future__ import annotations

from html import escape
from pathlib import Path
from typing import Any

__all__ = ["render_html", "write_html"]

_STYLE = """
body{font-family:system-ui,sans-serif;margin:2em;color:#222}
h1{font-size:1.3em} h2{font-size:1.1em;margin-top:1.6em}
.summary{padding:.6em 1em;border-radius:6px;font-weight:600}
.match{background:#e3f6e5} .mismatch{background:#fde2e1} .unsupported{background:#fff2cc}
.bad-input{background:#eee}
table{border-collapse:collapse;font-size:.85em} td,th{padding:3px 8px;border-bottom:1px solid #ddd;text-align:left}
th{background:#f4f4f4} td.num{text-align:right;font-variant-numeric:tabular-nums}
tr.error td{background:#fde2e1} tr.gather td{background:#fff2cc}
.bar{height:10px;display:inline-block;vertical-align:middle}
.fwd{background:#4e79a7} .bwd{background:#f28e2b}
code{font-size:.95em} .ok{color:#1a7f37} .bad{color:#cf222e;font-weight:600}
"""


def _size(nbytes: int) -> str:
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"


def _ops_table(ops: list[dict[str, Any]]) -> str:
    peak = max((max(op["forward"]["bytes"]) + max(op["backward"]["bytes"]) for op in ops), default=0) or 1
    rows = []
    for op in ops:
        fwd, bwd = max(op["forward"]["bytes"]), max(op["backward"]["bytes"])
        css = "error" if op["error"] else ("gather" if op["activation_gathers"] or not op["stayed_sharded"] else "")
        site = op["site"] or {}
        where = f"{Path(site.get('file', '?')).name}:{site.get('line', '?')}"
        bar = (
            f'<span class="bar fwd" style="width:{200 * fwd / peak:.1f}px"></span>'
            f'<span class="bar bwd" style="width:{200 * bwd / peak:.1f}px"></span>'
        )
        rows.append(
            f'<tr class="{css}"><td class="num">{op["index"]}</td><td><code>{escape(op["op"])}</code></td>'
            f'<td title="{escape(site.get("code", ""))}">{escape(where)}</td><td class="num">{op["calls"]}</td>'
            f"<td>{escape(op['handler'])}</td><td>{escape(op['provider'])}</td><td>{escape(op['output'])}</td>"
            f'<td class="num">{max(op["forward"]["collectives"])} / {_size(fwd)}</td>'
            f'<td class="num">{max(op["backward"]["collectives"])} / {_size(bwd)}</td>'
            f'<td class="num">{op["activation_gathers"]}</td><td>{bar}</td></tr>'
        )
    head = (
        "#",
        "op",
        "site",
        "calls",
        "handler",
        "provider",
        "output",
        "fwd coll / bytes",
        "bwd coll / bytes",
        "gathers",
        "bytes per rank (max)",
    )
    return (
        "<table><tr>" + "".join(f"<th>{h}</th>" for h in head) + "</tr>" + "".join(rows) + "</table>"
        '<p><span class="bar fwd" style="width:20px"></span> forward '
        '<span class="bar bwd" style="width:20px"></span> backward</p>'
    )


def _comparison_table(rows: list[dict[str, Any]], rtol: float, atol: float | None) -> str:
    body = []
    for row in rows:
        mark = '<span class="ok">ok</span>' if row["ok"] else '<span class="bad">MISMATCH</span>'
        max_abs = "-" if row["max_abs_error"] is None else f"{row['max_abs_error']:.2e}"
        body.append(
            f"<tr><td>{mark}</td><td><code>{escape(row['tensor'])}</code></td>"
            f'<td class="num">{row["relative_error"]:.2e}</td><td class="num">{max_abs}</td>'
            f"<td>{escape(row.get('detail') or '')}</td></tr>"
        )
    bound = "" if atol is None else f", atol {atol:.0e}"
    return (
        f"<p>Equal when |a&minus;r| &le; atol + rtol&middot;|r| for every element (rtol {rtol:.0e}{bound}); "
        "relative error max|a&minus;r| / max(max|r|, atol); mismatches first.</p>"
        "<table><tr><th></th><th>tensor</th><th>relative</th><th>max abs</th><th></th></tr>"
        + "".join(body)
        + "</table>"
    )


def _error_block(error: dict[str, Any] | None) -> str:
    if not error or "type" not in error:
        return ""
    site = error.get("site") or {}
    where = f"{escape(site.get('file', '?'))}:{site.get('line', '?')} in {escape(site.get('function', '?'))}"
    return (
        f"<h2>First error</h2><p><b>{escape(error['type'])}</b> in <code>{escape(error.get('op') or '?')}</code>"
        f" at {where}</p><pre>{escape(site.get('code', ''))}</pre>"
        f"<p>configuration: <code>{escape(error.get('configuration') or '')}</code></p>"
        f"<pre>{escape(error.get('message', ''))}</pre>"
    )


def render_html(report: dict[str, Any]) -> str:
    """The whole page as a string."""
    config = report.get("config", {})
    parts = [
        "<!DOCTYPE html><html><head><meta charset='utf-8'>",
        f"<title>shardext verify {escape(config.get('factory', ''))}</title><style>{_STYLE}</style></head><body>",
        f"<h1>shardext verify <code>{escape(config.get('factory', ''))}</code></h1>",
        f'<p class="summary {escape(report["status"])}">{escape(report["summary"])}</p>',
    ]
    if report.get("split"):
        parts.append(
            f"<p>{report.get('ranks')} ranks, input split {escape(str(report['split']))}, "
            f"{escape(str(config.get('dtype')))}, loss {escape(str(config.get('loss')))}</p>"
        )
    parts.append(_error_block(report.get("error")))
    if report.get("ops"):
        parts.append("<h2>Ops in call order</h2>" + _ops_table(report["ops"]))
    if report.get("comparison"):
        parts.append(
            "<h2>Against single-process</h2>"
            + _comparison_table(report["comparison"], report["tolerance"], report.get("atol"))
        )
    if report.get("next_steps"):
        parts.append("<h2>Next</h2><ul>" + "".join(f"<li>{escape(s)}</li>" for s in report["next_steps"]) + "</ul>")
    parts.append("</body></html>\n")
    return "".join(parts)


def write_html(report: dict[str, Any], path: str) -> None:
    """Write `render_html`'s page to ``path``."""
    Path(path).write_text(render_html(report), encoding="utf-8")
