"""The Watch tab's view of a :class:`lorarl.app.watch.WatchView`: the outputs of one poll (:func:`view_outputs`,
in the order of :data:`POLL_OUTPUTS`), the completions table (:func:`completion_rows`: the user's turn out of the
chat template, identical rows of a step folded with their count), and when the curves changed
(:func:`view_stamp`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gradio as gr

from lorarl.app import watch
from lorarl.app.layout import LOG_LABEL, PLOTS

# state, progress, result, the curves, the notes under them, warnings, the log, completions, Stop, Resume
POLL_OUTPUTS = 8 + 2 * len(PLOTS)

# (where the user's turn starts, where it ends) in common chat templates, for the completions table
USER_TURNS = (
    ("<|im_start|>user\n", "<|im_end|>"),  # ChatML: SmolLM2, Qwen2.5, ...
    ("<|start_header_id|>user<|end_header_id|>\n\n", "<|eot_id|>"),  # Llama 3
    ("<start_of_turn>user\n", "<end_of_turn>"),  # Gemma
    ("<|user|>\n", "<|end|>"),  # Phi-3
    ("[INST]", "[/INST]"),  # Mistral, Llama 2
)


def view_stamp(view: watch.WatchView) -> tuple:
    """What the curves and completions table show: changes when a row or a completion was added or replaced."""
    last = {k: v[-1] if v else None for k, v in view.series.items()}
    comp = view.completions[-1] if view.completions else None
    return (
        view.run,
        tuple(sorted((k, len(v)) for k, v in view.series.items())),
        str(last),
        len(view.completions),
        str(comp),
        tuple(sorted(view.empty.items())),
    )


def _frame(points: list[tuple[int, float]]):
    """A curve's points as the line plot's frame; typed even when empty (an untyped empty frame would make the plot's
    axes nominal for good)."""
    import pandas as pd

    steps = pd.Series([p[0] for p in points], dtype="int64")
    return pd.DataFrame({"step": steps, "value": pd.Series([p[1] for p in points], dtype="float64")})


def _plot(points: list[tuple[int, float]], last_step: int):
    """One curve's update: its points on a step axis from 0 to the run's last step (at least 10, so a short run's
    ticks are whole steps, not 1.2, 1.4, ...)."""
    return gr.LinePlot(value=_frame(points), x_lim=[0, max(10, last_step)])


def _clip(text: Any, n: int = 300, end: bool = False) -> str:
    """``text`` cut to ``n`` characters: its beginning, or with ``end`` its end."""
    text = "" if text is None else str(text)
    if len(text) <= n:
        return text
    return "…" + text[-(n - 1) :] if end else text[: n - 1] + "…"


def _round(v: Any) -> Any:
    """A reward or advantage as the table shows it: 3 decimals; missing (a failed reward): empty."""
    return "" if v is None else round(float(v), 3) if isinstance(v, (int, float)) else v


def user_turn(prompt: Any) -> str:
    """The last user turn of a prompt as the model saw it (its chat template rendered, :data:`USER_TURNS`); a prompt
    in no template known here is returned whole. Example: ``"<|im_start|>system\\nBe brief<|im_end|>\\n
    <|im_start|>user\\nWhat is 2 + 2?<|im_end|>\\n<|im_start|>assistant\\n"`` -> ``"What is 2 + 2?"``."""
    text = "" if prompt is None else str(prompt)
    for begin, end in USER_TURNS:
        at = text.rfind(begin)
        if at >= 0:
            body = text[at + len(begin) :]
            stop = body.find(end)
            return (body[:stop] if stop >= 0 else body).strip()
    return text.strip()


def completion_rows(completions: list[dict]) -> list[list]:
    """The completions table, newest first: step, reward, advantage, count, the user's turn, completion (texts
    clipped). Rows of one step with the same prompt, completion and reward are folded into one, with their count
    (a group's completions are often identical)."""
    rows: dict[tuple, list] = {}
    for c in reversed(completions):
        key = (c.get("step"), c.get("prompt"), c.get("completion"), c.get("reward"))
        if key in rows:
            rows[key][3] += 1
            continue
        prompt = _clip(user_turn(c.get("prompt")), 160, end=True)
        reward, adv = (_round(c.get(k)) for k in ("reward", "advantage"))
        rows[key] = [c.get("step"), reward, adv, 1, prompt, _clip(c.get("completion"))]
    return list(rows.values())


def state_markdown(view: watch.WatchView) -> str:
    """The run's state in one line (with its error line when it crashed or failed, how a stop ended)."""
    text = f"**{view.run}**: {view.state}"
    if view.error:
        text += f" — {view.error}"
    if view.note:
        text += f" — {view.note}"
    return text


def view_outputs(
    view: watch.WatchView, fresh: bool = True, live_run: Path | None = None, live_label: str | None = None
) -> list:
    """A :class:`~lorarl.app.watch.WatchView` as the Watch tab's outputs (the order of :data:`POLL_OUTPUTS`);
    ``fresh`` False: the curves and the table are left as the browser has them. ``live_run``: the run a process is
    training now (any run: Resume waits until no process is left, as the one-job rule does), ``live_label`` how the
    page names it (``NAME`` or ``PIPELINE/STAGE``; default the folder's name). Resume is enabled when
    ``view.resumable`` and no process trains."""
    last = max([view.progress.last_step or 0, *(s for pts in view.series.values() for s, _ in pts[-1:])])
    plots = [_plot(view.series.get(label, []), last) if fresh else gr.skip() for label in PLOTS]
    notes = [f"empty: {view.empty[label]}" if label in view.empty else "" for label in PLOTS]
    warnings = "\n".join(f"- ⚠ {_clip(w, 400)}" for w in view.warnings[-10:]) if view.warnings else ""
    failed = view.state in ("crashed", "failed")
    log = gr.Textbox(
        value="\n".join(view.crash_lines if failed else view.log_tail),
        visible=bool(view.log_tail or view.crash_lines),
        label=f"{LOG_LABEL}: the run {view.state}" if failed else LOG_LABEL,
    )
    table = completion_rows(view.completions) if fresh else gr.skip()
    mine = live_run is not None and (live_label or Path(live_run).name) == view.run
    state = state_markdown(view)
    if mine and view.state == "new":
        state += " (its process is starting)"
    elif mine and view.state not in ("running", "starting"):
        state += " (its process is still exiting)"
    return [
        state,
        view.progress.text,
        view.result,
        *plots,
        *notes,
        warnings,
        log,
        table,
        gr.Button(interactive=view.state in ("running", "starting") or (mine and view.state == "new")),
        gr.Button(interactive=live_run is None and view.resumable),
    ]
