"""The Ollama Modelfile's quoting against a port of Ollama's own parser (ollama/ollama parser/parser.go, ParseFile):
a system prompt that would end its triple-quoted value early (and smuggle ADAPTER / PARAMETER lines in) is refused
with one line; every other text reads back as exactly the text, with only the expected commands."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import yaml

from lorarl.config import recipe_from_dict
from lorarl.errors import LorarlError
from lorarl.export.ollama import modelfile_text

# ---- Ollama's ParseFile, rune by rune (states, transitions and the value rule as in parser.go) ----------------------

NIL, NAME, VALUE, PARAMETER, MESSAGE, COMMENT = range(6)
COMMANDS = {"from", "license", "template", "system", "adapter", "draft", "renderer", "parser", "parameter", "message"}
COMMANDS |= {"requires"}


def _is_alpha(c: str) -> bool:
    return "a" <= c <= "z" or "A" <= c <= "Z"


def _step(c: str, state: int) -> tuple[int, str | None]:
    """parseRuneForState: the next state and the rune to keep (None: Go's 0)."""
    space, newline = c in " \t", c in "\r\n"
    if state == NIL:
        return (COMMENT, None) if c == "#" else (NIL, None) if space or newline else (NAME, c)
    if state == NAME:
        if _is_alpha(c):
            return NAME, c
        if space:
            return VALUE, None
        raise ValueError("invalid command")
    if state == VALUE:
        return (NIL, c) if space or newline else (VALUE, c)
    if state == PARAMETER:
        if _is_alpha(c) or c.isdigit() or c == "_":
            return PARAMETER, c
        if space:
            return VALUE, None
        raise ValueError("unexpected EOF")
    if state == MESSAGE:
        if _is_alpha(c):
            return MESSAGE, c
        if space:
            return VALUE, None
        raise ValueError("unexpected EOF")
    return (NIL, None) if newline else (COMMENT, None)


def _unquote(s: str) -> tuple[str, bool]:
    if s[:3] == '"""':
        return (s[3:-3], True) if len(s) >= 6 and s[-3:] == '"""' else ("", False)
    if s[:1] == '"':
        return (s[1:-1], True) if len(s) >= 2 and s[-1] == '"' else ("", False)
    return s, True


def parse_modelfile(text: str) -> list[tuple[str, str]]:
    """The commands Ollama reads from ``text``: ``[(name, args)]`` (``model`` for FROM, a parameter's own name)."""
    commands: list[tuple[str, str]] = []
    name, role, buf, state = "", "", "", NIL
    for c in text:
        nxt, kept = _step(c, state)
        if nxt != state:
            if state == NAME:
                word = buf.lower()
                if word not in COMMANDS:
                    raise ValueError(f"invalid command {buf!r}")
                name = "model" if word == "from" else word
                nxt = {"parameter": PARAMETER, "message": MESSAGE}.get(word, nxt)
            elif state == PARAMETER:
                name = buf
            elif state == MESSAGE:
                role = buf
            elif state == VALUE:
                value, ok = _unquote(buf.strip(" \t\r\n"))
                if not ok or c in " \t":
                    buf += c
                    continue
                commands.append((name, f"{role}: {value}" if role else value))
                role = ""
            buf, state = "", nxt
        if kept is not None and kept.isprintable():  # Go's strconv.IsPrint: the same classes
            buf += kept
    if state == VALUE:
        value, ok = _unquote(buf.strip(" \t\r\n"))
        if not ok:
            raise ValueError("unexpected EOF")
        commands.append((name, value))
    elif state not in (NIL, COMMENT):
        raise ValueError("unexpected EOF")
    return commands


# ---- the quoting ------------------------------------------------------------------------------------------------

INJECTED = "\nADAPTER /elsewhere/x.gguf\nPARAMETER num_ctx 1"
HOSTILE = [
    'Be nice."""""' + INJECTED,  # the review's: five quotes defeated `"""` -> `" " "`
    '"""' + INJECTED,
    'x"""  \t\r' + INJECTED,  # spaces and a tab before a carriage return
    'x""\u200b"' + INJECTED,  # a zero-width space the parser drops between the quotes
    'x"""\u00a0\u2028' + INJECTED,  # characters the parser drops before the line break
    'x"""\n FROM /elsewhere/base.gguf',
]
FAITHFUL = [
    'He said """hi""" and left',  # three quotes, but not at the end of a line
    '"""starts with three quotes',
    'ends with a quote"',
    '"',
    '""',
    'x"""y\nz"""w',
    "line one" + INJECTED,  # commands inside the value stay text
    "# not a comment\nFROM /elsewhere\n\tindented",
    'tab\tand "quoted" text \u00e9\u4e2d',
]


@pytest.fixture(scope="module")
def tok(default_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir)


def _modelfile(system_prompt: str, tok) -> tuple[str, list[str]]:
    recipe = recipe_from_dict({"algo": "grpo", "data": {"system_prompt": system_prompt}})
    text, _, notes = modelfile_text("m.gguf", tok, ["<|im_end|>", 'a"b'], SimpleNamespace(recipe=recipe))
    return text, notes


def test_the_parser_port_reads_what_ollama_reads():
    """The port against parser_test.go's cases: a multi-line triple-quoted value, quotes inside, comments."""
    text = 'FROM foo\nSYSTEM """\nline one\n"quoted"\n"""\n# a comment\nPARAMETER stop "<|x|>"\nPARAMETER top_k 40\n'
    assert parse_modelfile(text) == [
        ("model", "foo"),
        ("system", '\nline one\n"quoted"\n'),
        ("stop", "<|x|>"),
        ("top_k", "40"),
    ]
    assert parse_modelfile('FROM foo\nMESSAGE user """hi\nthere"""\n') == [
        ("model", "foo"),
        ("message", "user: hi\nthere"),
    ]
    with pytest.raises(ValueError):
        parse_modelfile('FROM foo\nSYSTEM """never closed\n')


@pytest.mark.parametrize("prompt", HOSTILE)
def test_a_system_prompt_that_would_end_its_value_is_refused(prompt, tok):
    naive = parse_modelfile('FROM ./m.gguf\nSYSTEM """' + prompt + '"""\n')  # the text in triple quotes, unchecked
    assert any(name not in ("model", "system") for name, _ in naive) or len(naive) > 2  # it is an injection
    with pytest.raises(LorarlError, match=r"^data\.system_prompt: three quotes at the end of a line") as e:
        _modelfile(prompt, tok)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("prompt", FAITHFUL)
def test_every_other_system_prompt_reads_back_as_itself(prompt, tok):
    text, notes = _modelfile(prompt, tok)
    commands = parse_modelfile(text)
    names = [name for name, _ in commands]
    assert names == ["model", "template", "system", "stop", "stop"] + [
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "repeat_penalty",
        "num_predict",
    ]
    assert dict(commands)["model"] == "./m.gguf" and [v for n, v in commands if n == "stop"] == ["<|im_end|>", 'a"b']
    assert dict(commands)["system"] == prompt
    assert notes == []


def test_characters_ollama_drops_are_noted(tok):
    text, notes = _modelfile("zero\u200bwidth and\u00a0nbsp", tok)
    assert dict(parse_modelfile(text))["system"] == "zerowidth andnbsp"
    assert notes == [
        "Modelfile: Ollama's parser drops the 2 non-printable character(s) of data.system_prompt (zero-width, control "
        "or non-ASCII space characters) that the model trained with"
    ]


def test_gguf_export_refuses_it_before_the_merge(tmp_path, default_model_dir):
    """Checked with the other options, before the slow merge and conversion; nothing is written."""
    from lorarl.config import Recipe, recipe_to_dict
    from lorarl.export import export

    run = tmp_path / "run"
    (run / "policy").mkdir(parents=True)
    for name in ("adapter_config.json", "adapter_model.safetensors"):  # never read: refused before
        (run / "policy" / name).write_text("{}")
    recipe = Recipe()
    recipe.model.name = str(default_model_dir)
    recipe.data.system_prompt = HOSTILE[0]
    (run / "recipe.yaml").write_text(yaml.safe_dump(recipe_to_dict(recipe), sort_keys=False))
    with pytest.raises(LorarlError, match=r"^data\.system_prompt: three quotes"):
        export(run, tmp_path / "out", fmt="gguf", gate_n=0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
