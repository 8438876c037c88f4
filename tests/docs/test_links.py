"""Every internal link and #anchor of the built documentation site resolves (no network needed)."""

import importlib.util
import os
import subprocess
import sys

import pytest
from tests._support._linkcheck import check_site
from tests._support._markdown import ROOT


def test_the_checker_finds_a_missing_page_and_a_missing_anchor(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "index.html").write_text(
        '<h1 id="top">x</h1><a href="a/">ok</a><a href="a/#here">ok</a><a href="#top">ok</a>'
        '<a href="b/">missing page</a><a href="a/#nowhere">missing anchor</a><a href="https://example.org">ext</a>')
    (tmp_path / "a" / "index.html").write_text('<h2 id="here">a</h2><a href="../index.html#top">ok</a>')
    report = check_site(tmp_path)
    assert sorted(report.broken) == ["index.html: a/#nowhere (no id 'nowhere' in a/index.html)",
                                     "index.html: b/ (no such file)"]
    assert (report.internal, report.external) == (6, 1)


@pytest.mark.slow  # builds the whole site: ~6 s on 2 cores
@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("mkdocstrings") is None,
                    reason="mkdocs is not installed (pip install -e '.[docs]')")
def test_every_internal_link_and_anchor_of_the_built_site_resolves(tmp_path):
    site = tmp_path / "site"
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)], cwd=ROOT,
                          capture_output=True, text=True, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = check_site(site)
    assert report.pages > 20 and report.anchored > 100, report.summary()
    assert not report.broken, report.summary() + "\n" + "\n".join(report.broken)
