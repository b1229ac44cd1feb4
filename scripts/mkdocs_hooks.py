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
    line) become fenced Python blocks, and ``:func:`name``` roles become code.

    >>> markdown_docstring("Sum.\\n\\n>>> 1 + 1\\n2")
    'Sum.\\n\\n```python\\n>>> 1 + 1\\n2\\n```'
    """
    out: list[str] = []
    in_example = False
    for line in text.split("\n"):
        if not in_example and line.lstrip().startswith(">>>"):
            out.append("```python")
            in_example = True
        elif in_example and not line.strip():
            out.append("```")
            in_example = False
        out.append(line if in_example else ROLE.sub(r"`\1`", line))
    if in_example:
        out.append("```")
    return "\n".join(out)


try:  # the griffe extension (mkdocs.yml: mkdocstrings' python handler ``extensions``); griffe comes with the docs extra
    import griffe

    class MarkdownDocstrings(griffe.Extension):
        """Rewrites every docstring with :func:`markdown_docstring` before mkdocstrings renders it."""

        def on_object(self, *, obj, **kwargs) -> None:
            if obj.docstring is not None:
                obj.docstring.value = markdown_docstring(obj.docstring.value)

except ImportError:  # pragma: no cover - the docs extra is not installed
    pass
