"""The Ollama ``Modelfile`` beside a GGUF export: FROM, the chat template in Ollama's (Go template) form, the default
system prompt, stop tokens and the recipe's sampling parameters.

The template is not translated from Jinja by hand-written parsing. Instead a few known chat formats (ChatML: SmolLM2,
Qwen2; Llama-3) are each written as a table (per role: the text before and after a message; the assistant prefix
that opens the reply; the default system prompt) and each is *checked*: rendered on probe conversations and compared
with the tokenizer's own ``apply_chat_template``. The first that reproduces it exactly on every probe is written out
as a Go template. When none does, the Modelfile has no TEMPLATE and Ollama uses the GGUF's own
``tokenizer.chat_template`` (it maps templates it knows to its own form); the notes say so.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lorarl.errors import LorarlError, quote
from lorarl.export.source import RunSource

ROLES = ("system", "user", "assistant")
# Probe conversations (messages, add_generation_prompt): every format must reproduce the tokenizer's rendering.
PROBES: list[tuple[list[dict[str, str]], bool]] = [
    ([{"role": "user", "content": "What is 2 + 3?"}], True),
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}], True),
    (
        [
            {"role": "system", "content": "S"},
            {"role": "user", "content": "U1"},
            {"role": "assistant", "content": "A1"},
            {"role": "user", "content": "U2"},
        ],
        True,
    ),
    ([{"role": "user", "content": "U"}, {"role": "assistant", "content": "A"}], False),
]


@dataclass
class ChatFormat:
    """A chat format as text around each message: ``begin`` + for each message ``prefix[role] + content +
    suffix[role]`` + ``generation`` (when a reply is asked for). ``default_system`` is inserted as the first message
    when a conversation has no system message (None: nothing is)."""

    name: str
    prefix: dict[str, str]
    suffix: dict[str, str]
    generation: str
    begin: str = ""
    default_system: str | None = None
    notes: list[str] = field(default_factory=list)

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        """The prompt text this format makes of ``messages`` (what the Go template renders)."""
        if self.default_system is not None and (not messages or messages[0]["role"] != "system"):
            messages = [{"role": "system", "content": self.default_system}] + messages
        text = self.begin + "".join(self.prefix[m["role"]] + m["content"] + self.suffix[m["role"]] for m in messages)
        return text + (self.generation if add_generation_prompt else "")

    def go_template(self) -> str:
        """Ollama's TEMPLATE (Go text/template over ``.Messages``), rendering exactly :meth:`render`'s text; no
        ``{{-`` trim markers, so every newline is the format's own. The default system prompt is the Modelfile's
        SYSTEM (Ollama puts it first in ``.Messages``); a last assistant message is left open (a prefill)."""
        parts = ["{{ range $i, $_ := .Messages }}{{ $last := eq (len (slice $.Messages $i)) 1 }}"]
        for k, role in enumerate(ROLES):
            keyword = "if" if k == 0 else "else if"
            close = "{{ if not $last }}" + self.suffix[role] + "{{ end }}" if role == "assistant" else self.suffix[role]
            parts.append(f'{{{{ {keyword} eq .Role "{role}" }}}}{self.prefix[role]}{{{{ .Content }}}}{close}')
        parts.append('{{ end }}{{ if and $last (ne .Role "assistant") }}' + self.generation + "{{ end }}{{ end }}")
        return self.begin + "".join(parts)


def _chatml() -> ChatFormat:
    return ChatFormat(
        name="chatml",
        prefix={r: f"<|im_start|>{r}\n" for r in ROLES},
        suffix={r: "<|im_end|>\n" for r in ROLES},
        generation="<|im_start|>assistant\n",
    )


def _llama3(bos: str) -> ChatFormat:
    return ChatFormat(
        name="llama-3",
        prefix={r: f"<|start_header_id|>{r}<|end_header_id|>\n\n" for r in ROLES},
        suffix={r: "<|eot_id|>" for r in ROLES},
        generation="<|start_header_id|>assistant<|end_header_id|>\n\n",
        begin=bos,
    )


def _default_system(fmt: ChatFormat, tok: Any) -> str | None:
    """The system prompt the tokenizer's template inserts when a conversation has none (None: it inserts none)."""
    text = tok.apply_chat_template([{"role": "user", "content": "U"}], tokenize=False, add_generation_prompt=False)
    head = fmt.begin + fmt.prefix["system"]
    if not text.startswith(head):
        return None
    rest = text[len(head) :]
    end = rest.find(fmt.suffix["system"])
    return rest[:end] if end >= 0 else None


def detect_chat_format(tok: Any) -> ChatFormat | None:
    """The known format that reproduces ``tok``'s chat template on every probe conversation, else None."""
    if not getattr(tok, "chat_template", None):
        return None
    bos = tok.bos_token or ""
    for fmt in (_chatml(), _llama3(bos)):
        fmt.default_system = _default_system(fmt, tok)
        try:
            if all(
                fmt.render(msgs, gen) == tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
                for msgs, gen in PROBES
            ):
                return fmt
        except Exception:  # a template that refuses a probe (e.g. needs alternating roles) is not this format
            continue
    return None


# Ollama's Modelfile parser (ollama/ollama parser/parser.go, ParseFile) has no escapes. A value ends at the first line
# break (\r or \n) where what it has read so far, stripped of white space, is a whole quoted value (for triple quotes:
# ends with three quotes); it drops every character Go's strconv.IsPrint rejects before it looks. So three quotes at
# the end of a line (then only spaces, tabs or dropped characters) end a triple-quoted value, and the lines after it
# are read as commands. The check is conservative: every character outside printable ASCII counts as dropped.
_MAY_BE_DROPPED = re.compile(r"[^\x20-\x7e\t\r\n]")
_ENDS_A_VALUE = re.compile(r'"""[ \t]*[\r\n]')


def _quote(text: str, what: str) -> str:
    """``text`` as a Modelfile value in triple quotes, exactly as Ollama's parser will read it back; a text that would
    end the value early (and turn the rest into commands: ``ADAPTER``, ``PARAMETER``, ...) is refused, naming
    ``what`` (the parser has no escapes, and changing the text would change what the model was trained with)."""
    seen = _MAY_BE_DROPPED.sub("", text)
    hit = _ENDS_A_VALUE.search(seen)
    if hit:
        snippet = seen[max(0, hit.start() - 20) : hit.end() + 20]
        raise LorarlError(
            f"{what}: three quotes at the end of a line ({quote(snippet)}) would end its value in the Ollama "
            "Modelfile, whose parser has no escapes, and the lines after it would be read as Modelfile commands; "
            "rephrase it (e.g. without the three quotes), or export --format merged"
        )
    return '"""' + text + '"""'


def _quote_stop(text: str) -> str:
    """A stop string: in plain quotes when it holds no quote (nothing can then end the value early), else as
    :func:`_quote`."""
    return f'"{text}"' if '"' not in text else _quote(text, f"stop token {quote(text)}")


def dropped_by_ollama(text: str) -> int:
    """How many characters of ``text`` Ollama's parser drops from a Modelfile value (not printable to Go's
    strconv.IsPrint, the same classes as Python's ``str.isprintable``; tabs and line breaks are kept)."""
    return sum(1 for c in text if not c.isprintable() and c not in "\t\r\n")


def check_system_prompt(src: RunSource) -> None:
    """Refuse, before the slow merge and conversion, a recipe system prompt the Modelfile cannot quote."""
    if src.recipe is not None and src.recipe.data.system_prompt:
        _quote(src.recipe.data.system_prompt, "data.system_prompt")


def _stops(tok: Any, folder: Path) -> list[str]:
    """The text of every EOS id (:func:`lorarl.model.tokens.eos_token_ids`: the tokenizer's and the generation
    config's): Ollama stops at them."""
    from types import SimpleNamespace

    from transformers import GenerationConfig

    from lorarl.model.tokens import eos_token_ids

    gen = GenerationConfig.from_pretrained(str(folder)) if (folder / "generation_config.json").is_file() else None
    return [tok.convert_ids_to_tokens(i) for i in eos_token_ids(SimpleNamespace(generation_config=gen), tok)]


def modelfile_text(
    gguf_file: str, tok: Any, stops: list[str], src: RunSource, report: dict | None = None
) -> tuple[str, ChatFormat | None, list[str]]:
    """The Modelfile, the chat format its TEMPLATE renders (None: no TEMPLATE, no known format matched) and notes.
    A run that trained with tools (``agent:``) gets the tool template where Ollama can carry it
    (:func:`lorarl.export.tools.ollama_tool_template`); ``report["tools"]`` (when given) says which, or why not."""
    from lorarl.export.tools import ollama_tool_template, tool_use

    recipe = src.recipe
    fmt = detect_chat_format(tok)
    use = tool_use(src, tok)
    tool_template, why = ollama_tool_template(use, fmt.name if fmt else None, tok) if use else (None, "")
    if report is not None and use is not None:
        report["tools"] = {"format": use.format, "template": use.format if tool_template else None, "why": why}
    notes: list[str] = []
    lines = [
        "# Ollama Modelfile written by lorarl: `ollama create NAME -f Modelfile` in this folder.",
        f"FROM ./{gguf_file}",
    ]
    system = recipe.data.system_prompt if recipe is not None and recipe.data.system_prompt else None
    what = "data.system_prompt"
    if tool_template is not None:
        lines += [
            f"# chat template: {fmt.name} with lorarl's system-prompt tool convention (tool calls, tool messages)"
        ]
        lines += ["# checked against the tokenizer's own rendering of a tool conversation", ""]
        lines.append(f"TEMPLATE {_quote(tool_template, 'the tool chat template')}")
        system = use.system_message  # the exact system message the run trained with: its text, then the tools
        what = "the system message with the tools (data.system_prompt, then the tools' descriptions)"
    elif fmt is not None:
        lines += [f"# chat template: {fmt.name}, checked against the tokenizer's own template", ""]
        lines.append(f"TEMPLATE {_quote(fmt.go_template(), 'the chat template (from the tokenizer)')}")
        system = system or fmt.default_system
        if use is not None:
            notes.append(f"Modelfile: no tool template ({why})")
    else:
        notes.append(
            "Modelfile: no known chat format matched the tokenizer's template; no TEMPLATE written, so Ollama uses "
            "the GGUF's own tokenizer.chat_template (check `ollama show --template NAME`)"
        )
    if system:
        lines.append(f"SYSTEM {_quote(system, what)}")
        if dropped_by_ollama(system):
            notes.append(
                f"Modelfile: Ollama's parser drops the {dropped_by_ollama(system)} non-printable character(s) of "
                f"{what} (zero-width, control or non-ASCII space characters) that the model trained with"
            )
    lines.append("")
    lines += [f"PARAMETER stop {_quote_stop(s)}" for s in stops]
    if recipe is not None:
        g = recipe.generation
        lines += [
            "# sampling as the run sampled (generation section of its recipe); no repetition penalty, as in training",
            f"PARAMETER temperature {g.temperature:g}",
            f"PARAMETER top_p {g.top_p:g}",
            f"PARAMETER top_k {g.top_k}",
            "PARAMETER min_p 0",
            "PARAMETER repeat_penalty 1",
            f"PARAMETER num_predict {g.max_new_tokens}",
        ]
    return "\n".join(lines) + "\n", fmt, notes


def write_modelfile(folder: Path, gguf_file: str, model_dir: Path, src: RunSource) -> dict:
    """Write ``folder/Modelfile`` for ``gguf_file`` from the merged model folder's tokenizer; returns
    ``{"file", "template", "notes"}`` (+ ``"tools"`` for a run that trained with tools)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    report: dict = {}
    text, fmt, notes = modelfile_text(gguf_file, tok, _stops(tok, model_dir), src, report)
    (folder / "Modelfile").write_text(text, encoding="utf-8")
    return {"file": "Modelfile", "template": fmt.name if fmt else None, "notes": notes, **report}
