"""Checks every internal link of a built site: each href and src names a file of the site, each
``#anchor`` an ``id`` (or ``name``) in the page it points to. No network: external links (any
URL with a scheme or starting with ``//``) are counted, not fetched.

Run it on a build: ``python -m mkdocs build --strict --site-dir /tmp/site && python
tests/_support/_linkcheck.py /tmp/site`` (exit 1 and one line per broken link when any is broken).
"""

from __future__ import annotations

import html.parser
import pathlib
import posixpath
import sys
import urllib.parse
from dataclasses import dataclass, field


class _Page(html.parser.HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.links: list[str] = []
        self.anchors: set[str] = set()

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        for key in ("id",) + (("name",) if tag == "a" else ()):
            if attrs.get(key):
                self.anchors.add(attrs[key])
        for key in ("href", "src"):
            if attrs.get(key) is not None and tag in ("a", "link", "img", "script", "source", "iframe"):
                self.links.append(attrs[key])


@dataclass
class Report:
    pages: int = 0
    internal: int = 0
    anchored: int = 0
    external: int = 0
    broken: list[str] = field(default_factory=list)

    def summary(self) -> str:
        return (f"{self.pages} pages, {self.internal} internal links ({self.anchored} with an #anchor) checked, "
                f"{len(self.broken)} broken; {self.external} external links not fetched")


def _target_file(site: pathlib.Path, page_rel: str, path: str) -> pathlib.Path | None:
    """The file a relative or site-absolute link path names (a directory means its index.html)."""
    base = posixpath.dirname(page_rel)
    joined = posixpath.normpath(path.lstrip("/") if path.startswith("/") else posixpath.join(base, path))
    if joined.startswith(".."):
        return None
    target = site / joined
    if target.is_dir():
        target = target / "index.html"
    return target if target.is_file() else None


def check_site(site: str | pathlib.Path) -> Report:
    """Parses every ``*.html`` under ``site`` and checks its internal links and anchors.

    Args:
      site: the directory ``mkdocs build`` wrote.

    Returns:
      A :class:`Report`; ``report.broken`` lists ``"page: link (why)"`` for each broken link.
    """
    site = pathlib.Path(site)
    parsed: dict[str, _Page] = {}
    for f in sorted(site.rglob("*.html")):
        p = _Page()
        p.feed(f.read_text(errors="replace"))
        parsed[f.relative_to(site).as_posix()] = p
    report = Report(pages=len(parsed))
    for page_rel, p in parsed.items():
        for link in p.links:
            url = urllib.parse.urlsplit(link)
            if url.scheme or link.startswith("//"):
                report.external += 1
                continue
            if not url.path and not url.fragment:
                continue  # "" or "?query": the page itself
            report.internal += 1
            path = urllib.parse.unquote(url.path)
            target = site / page_rel if not path else _target_file(site, page_rel, path)
            if target is None:
                report.broken.append(f"{page_rel}: {link} (no such file)")
                continue
            if url.fragment:
                report.anchored += 1
                rel = target.relative_to(site).as_posix()
                anchors = parsed[rel].anchors if rel in parsed else None
                if anchors is not None and urllib.parse.unquote(url.fragment) not in anchors:
                    report.broken.append(f"{page_rel}: {link} (no id {url.fragment!r} in {rel})")
    return report


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python tests/_support/_linkcheck.py SITE_DIR")
    result = check_site(sys.argv[1])
    print("\n".join(result.broken))
    print(result.summary())
    sys.exit(1 if result.broken else 0)
