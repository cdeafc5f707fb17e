"""`make docs` builds offline, and its checks catch what they are for: a public name without a docstring, a link
between pages that leads nowhere, a `jaxnn.` name in backticks that names nothing."""

import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("build_docs", REPO / "tools" / "build_docs.py")
build_docs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(build_docs)


@pytest.mark.slow
def test_docs_build_with_no_problem(tmp_path):
    problems = build_docs.build(tmp_path)
    assert problems == []
    front = (REPO / "docs" / "index.md").read_text()
    for page in build_docs.PAGES[1:]:
        assert f"]({page}.md)" in front, f"docs/index.md links {page}.md"
        assert (tmp_path / f"{page}.html").is_file()
    layers = (tmp_path / "jaxnn" / "layers.html").read_text()
    assert 'id="Dense"' in layers and "Affine map over the last axis" in layers  # rendered from the docstring
    assert 'href="jaxnn/precision.html#Policy"' in (tmp_path / "precision.html").read_text()


@pytest.mark.filterwarnings("ignore:Error parsing type annotation")
def test_a_missing_docstring_is_reported(monkeypatch):
    import jaxnn.parallel.mesh

    monkeypatch.setattr(jaxnn.parallel.mesh.replicated, "__doc__", None)
    assert "no docstring: jaxnn.parallel.mesh.replicated" in build_docs.undocumented(build_docs.load_modules())


def test_broken_links_and_references_are_reported(tmp_path):
    (tmp_path / "a.html").write_text('<h2 id="here">x</h2><a href="a.html#here">ok</a><a href="https://x.org">ok</a>')
    (tmp_path / "b.html").write_text('<a href="missing.html">x</a><a href="a.html#nowhere">y</a>')
    assert build_docs.broken_links(tmp_path) == [
        "b.html: link to missing missing.html",
        "b.html: link to missing anchor a.html#nowhere",
    ]
    text = {"page.md": "`jaxnn.layers.Dense` and `jaxnn.layers.Dnese(3)` and `jaxnn.nothing`"}
    assert build_docs.broken_references(text) == [
        "page.md: `jaxnn.layers.Dnese` names nothing in jaxnn",
        "page.md: `jaxnn.nothing` names nothing in jaxnn",
    ]
