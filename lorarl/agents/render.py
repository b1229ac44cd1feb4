"""Rendering conversations to token ids without ever re-tokenizing a trajectory, and the template check that makes
that exact.

A trajectory is built by appending: the prompt's ids (the template with the generation prompt), then the ids the
model sampled, then the ids of the tool messages (:meth:`ChatRenderer.tool_suffix_ids`), then the next sampled ids,
... The tool messages' ids are what the template writes after an assistant turn that ended with the end-of-turn
token: rendered with a placeholder conversation (TRL's ``_get_tool_suffix_ids`` does the same), cut after the
placeholder's last end-of-turn token.

That is only right when the template has the *prefix property*: rendering turn ``k + 1`` extends the rendering of
turn ``k`` token for token. Templates that re-render earlier turns differently once more follow (dropping earlier
reasoning, moving the tools, a date that changes; trl#6124) break it, and the ids the model trained on would then
not be the conversation the template describes. :meth:`ChatRenderer.check_prefix_property` renders a two-round
tool conversation turn by turn and refuses such a template with one line.
"""

from __future__ import annotations

from lorarl.agents.formats import ToolCall, ToolFormat
from lorarl.errors import LorarlError


def _cut_after_last(ids: list[int], stop_ids: set[int]) -> list[int]:
    """``ids`` up to and including the last id in ``stop_ids`` (unchanged when none occurs)."""
    for i in range(len(ids) - 1, -1, -1):
        if ids[i] in stop_ids:
            return ids[: i + 1]
    return ids


class ChatRenderer:
    """A tokenizer's chat template, a tool format and the tools' schemas: prompts and tool messages as ids."""

    def __init__(self, tokenizer, fmt: ToolFormat, schemas: list[dict], eos_ids: list[int]):
        if getattr(tokenizer, "chat_template", None) is None:
            raise LorarlError("agent: the tokenizer has no chat template (tool use needs one)")
        self.tok, self.fmt, self.schemas, self.eos_ids = tokenizer, fmt, schemas, set(eos_ids)

    def render(self, messages: list[dict], generation_prompt: bool, schemas: list[dict] | None = None) -> list[int]:
        """The template's ids of ``messages`` (tools rendered per the format)."""
        schemas = self.schemas if schemas is None else schemas
        msgs = self.fmt.prompt_messages(messages, schemas)
        kwargs = {"tools": schemas} if self.fmt.template_tools and schemas else {}
        out = self.tok.apply_chat_template(
            msgs, add_generation_prompt=generation_prompt, tokenize=True, return_dict=False, **kwargs
        )
        return list(out)

    def prompt_ids(self, messages: list[dict], schemas: list[dict] | None = None) -> list[int]:
        """The prompt the first turn is sampled after: ``messages`` and the generation prompt."""
        return self.render(messages, True, schemas)

    def _placeholder(self, name: str) -> list[dict]:
        call = ToolCall(name, {})
        return [{"role": "user", "content": "x"}, self.fmt.assistant_message("", [call])]

    def tool_suffix_ids(self, results: list[tuple[str, str]]) -> list[int]:
        """Ids that follow an assistant turn ending in its end-of-turn token: the tool messages carrying
        ``results`` (``[(tool name, text)]``) and the next generation prompt."""
        head = self._placeholder(results[0][0] if results else "tool")
        before = _cut_after_last(self.render(head, False, []), self.eos_ids)
        after = self.render(head + self.fmt.tool_messages(results), True, [])
        if after[: len(before)] != before:
            raise LorarlError(
                "agent: the chat template renders an assistant turn differently once tool messages follow it "
                "(prefix property broken); lorarl cannot append tool results as ids with it"
            )
        return after[len(before) :]

    def check_prefix_property(self) -> None:
        """Render a two-round tool conversation turn by turn; each rendering must extend the previous one: token for
        token where tool messages follow an assistant turn (cut after its end-of-turn token: those ids are appended
        as rendered), as text where a model turn follows a generation prompt (the model's ids are its own samples,
        so only the prompt's ids are used and a tokenizer may merge the seam differently). Raises a one-line
        :class:`LorarlError` naming the first turn that breaks it."""
        call1 = self.fmt.assistant_message("", [ToolCall("calculator", {"expression": "12 * 34"})])
        call2 = self.fmt.assistant_message("", [ToolCall("calculator", {"expression": "408 + 1"})])
        conv = [
            ({"role": "user", "content": "What is 12 * 34 + 1?"}, True),
            (call1, False),
            (self.fmt.tool_messages([("calculator", "408")]), True),
            (call2, False),
            (self.fmt.tool_messages([("calculator", "409")]), True),
            ({"role": "assistant", "content": "409"}, False),
        ]
        messages: list[dict] = []
        previous: list[int] | None = None
        previous_gen = False
        for k, (msg, gen) in enumerate(conv):
            messages = messages + (msg if isinstance(msg, list) else [msg])
            ids = self.render(messages, gen)
            if previous is None:
                ok = True
            elif previous_gen:  # a model turn follows: its ids are sampled, never the template's, so the text must
                # extend (the template's tokens at the seam may merge with the content's first characters)
                ok = self.tok.decode(ids).startswith(self.tok.decode(previous))
            else:  # tool messages follow the model's end-of-turn: appended as the template's ids, token for token
                ok = ids[: len(previous)] == previous
            if not ok:
                raise LorarlError(
                    f"agent: the chat template breaks the prefix property: rendering turn {k + 1} does not extend "
                    f"turn {k} token for token (it re-renders earlier turns), so tool results cannot be appended as "
                    "ids; use a template that renders earlier turns unchanged"
                )
            previous = ids if gen else _cut_after_last(ids, self.eos_ids)
            previous_gen = gen
