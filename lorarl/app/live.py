"""What a run is doing now, for the Watch tab: where the running step stands (``RUN/step.json``,
:mod:`lorarl.stepprogress`), what Stop will do to it, and how a stop ended (the loop's ``stop requested`` line in
``RUN/train.log``, else ``state.json``). Pure functions of the parsed files."""

from __future__ import annotations

import re
import statistics
import time

# the run loop's lines (lorarl.algos.loop.run_steps / abandon_step), as tqdm.write prints them into train.log
ABANDONED = re.compile(r"^step (\d+): stop requested during generation: step abandoned; (.*?); `--resume` continues")
SAVED = re.compile(r"^step (\d+): stop requested: checkpoint saved")
GENERATING = ("generation",)  # the phases during which a stop abandons the step (the decode loops watch the flag)


def _typical(rows: list[dict], phase: str) -> float | None:
    """The median seconds of ``time/<phase>`` over the logged steps (None before any)."""
    times = [r[f"time/{phase}"] for r in rows if isinstance(r.get(f"time/{phase}"), (int, float))]
    return statistics.median(times) if times else None


def inside_step(info: dict | None, rows: list[dict], now: float | None = None) -> str:
    """The running step in a few words from ``RUN/step.json`` (``info``) and the logged rows: its phase, the tokens
    of the decode call running, the seconds in the phase, and what the phase took in the steps so far.

    Example: ``{"step": 3, "phase": "generation", "phase_started": t - 12, "tokens": 57, "max_tokens": 96}`` and
    rows with ``time/generation`` 10, 14, 20 -> ``step 3: generation, 57/96 tokens, 12 s (14 s per step so far)``."""
    if not info or not isinstance(info.get("step"), int):
        return ""
    phase, started = info.get("phase"), info.get("phase_started")
    if not phase:
        return f"step {info['step']}: starting"
    text = f"step {info['step']}: {phase}"
    if isinstance(info.get("tokens"), int) and isinstance(info.get("max_tokens"), int):
        text += f", {info['tokens']}/{info['max_tokens']} tokens"
    if isinstance(info.get("micro_batch"), int) and isinstance(info.get("micro_batches"), int):
        text += f", micro-batch {info['micro_batch']}/{info['micro_batches']}"
    if isinstance(started, (int, float)):
        text += f", {max(0.0, (now if now is not None else time.time()) - started):.0f} s"
    typical = _typical(rows, phase)
    if typical is not None:
        text += f" ({typical:.0f} s per step so far)"
    return text


def stop_forecast(info: dict | None, done: int) -> str:
    """What a stop asked now will do, from the running step's phase (``RUN/step.json``) and the last step done:
    during generation the step is abandoned (the run keeps step ``done``); after it the step finishes and is saved.
    Without the file (a run from before it, or still loading) both cases are said."""
    step = info.get("step") if info and isinstance(info.get("step"), int) else done + 1
    phase = info.get("phase") if info else None
    keep = f"a checkpoint of step {done}" if done else "nothing saved (no step done)"
    abandon = f"step {step} is abandoned; the run stops with {keep}; Resume runs step {step} again"
    finish = (
        f"step {step} finishes, a checkpoint of it is saved, and the run stops; Resume continues at step {step + 1}"
    )
    if phase in GENERATING:
        return f"it was generating step {step}: {abandon}"
    if phase:
        return f"it was past generation in step {step} ({phase}): {finish}"
    return f"if step {step} is still generating, {abandon}; if it is past generation, {finish}"


def stop_outcome(log_lines: list[str], step: int) -> str:
    """How the run's last stop ended, from the loop's line in ``train.log`` (the last one), else from
    ``state.json``'s ``step``."""
    for line in reversed(log_lines):
        m = ABANDONED.match(line)
        if m:
            n = int(m.group(1))
            return (
                f"Stop came while step {n} generated: the step was abandoned ({m.group(2)}); Resume runs step {n} again"
            )
        m = SAVED.match(line)
        if m:
            n = int(m.group(1))
            return f"Stop came during step {n}: it finished and a checkpoint of step {n} was saved; Resume continues"
    return f"stopped after step {step}" if step else "stopped before its first step"
