"""The pieces one ``generate`` call needs to serve several panes at once: the prompt text, a streamer that decodes
every row incrementally (so all panes stream together), and a stopping criterion for the Stop button."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from lorarl.model.sampling import StopFlag, stopping_criteria  # noqa: F401  (the Stop button's criterion)


def render_prompt(tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> str:
    """The chat template applied to ``messages`` (a plain ``role: content`` fallback for tokenizers without one)."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
    return text + ("assistant:" if add_generation_prompt else "")


class PaneStreamer:
    """Receives the ``[B]`` new tokens of each decoding step and decodes every row incrementally (transformers'
    streamer protocol: ``put`` then ``end``).

    The first ``put`` is the prompt (skipped). A row's text stops growing at its first EOS. ``on_text(row, text)``
    is called for rows whose visible text changed (an unfinished multi-byte character is held back).
    """

    def __init__(self, tokenizer, eos_ids: Iterable[int], n_rows: int, on_text: Callable[[int, str], None]):
        self.tok = tokenizer
        self.eos = set(eos_ids)
        self.ids: list[list[int]] = [[] for _ in range(n_rows)]
        self.done = [False] * n_rows
        self.text = [""] * n_rows
        self.on_text = on_text
        self.prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        rows = value.reshape(len(self.ids), -1).tolist()
        for r, toks in enumerate(rows):
            if self.done[r]:
                continue
            for t in toks:
                if t in self.eos:
                    self.done[r] = True
                    break
                self.ids[r].append(t)
            self._emit(r, final=self.done[r])

    def _emit(self, r: int, final: bool) -> None:
        text = self.tok.decode(self.ids[r], skip_special_tokens=True)
        if not final:
            text = text.rstrip("\ufffd")
        if text != self.text[r]:
            self.text[r] = text
            self.on_text(r, text)

    def end(self) -> None:
        for r in range(len(self.ids)):
            self._emit(r, final=True)
