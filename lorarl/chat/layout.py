"""The Gradio layout, top to bottom: header, pane count + Refresh, 2 to 4 panes (checkpoint picker, chat, reward,
👍 / 👎 for its answer alone), the prompt box, Stop / Regenerate / Clear, the vote row, the status line, and the settings panel. Builds components
only (call inside a ``gr.Blocks``); :mod:`lorarl.chat.handlers` wires their events."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import gradio as gr

from lorarl.chat.catalog import BASE_ID, NO_REWARD
from lorarl.chat.inputs import CHAT_DEFAULTS
from lorarl.chat.session import MAX_PANES

CSS = """
.pane-reward {min-height: 1.5em; font-size: 0.9em}
#status {min-height: 1.5em}
"""
VISIBLE_PANES = 2


@dataclass
class Panes:
    """The four pane columns (only the first :data:`VISIBLE_PANES` shown at first) and what each holds."""

    cols: list[Any]
    pickers: list[Any]
    bots: list[Any]
    rewards: list[Any]
    ups: list[Any] = field(default_factory=list)  # 👍 / 👎: the pane's last answer rated alone (a KTO row)
    downs: list[Any] = field(default_factory=list)


@dataclass
class Settings:
    """The settings panel, shared by all panes."""

    system: Any
    temperature: Any
    top_p: Any
    max_new: Any
    seed: Any
    reward: Any
    columns: Any

    def inputs(self) -> list[Any]:
        """In the order the generation handlers take them."""
        return [self.system, self.temperature, self.top_p, self.max_new, self.seed, self.reward, self.columns]


@dataclass
class Widgets:
    """Every component an event reads or writes."""

    turn: Any  # gr.State: system prompt and panes of the last request (what a vote records)
    n_panes: Any
    refresh: Any
    panes: Panes
    msg: Any
    send: Any
    stop: Any
    regen: Any
    clear: Any
    votes: dict[str, Any]  # "left" | "tie" | "right" -> button, plus "left_pane" / "right_pane" dropdowns
    status: Any
    settings: Settings
    allow_code: Any = None  # "Allow run code": lets the code the chosen reward / panes name run (lorarl.chat.consent)

    @property
    def outputs(self) -> list[Any]:
        """What a generation event writes: every pane's chat and reward, the prompt box, the status, the turn."""
        return [*self.panes.bots, *self.panes.rewards, self.msg, self.status, self.turn]


def default_picks(ids: list[str]) -> list[str]:
    """What the panes show at first: the base, then the first three other checkpoints, then the base again."""
    others = [i for i in ids if i != BASE_ID]
    picks = [BASE_ID] + others[:3]
    return picks + [BASE_ID] * (MAX_PANES - len(picks))


def _panes(choices: list[tuple[str, str]], picks: list[str]) -> Panes:
    panes = Panes([], [], [], [])
    with gr.Row(equal_height=False):
        for i in range(MAX_PANES):
            with gr.Column(visible=i < VISIBLE_PANES, min_width=240) as col:
                panes.pickers.append(gr.Dropdown(choices, value=picks[i], label=f"Pane {i + 1}", elem_id=f"pick-{i}"))
                panes.bots.append(
                    gr.Chatbot(
                        label=f"Pane {i + 1}", height=320, elem_id=f"chat-{i}", feedback_options=None, buttons=["copy"]
                    )
                )
                panes.rewards.append(gr.Markdown("", elem_id=f"reward-{i}", elem_classes=["pane-reward"]))
                with gr.Row():
                    panes.ups.append(gr.Button("👍 good", elem_id=f"up-{i}", size="sm", min_width=60))
                    panes.downs.append(gr.Button("👎 bad", elem_id=f"down-{i}", size="sm", min_width=60))
            panes.cols.append(col)
    return panes


def _vote_row() -> dict[str, Any]:
    numbers = list(range(1, MAX_PANES + 1))
    with gr.Row():
        return {
            "left_pane": gr.Dropdown(numbers, value=1, label="Vote: left pane", scale=1),
            "right_pane": gr.Dropdown(numbers, value=2, label="right pane", scale=1),
            "left": gr.Button("← Left better", elem_id="vote-left"),
            "tie": gr.Button("Tie", elem_id="vote-tie"),
            "right": gr.Button("Right better →", elem_id="vote-right"),
        }


def _settings(scorer_choices: list[tuple[str, str]]) -> Settings:
    d = CHAT_DEFAULTS
    with gr.Accordion("Settings", open=True):
        system = gr.Textbox(
            label="System prompt (shared; empty: the chat template's default)", lines=2, elem_id="system"
        )
        with gr.Row():
            temperature = gr.Slider(
                0.0, 2.0, value=d.temperature, step=0.05, label="Temperature (0 = greedy)", elem_id="temperature"
            )
            top_p = gr.Slider(0.05, 1.0, value=d.top_p, step=0.05, label="top_p", elem_id="top_p")
            max_new = gr.Slider(1, 1024, value=d.max_new_tokens, step=1, label="Max new tokens", elem_id="max_new")
            seed = gr.Number(value=0, precision=0, label="Seed (-1: random)", elem_id="seed")
        with gr.Row():
            reward = gr.Dropdown(scorer_choices, value=NO_REWARD, label="Reward under each answer", elem_id="reward")
            columns = gr.Textbox(label='Reward columns (JSON, e.g. {"answer": "42"})', elem_id="columns")
    return Settings(system, temperature, top_p, max_new, seed, reward, columns)


def build_layout(
    model_name: str, choices: list[tuple[str, str]], scorer_choices: list[tuple[str, str]], status: str
) -> Widgets:
    """Create the app's components in the current ``gr.Blocks``; return them."""
    gr.Markdown(
        "## lorarl chat — checkpoints side by side\n"
        f"One base (`{model_name}`) loaded once; every pane is the base or a LoRA adapter on it, all answered in one"
        " batch."
    )
    turn = gr.State({})
    with gr.Row():
        n_panes = gr.Radio([2, 3, 4], value=VISIBLE_PANES, label="Panes", scale=1)
        refresh = gr.Button("Refresh list", scale=0, elem_id="refresh")
    panes = _panes(choices, default_picks([c[1] for c in choices]))
    with gr.Row():
        msg = gr.Textbox(placeholder="Ask all panes…", show_label=False, scale=6, elem_id="prompt", lines=1)
        send = gr.Button("Send", variant="primary", scale=1, elem_id="send")
    with gr.Row():
        stop = gr.Button("Stop", elem_id="stop")
        regen = gr.Button("Regenerate", elem_id="regen")
        clear = gr.Button("Clear", elem_id="clear")
        allow_code = gr.Button("Allow run code", elem_id="allow-code")
    votes = _vote_row()
    status_md = gr.Markdown(status, elem_id="status")
    settings = _settings(scorer_choices)
    return Widgets(turn, n_panes, refresh, panes, msg, send, stop, regen, clear, votes, status_md, settings, allow_code)
