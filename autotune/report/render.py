"""The report pages: Markdown and HTML from the same tables (pure: data in, text out)."""

from __future__ import annotations

import html
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

# Set on <body> by the page's own check script once every image has loaded (or not):
# data-check="ok" / "broken:<names>" / "error:<message>".  The browser test reads it.
CHECK_SCRIPT = """
<script>
(function () {
  var errors = [];
  window.addEventListener("error", function (e) {
    var what = (e.target && e.target.src) ? "load " + e.target.src : (e.message || "error");
    errors.push(what);
  }, true);
  var consoleError = console.error;
  console.error = function () {
    errors.push("console.error " + Array.prototype.join.call(arguments, " "));
    return consoleError.apply(console, arguments);
  };
  window.addEventListener("load", function () {
    var broken = [];
    var imgs = document.getElementsByTagName("img");
    for (var i = 0; i < imgs.length; i++) {
      if (!(imgs[i].complete && imgs[i].naturalWidth > 0)) {
        broken.push(imgs[i].getAttribute("src"));
      }
    }
    var status = errors.length ? "error:" + errors.join("|")
               : broken.length ? "broken:" + broken.join("|") : "ok";
    document.body.setAttribute("data-check", status);
    document.body.setAttribute("data-images", String(imgs.length));
  });
})();
</script>
"""

CSS = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1100px;
       color: #222; line-height: 1.4; }
table { border-collapse: collapse; margin: 1em 0; font-size: 0.85em; }
th, td { border: 1px solid #ccc; padding: 3px 7px; text-align: right; }
th { background: #f3f3f3; } td.l, th.l { text-align: left; }
figure { margin: 1.5em 0; } img { max-width: 100%; border: 1px solid #eee; }
figcaption { font-size: 0.85em; color: #444; }
.warn { background: #fff3cd; border: 1px solid #e0c060; padding: 0.6em 1em; }
.note { color: #555; font-size: 0.9em; }
pre { background: #f6f6f6; padding: 0.7em; font-size: 0.85em; white-space: pre-wrap;
      overflow-wrap: anywhere; }
.copy { float: right; font-size: 0.8em; }
"""


@dataclass
class Table:
    title: str
    headers: list[str]
    rows: list[list[str]]
    note: str = ""
    left: int = 1  # how many leading columns are text (left-aligned)


@dataclass
class Figure:
    name: str
    file: str  # relative to the report folder
    title: str
    caption: str


@dataclass
class Page:
    title: str
    provenance: str
    sections: list[tuple[str, list[Any]]] = field(default_factory=list)  # heading, blocks

    def add(self, heading: str, *blocks: Any) -> None:
        self.sections.append((heading, list(blocks)))


@dataclass
class Text:
    text: str
    kind: str = "p"  # "p" | "warn" | "note" | "pre"


# ----------------------------------------------------------------------------- format


def fmt(value: Any, kind: str = "") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float) and math.isinf(value):
        return "∞"
    if kind == "s" and isinstance(value, int | float):
        return f"{value:.2f}"
    if kind == "pct" and isinstance(value, int | float):
        return f"{value:.0f}%"
    if kind == "frac" and isinstance(value, int | float):
        return f"{value:.1%}"
    if kind == "rate" and isinstance(value, int | float):
        return f"{value:.3g}"
    if isinstance(value, float):
        return f"{value:,.1f}" if abs(value) >= 10 else f"{value:.3g}"
    return str(value)


# ----------------------------------------------------------------------------- markdown


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def markdown(page: Page) -> str:
    out = [f"# {page.title}", "", f"_{page.provenance}_", ""]
    for heading, blocks in page.sections:
        out += [f"## {heading}", ""]
        for b in blocks:
            if isinstance(b, Table):
                if b.title:
                    out += [f"**{b.title}**", ""]
                out.append("| " + " | ".join(_md_cell(h) for h in b.headers) + " |")
                out.append("|" + "|".join(
                    ":---" if i < b.left else "---:" for i in range(len(b.headers))) + "|")
                out += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in b.rows]
                out.append("")
                if b.note:
                    out += [f"_{b.note}_", ""]
            elif isinstance(b, Figure):
                out += [f"![{b.title}]({b.file})", "", f"_{b.caption}_", ""]
            elif isinstance(b, Text):
                if b.kind == "pre":
                    out += ["```", b.text, "```", ""]
                elif b.kind == "warn":
                    out += [f"> **{b.text}**", ""]
                elif b.kind == "note":
                    out += [f"_{b.text}_", ""]
                else:
                    out += [b.text, ""]
    return "\n".join(out).rstrip() + "\n"


# ----------------------------------------------------------------------------- html


def _e(text: str) -> str:
    return html.escape(text, quote=True)


def html_page(page: Page) -> str:
    out = ["<!DOCTYPE html>", '<html lang="en">', "<head>", '<meta charset="utf-8">',
           f"<title>{_e(page.title)}</title>", f"<style>{CSS}</style>", CHECK_SCRIPT,
           "</head>", "<body>", f"<h1>{_e(page.title)}</h1>",
           f'<p class="note">{_e(page.provenance)}</p>']
    for heading, blocks in page.sections:
        out.append(f"<h2>{_e(heading)}</h2>")
        for b in blocks:
            if isinstance(b, Table):
                out.append("<table>")
                if b.title:
                    out.append(f'<caption class="l">{_e(b.title)}</caption>')
                out.append("<tr>" + "".join(
                    f'<th class="l">{_e(h)}</th>' if i < b.left else f"<th>{_e(h)}</th>"
                    for i, h in enumerate(b.headers)) + "</tr>")
                for row in b.rows:
                    out.append("<tr>" + "".join(
                        f'<td class="l">{_e(c)}</td>' if i < b.left else f"<td>{_e(c)}</td>"
                        for i, c in enumerate(row)) + "</tr>")
                out.append("</table>")
                if b.note:
                    out.append(f'<p class="note">{_e(b.note)}</p>')
            elif isinstance(b, Figure):
                out.append(
                    f'<figure id="fig-{_e(b.name)}"><img src="{_e(b.file)}" '
                    f'alt="{_e(b.title)}"><figcaption><b>{_e(b.title)}.</b> '
                    f"{_e(b.caption)}</figcaption></figure>")
            elif isinstance(b, Text):
                if b.kind == "pre":
                    # Wrapped, not scrolled: a `vllm serve` line is read whole, and the
                    # button copies it exactly as printed.
                    out.append('<button class="copy" type="button" onclick="navigator.'
                               'clipboard.writeText(this.nextElementSibling.textContent)">'
                               f"copy</button><pre>{_e(b.text)}</pre>")
                elif b.kind == "warn":
                    out.append(f'<p class="warn">{_e(b.text)}</p>')
                elif b.kind == "note":
                    out.append(f'<p class="note">{_e(b.text)}</p>')
                else:
                    out.append(f"<p>{_e(b.text)}</p>")
    out += ["</body>", "</html>", ""]
    return "\n".join(out)


def table_from(headers: Sequence[str], rows: Sequence[Sequence[Any]], *, title: str = "",
               note: str = "", left: int = 1,
               kinds: Mapping[int, str] | None = None) -> Table:
    kinds = kinds or {}
    return Table(title=title, headers=list(headers), note=note, left=left,
                 rows=[[fmt(v, kinds.get(i, "")) for i, v in enumerate(r)] for r in rows])
