"""MkDocs hook for the documentation site (mkdocs.yml ``hooks:``): API pages may name modules not written yet.

A ``::: lorarl.x`` line whose module is listed in ``extra.api_pending`` and has no source file becomes a note, so the
strict build passes before the module lands; once its file exists the build fails with one line saying to drop it from
the list (mkdocstrings then renders it, and a missing module fails the strict build as it should)."""

from __future__ import annotations

import re
from pathlib import Path

from mkdocs.exceptions import PluginError

ROOT = Path(__file__).resolve().parents[1]
DIRECTIVE = re.compile(r"^::: *([\w.]+)[ \t]*$", re.M)


def module_exists(name: str, root: Path = ROOT) -> bool:
    """Whether the module ``name`` (``lorarl.api``) has a source file under ``root``: ``lorarl/api.py`` or
    ``lorarl/api/__init__.py``."""
    path = root.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def on_config(config, **kwargs):
    for name in config.extra.get("api_pending", []):
        if module_exists(name):
            raise PluginError(f"mkdocs.yml: {name} exists now: drop it from extra.api_pending")
    return config


def on_page_markdown(markdown: str, page, config, **kwargs) -> str:
    pending = set(config.extra.get("api_pending", []))

    def note(m: re.Match) -> str:
        name = m.group(1)
        if name in pending:
            return f'!!! note "Not written yet"\n    `{name}` is not in this release yet.\n'
        return m.group(0)

    return DIRECTIVE.sub(note, markdown)


ROLE = re.compile(r":(?:func|class|mod|meth|data|attr|obj|exc|py:\w+):`~?\.?([^`]+)`")


def markdown_docstring(text: str) -> str:
    """A docstring written for Sphinx / doctest, as Markdown: ``>>>`` examples (with their output, up to the next blank
    line) become fenced Python blocks, a block indented under a blank line (a formula table, a command line) becomes a
    fenced text block that keeps its line breaks and alignment, and ``:func:`name``` roles become code.

    >>> markdown_docstring("Sum.\\n\\n>>> 1 + 1\\n2")
    'Sum.\\n\\n```python\\n>>> 1 + 1\\n2\\n```'
    >>> markdown_docstring("A:\\n\\n  x = 1\\n    y = 2\\nB, :func:`.f`,\\n  continued.\\n>>> f()")
    'A:\\n\\n```text\\nx = 1\\n  y = 2\\n```\\n\\nB, `f`,\\n  continued.\\n\\n```python\\n>>> f()\\n```'
    """
    lines = text.split("\n")
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        after_blank = i == 0 or not lines[i - 1].strip()
        if line.lstrip().startswith(">>>"):
            j = i
            while j < len(lines) and lines[j].strip():
                j += 1
            out += _fenced("python", lines[i:j], after=out)
            i = j
            continue
        if after_blank and line.startswith("  ") and line.strip():
            j = i
            while j < len(lines) and (lines[j].startswith("  ") or not lines[j].strip()):
                j += 1
            while not lines[j - 1].strip():  # trailing blank lines stay outside the block
                j -= 1
            block = lines[i:j]
            indent = min(len(b) - len(b.lstrip()) for b in block if b.strip())
            out += _fenced("text", [b[indent:] for b in block], after=out)
            i = j
            continue
        if out and out[-1] == "```" and line.strip():
            out.append("")  # a paragraph starts after a blank line
        out.append(ROLE.sub(r"`\1`", line))
        i += 1
    return "\n".join(out)


def _fenced(lang: str, block: list[str], after: list[str]) -> list[str]:
    """``block`` as a fenced code block, with the blank line Markdown needs before it when ``after`` ends in text."""
    return [*([""] if after and after[-1].strip() else []), f"```{lang}", *block, "```"]


try:  # the griffe extension (mkdocs.yml: mkdocstrings' python handler ``extensions``); griffe comes with the docs extra
    import griffe

    class MarkdownDocstrings(griffe.Extension):
        """Rewrites every docstring with :func:`markdown_docstring` before mkdocstrings renders it."""

        def on_object(self, *, obj, **kwargs) -> None:
            if obj.docstring is not None:
                obj.docstring.value = markdown_docstring(obj.docstring.value)

except ImportError:  # pragma: no cover - the docs extra is not installed
    pass
