"""The app's client API (``gradio_client``): ``/respond`` answers one prompt with several checkpoints in one
batch; ``/checkpoints`` and ``/rewards`` list what can be chosen. Only ids from those lists are accepted."""

from __future__ import annotations

import gradio as gr

from lorarl.chat.catalog import NO_REWARD
from lorarl.chat.inputs import check_seed, generation_from_ui, parse_columns
from lorarl.chat.session import ChatSession
from lorarl.errors import LorarlError


def register_api(session: ChatSession) -> None:
    """Add the API endpoints to the current ``gr.Blocks``."""
    catalog = session.catalog

    def respond(
        prompt: str,
        panes: list[str],
        system: str = "",
        temperature: float = 0.0,
        top_p: float = 1.0,
        max_new_tokens: int = 64,
        seed: int = 0,
        reward: str = NO_REWARD,
        columns: str = "",
    ) -> dict:
        """Answer one prompt with each checkpoint in ``panes`` (ids from /checkpoints), in one batch.

        Returns {"panes", "answers", "finished", "rewards", "tool_calls"} (``tool_calls``: per pane, the calls a
        pane of a run trained with tools made, [{"name", "arguments", "result", "error"}]); ``reward`` is an id from
        /rewards or "none",
        ``columns`` a JSON object of extra reward columns (e.g. {"answer": "42"}).
        """
        try:
            generation = generation_from_ui(temperature, top_p, max_new_tokens)
            cols = parse_columns(columns)
            return session.respond(prompt, list(panes), system, generation, reward, cols, seed=check_seed(seed))
        except LorarlError as e:
            raise gr.Error(str(e)) from None

    def checkpoints() -> list[dict]:
        """What panes can show: [{"id", "label", "kind"}], base first."""
        catalog.scan()
        return [{"id": i, "label": label, "kind": catalog.entries[i].kind} for label, i in catalog.choices()]

    def rewards_api() -> list[dict]:
        """What can score answers: [{"id", "label"}] ("none" turns rewards off)."""
        catalog.scan()
        return [{"id": i, "label": label} for label, i in catalog.scorer_choices()]

    gr.api(respond, api_name="respond")
    gr.api(checkpoints, api_name="checkpoints")
    gr.api(rewards_api, api_name="rewards")
