"""The front door and the documentation site (issue 33): the README stays at most 15 KB, the site (mkdocs.yml,
mkdocs-material, the API reference from the docstrings by mkdocstrings) builds with ``--strict`` (every link and
anchor checked), every page under docs/ is reachable from the home page, no measured figure of the 63 KB README of
commit 415bbea was lost when it moved into docs/, and the README's own links point at files that exist."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import yaml

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCS = REPO / "docs"
# the figures of the README of commit 415bbea (before the move), one per line, as figures() reads them:
# git show 415bbea:README.md | PYTHONPATH=tests python -c "import sys; from test_docs_site import figures; \
#     print(*figures(sys.stdin.read()), sep=chr(10))" >> tests/readme_figures_415bbea.txt
OLD_FIGURES = Path(__file__).with_name("readme_figures_415bbea.txt")

UNITS = r"%|x|ms|s|min|h|GB|GiB|MB|MiB|KB|nats|tokens|points|steps"
# a number with a unit (22.5%, 8 min, 5.2 GB, 4.0x), or any number with a decimal point (table cells: 3.05, 0.9025)
FIGURE = re.compile(r"(?<![\w./])(\d[\d,]*\.\d+|\d[\d,]*(?=\s?(?:" + UNITS + r")(?!\w)))(\s?(?:" + UNITS + r")(?!\w))?")
LINK = re.compile(r"\]\(([^)\s]+)\)")


def figures(text: str) -> list[str]:
    """The measured figures of a Markdown text, in order, each once, whitespace inside a figure as one space."""
    found = (re.sub(r"\s+", " ", m.group(1) + (m.group(2) or "")) for m in FIGURE.finditer(text))
    return list(dict.fromkeys(found))


def appears(figure: str, text: str) -> bool:
    """Whether ``figure`` is in ``text`` (whitespace normalised) as a whole figure: ``0.9`` is not in ``0.9025``."""
    return re.search(r"(?<![\d.])" + re.escape(figure) + r"(?![\d])", text) is not None


def _yaml(path: Path) -> dict:
    """mkdocs.yml without its Python tags (the slugify function): unknown tags load as None."""

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_multi_constructor("tag:yaml.org,2002:python/", lambda loader, suffix, node: None)
    return yaml.load(path.read_text(), Loader=Loader)


def _nav_pages(nav) -> set[str]:
    if isinstance(nav, str):
        return {nav}
    if isinstance(nav, list):
        return set().union(*(_nav_pages(item) for item in nav))
    if isinstance(nav, dict):
        return set().union(*(_nav_pages(v) for v in nav.values()))
    return set()


def _mkdocs(config: Path, site: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )


def test_readme_is_a_front_door_of_at_most_15_kb():
    text = README.read_text()
    assert len(text.encode()) <= 15_000, f"README.md is {len(text.encode())} bytes; move sections into docs/"
    # the two commands, exactly as the scripts are named
    assert "bash scripts/quickstart.sh" in text and "bash scripts/test.sh" in text
    assert (REPO / "scripts" / "quickstart.sh").is_file() and (REPO / "scripts" / "test.sh").is_file()


def test_the_site_builds_strictly(tmp_path):
    """``mkdocs build --strict`` on the real site: a broken link, a missing anchor, a page left out of the nav, a
    docstring mkdocstrings cannot render fails it."""
    result = _mkdocs(REPO / "mkdocs.yml", tmp_path / "site")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "WARNING" not in result.stderr, result.stderr[-3000:]
    api = (tmp_path / "site" / "api" / "core" / "index.html").read_text()
    assert "group_advantages" in api and "ppo_clip_loss" in api  # the reference is generated from the code
    assert '<span class="o">&gt;&gt;&gt;</span>' in api  # doctest examples render as highlighted Python


def test_a_missing_module_fails_the_strict_build_unless_pending(tmp_path):
    """mkdocstrings fails the strict build on a module that does not exist; listed in ``extra.api_pending`` it is a
    note instead (what mkdocs.yml does for API modules not written yet)."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "index.md").write_text("# API\n\n::: lorarl.no_such_module\n")
    config = {
        "site_name": "t",
        "docs_dir": str(tmp_path / "docs"),
        "hooks": [str(REPO / "scripts" / "mkdocs_hooks.py")],
        "plugins": [{"mkdocstrings": {"handlers": {"python": {"paths": [str(REPO)]}}}}],
    }
    (tmp_path / "a.yml").write_text(yaml.safe_dump(config))
    failed = _mkdocs(tmp_path / "a.yml", tmp_path / "site")
    assert failed.returncode != 0 and "lorarl.no_such_module" in failed.stderr
    (tmp_path / "b.yml").write_text(yaml.safe_dump({**config, "extra": {"api_pending": ["lorarl.no_such_module"]}}))
    assert _mkdocs(tmp_path / "b.yml", tmp_path / "site").returncode == 0
    assert "Not written yet" in (tmp_path / "site" / "index.html").read_text()


