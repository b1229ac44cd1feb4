"""Chat with checkpoints side by side: the base model, every run's adapters and merged exports, in 2 to 4 panes.

``lorarl chat --runs runs`` (or ``python apps/chat.py``) opens a Gradio app on 127.0.0.1:7860 (no authentication,
so it binds this machine only unless told otherwise). Each pane picks one checkpoint; one prompt goes to all panes
and the answers stream in side by side. The pieces:

- :mod:`~lorarl.chat.catalog`: :class:`Catalog` scans the runs directory for what can be chosen (``base``,
  ``RUN/policy``, ``RUN/step-000010``, ``export:NAME``) and for reward scorers. The browser only ever sends ids; an
  id resolves to a folder found by the scan, re-checked to lie inside the runs directory after ``resolve()``.
- :mod:`~lorarl.chat.engine`: :class:`ChatEngine` answers every pane on the ONE shared base in one batched
  ``generate`` call (per-row adapters), merged exports in their own batches, streaming, with Stop
  (:mod:`~lorarl.chat.streaming` holds the streamer and the stop criterion).
- :mod:`~lorarl.chat.tools`: panes of runs trained with tools (an ``agent:`` section) answer through the tool loop
  with the run's tools only, their calls and results folded above the answer.
- :mod:`~lorarl.chat.scoring`: the reward shown under each answer (a run's rule rewards or its reward model).
- :mod:`~lorarl.chat.votes`: votes appended as TRL ``chosen`` / ``rejected`` pairs to ``RUNS/preferences.jsonl``
  (ties to ``RUNS/preferences_ties.jsonl``).
- :mod:`~lorarl.chat.inputs`: user-entered values checked (sampling settings as one
  :class:`~lorarl.config.GenerationConfig`, reward columns, histories).
- :mod:`~lorarl.chat.session`: :class:`ChatSession`, the app's logic without Gradio (stop events, ``/respond``,
  votes); :mod:`~lorarl.chat.layout`, :mod:`~lorarl.chat.handlers` and :mod:`~lorarl.chat.api`: the Gradio
  components, their callbacks, and the client API; :mod:`~lorarl.chat.app`: :func:`build_app` and :func:`launch`.

API (``gradio_client``): ``/respond`` (prompt, panes, system, temperature, top_p, max_new_tokens, seed, reward,
columns -> {"panes", "answers", "finished", "rewards", "tool_calls"}), ``/checkpoints`` and ``/rewards`` (what can
be chosen).
The UI's own events are private (not callable from clients). Gradio is imported only when the app is built.
"""

from lorarl.chat.app import build_app, launch
from lorarl.chat.catalog import BASE_ID, NO_REWARD, Catalog, Entry, ScorerEntry, default_base_model
from lorarl.chat.engine import Answer, ChatEngine
from lorarl.chat.inputs import CHAT_DEFAULTS, check_generation, parse_columns, plain_history
from lorarl.chat.scoring import RewardResult
from lorarl.chat.session import MAX_PANES, ChatSession
from lorarl.chat.streaming import render_prompt
from lorarl.chat.votes import append_jsonl, preference_record

__all__ = [
    "BASE_ID",
    "CHAT_DEFAULTS",
    "MAX_PANES",
    "NO_REWARD",
    "Answer",
    "Catalog",
    "ChatEngine",
    "ChatSession",
    "Entry",
    "RewardResult",
    "ScorerEntry",
    "append_jsonl",
    "build_app",
    "check_generation",
    "default_base_model",
    "launch",
    "parse_columns",
    "plain_history",
    "preference_record",
    "render_prompt",
]