def test_pending_api_modules_are_really_missing():
    """The hook's guard: a module in ``extra.api_pending`` that exists fails the build with the line to fix it."""
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import mkdocs_hooks
    finally:
        sys.path.remove(str(REPO / "scripts"))
    assert mkdocs_hooks.module_exists("lorarl.config") and mkdocs_hooks.module_exists("lorarl.core.losses")
    assert not mkdocs_hooks.module_exists("lorarl.no_such_module")
    for name in _yaml(REPO / "mkdocs.yml")["extra"]["api_pending"]:
        assert not mkdocs_hooks.module_exists(name), f"{name} exists: drop it from mkdocs.yml extra.api_pending"
    page = "# x\n\n::: lorarl.api\n\n::: lorarl.config\n"
    out = mkdocs_hooks.on_page_markdown(page, None, SimpleNamespace(extra={"api_pending": ["lorarl.api"]}))
    assert "::: lorarl.config" in out and "::: lorarl.api" not in out and "`lorarl.api` is not in" in out
    assert mkdocs_hooks.markdown_docstring("See :func:`.gae`.\n\n>>> gae(1)\n2\nAfter.") == (
        "See `gae`.\n\n```python\n>>> gae(1)\n2\nAfter.\n```"
    )
    # a formula table indented under a blank line keeps its lines; a list item's continuation line does not fence
    doc = "Advantages:\n\n  group: A = r - mu\n    (per group)\n* item\n  continued"
    assert mkdocs_hooks.markdown_docstring(doc) == (
        "Advantages:\n\n```text\ngroup: A = r - mu\n  (per group)\n```\n\n* item\n  continued"
    )


def test_every_page_is_reachable_from_the_home_page():
    """Each docs/**/*.md is in the nav or linked from a page that is (breadth-first from index.md)."""
    pages = {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")}
    reached = set(_nav_pages(_yaml(REPO / "mkdocs.yml")["nav"])) | {"index.md"}
    todo = list(reached)
    while todo:
        page = todo.pop()
        if page not in pages:
            continue
        for target in LINK.findall((DOCS / page).read_text()):
            path = target.split("#")[0]
            if path.endswith(".md") and "://" not in path:
                resolved = (DOCS / page).parent.joinpath(path).resolve()
                if resolved.is_relative_to(DOCS.resolve()):
                    name = resolved.relative_to(DOCS.resolve()).as_posix()
                    if name not in reached:
                        reached.add(name)
                        todo.append(name)
    assert not sorted(pages - reached), f"pages no nav entry or link reaches: {sorted(pages - reached)}"
    assert not sorted(_nav_pages(_yaml(REPO / "mkdocs.yml")["nav"]) - pages), "nav names a page that is not there"


def test_the_figure_extractor():
    text = "took 8 min 33 s, peak RSS 5.2 GB,\n77.0% (+54.5\npoints), 4.0x; 3.05 | -1.07; r 16; step-000006 v0.50, 3 s"
    assert figures(text) == ["8 min", "33 s", "5.2 GB", "77.0%", "54.5 points", "4.0x", "3.05", "1.07", "3 s"]
    assert appears("0.9", "x 0.9 y") and not appears("0.9", "0.9025") and not appears("5.2 GB", "15.2 GB")


def test_no_measured_figure_of_the_old_readme_was_lost():
    """Every figure of the 63 KB README (415bbea) is in README.md or a page under docs/."""
    old = [ln for ln in OLD_FIGURES.read_text().splitlines() if ln and not ln.startswith("#")]
    assert len(old) > 300 and {"77.0%", "0.9025", "20.2", "7.50 GiB", "99.5%", "3.48"} <= set(old)
    corpus = " ".join(p.read_text() for p in [README, *sorted(DOCS.rglob("*.md"))])
    corpus = re.sub(r"\s+", " ", corpus)
    lost = [f for f in old if not appears(f, corpus)]
    assert not lost, f"figures of the old README found nowhere in README.md or docs/: {lost}"


def test_readme_links_point_at_files_that_exist():
    for target in LINK.findall(README.read_text()):
        if "://" in target or target.startswith("#"):
            continue
        assert (REPO / target.split("#")[0]).exists(), f"README.md links to {target}, which does not exist"
