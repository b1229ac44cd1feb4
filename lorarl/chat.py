"""Chat with checkpoints side by side: the base model, every run's adapters and merged exports, in 2 to 4 panes.

``lorarl chat --runs runs`` (or ``python apps/chat.py``) opens a Gradio app on 127.0.0.1:7860. Each pane picks one
checkpoint; one prompt goes to all panes and the answers stream in side by side. Pieces, top to bottom:

- :class:`Catalog` scans the runs directory. Ids are ``base``, ``RUN/policy`` (a run's final adapter),
  ``RUN/step-000010`` (a complete step checkpoint) and ``export:NAME`` (a merged export: a plain transformers folder
  with ``config.json``). The browser only ever sends ids; an id resolves to a folder found by the scan, and the folder
  must lie inside the runs directory after ``resolve()`` (symlinks pointing out are refused). Runs trained on
  another base model are left out (listed in the status line).
- :class:`ChatEngine` holds ONE :class:`~lorarl.model.SharedBase`. Adapters are loaded onto it lazily, once, under
  sanitized names, and every pane that runs on it is answered by ONE batched ``generate`` call with PEFT's per-row
  ``adapter_names`` (``"__base__"`` for the base), so memory stays close to one model and the base and tuned answers
  come from the same batch. A :class:`PaneStreamer` receives the ``[B]`` new tokens of each step and decodes every row
  incrementally, so all panes stream at once; a row stops at its EOS. Merged exports are separate full models: each
  is loaded once, when first chosen, and answers its panes in its own batch after the shared-base batch.
- Rewards (optional): a run's rule rewards (its recipe's ``rewards``, via :class:`lorarl.rewards.RewardScorer`; extra
  columns such as ``answer`` come from the "reward columns" JSON box) or a reward-model run's adapter + score head
  (``runs/NAME/reward``) score every pane's answer, shown under the pane.
- Votes: "left better" / "right better" append ``{"prompt": [...], "chosen": [{"role": "assistant", ...}],
  "rejected": [...]}`` (TRL's conversational preference format, ready for ``recipes/reward_model.yaml``) plus
  ``chosen_model`` / ``rejected_model`` / ``created`` to ``RUNS/preferences.jsonl``. Ties go to a separate file,
  ``RUNS/preferences_ties.jsonl`` (same fields, left pane as "chosen", ``"tie": true``), so the preference file stays
  directly trainable. Each line is appended, flushed and fsynced. A pair needs one shared prompt: when the two panes'
  earlier turns differ, the vote is refused (single-turn votes always work); one vote per answer.

API (``gradio_client``): ``/respond`` (prompt, panes, system, temperature, top_p, max_new_tokens, seed, reward,
columns -> {"panes", "answers", "finished", "rewards"}), ``/checkpoints`` and ``/rewards`` (what can be chosen).
The UI's own events are private (not callable from clients).
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import re
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from lorarl.errors import LorarlError

BASE_ID = "base"
PEFT_BASE = "__base__"  # PEFT's name for "no adapter" in a mixed adapter batch
EXPORT_PREFIX = "export:"
RULES_PREFIX = "rules:"
REWARD_MODEL_PREFIX = "rm:"
NO_REWARD = "none"
MAX_PANES = 4
PREFERENCES_FILE = "preferences.jsonl"
TIES_FILE = "preferences_ties.jsonl"
SKIP_DIRS = {"policy", "checkpoints", "reward", "critic", "reference", "logs", "tensorboard"}


# ---------------------------------------------------------------------------------------------------------------
# Catalog: what can be chatted with
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Entry:
    """One choosable checkpoint. ``kind``: ``base`` | ``adapter`` | ``export``; ``folder`` is None for the base."""

    id: str
    kind: str
    label: str
    folder: Path | None = None
    run: str | None = None


@dataclass(frozen=True)
class ScorerEntry:
    """A way to score answers: a run's rule rewards (``rules:RUN``) or its reward adapter (``rm:RUN``)."""

    id: str
    kind: str  # "rules" | "reward_model"
    label: str
    run: str
    specs: tuple = ()  # RewardSpec list for rules
    folder: Path | None = None  # reward adapter folder for reward_model
    system_prompt: str | None = None  # the reward run's data.system_prompt (used when the chat has none)


def _normalize_model_name(name: str) -> str:
    """Compare model names across recipes: embedded names -> their converted folder, paths -> resolved paths."""
    from lorarl.model.registry import EMBEDDED, converted_path

    if name in EMBEDDED:
        return str(converted_path(name).resolve())
    p = Path(name).expanduser()
    if p.exists():
        return str(p.resolve())
    return name


def _read_recipe(run: Path) -> dict | None:
    import yaml

    f = run / "recipe.yaml"
    if not f.is_file():
        return None
    try:
        data = yaml.safe_load(f.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return None
    return data if isinstance(data, dict) else None


def _recipe_model(recipe: dict | None) -> str | None:
    model = (recipe or {}).get("model") or {}
    name = model.get("name") if isinstance(model, dict) else None
    return str(name) if name else None


def _is_adapter(folder: Path) -> bool:
    return (folder / "adapter_config.json").is_file()


def _is_export(folder: Path) -> bool:
    return (folder / "config.json").is_file() and not _is_adapter(folder)


def default_base_model(runs_dir: str | os.PathLike) -> str:
    """The base to load when none is given: the embedded default, unless no run under ``runs_dir`` uses it and
    the runs were trained on another model that is available here (the most common such one)."""
    from lorarl.model.registry import DEFAULT_MODEL, EMBEDDED

    root = Path(runs_dir)
    names = [_recipe_model(_read_recipe(p)) for p in sorted(root.iterdir()) if p.is_dir()] if root.is_dir() else []
    usable = collections.Counter(n for n in names if n and (n in EMBEDDED or Path(n).expanduser().is_dir()))
    by_norm = {_normalize_model_name(n) for n in usable}
    if not usable or _normalize_model_name(DEFAULT_MODEL) in by_norm:
        return DEFAULT_MODEL
    return usable.most_common(1)[0][0]


class Catalog:
    """Scans ``runs_dir`` for the base, run adapters (final + steps), merged exports and reward scorers.

    Only folders found by the scan can be loaded, and only when they resolve to a path inside ``runs_dir``.
    """

    def __init__(self, runs_dir: str | os.PathLike, base_model: str, base_label: str | None = None):
        self.root = Path(runs_dir).expanduser().resolve()
        self.base_model = base_model
        self.base_label = base_label or f"base · {Path(base_model).name if os.sep in base_model else base_model}"
        self.entries: dict[str, Entry] = {}
        self.scorers: dict[str, ScorerEntry] = {}
        self.skipped: list[str] = []
        self._lock = threading.Lock()
        self.scan()

    # ---- scanning ---------------------------------------------------------------------------------------------
    def inside(self, path: Path) -> bool:
        try:
            return path.resolve().is_relative_to(self.root)
        except (OSError, RuntimeError):
            return False

    def scan(self) -> Catalog:
        from lorarl.checkpoint import list_checkpoints

        entries = {BASE_ID: Entry(BASE_ID, "base", self.base_label)}
        scorers: dict[str, ScorerEntry] = {}
        skipped: list[str] = []
        base_norm = _normalize_model_name(self.base_model)
        runs = (
            sorted(p for p in self.root.iterdir() if p.is_dir() and not p.name.startswith("."))
            if self.root.is_dir()
            else []
        )
        for run in runs:
            name = run.name
            if not self.inside(run):
                skipped.append(f"{name} (outside the runs directory)")
                continue
            if _is_export(run):
                self._add_export(entries, name, run)
                continue
            recipe = _read_recipe(run)
            model = _recipe_model(recipe)
            compatible = model is None or _normalize_model_name(model) == base_norm
            if not compatible:
                skipped.append(f"{name} (trained on {model})")
            else:
                if _is_adapter(run / "policy") and self.inside(run / "policy"):
                    entries[f"{name}/policy"] = Entry(
                        f"{name}/policy", "adapter", f"{name} · final", run / "policy", name
                    )
                for cp in list_checkpoints(run):
                    folder = cp / "policy"
                    if _is_adapter(folder) and self.inside(folder):
                        step = int(cp.name.split("-")[1])
                        eid = f"{name}/{cp.name}"
                        entries[eid] = Entry(eid, "adapter", f"{name} · step {step}", folder, name)
                self._add_scorers(scorers, name, run, recipe)
            for sub in sorted(
                p for p in run.iterdir() if p.is_dir() and p.name not in SKIP_DIRS and not p.name.startswith(".")
            ):
                if _is_export(sub):
                    self._add_export(entries, f"{name}/{sub.name}", sub)
        with self._lock:
            self.entries, self.scorers, self.skipped = entries, scorers, skipped
        return self

    def _add_export(self, entries: dict, rel: str, folder: Path) -> None:
        if self.inside(folder):
            eid = EXPORT_PREFIX + rel
            entries[eid] = Entry(eid, "export", f"{rel} · merged export", folder, rel.split("/")[0])

    def _add_scorers(self, scorers: dict, name: str, run: Path, recipe: dict | None) -> None:
        from lorarl.config import RewardSpec

        reward = run / "reward"
        if _is_adapter(reward) and (reward / "head.safetensors").is_file() and self.inside(reward):
            sid = REWARD_MODEL_PREFIX + name
            data = (recipe or {}).get("data") or {}
            system_prompt = data.get("system_prompt") if isinstance(data, dict) else None
            scorers[sid] = ScorerEntry(
                sid, "reward_model", f"{name} · reward model", name, folder=reward, system_prompt=system_prompt
            )
        if not recipe or recipe.get("algo", "grpo") == "reward_model":
            return
        ppo = recipe.get("ppo") or {}
        if recipe.get("algo") == "ppo" and ppo.get("reward_source", "reward_model") == "reward_model":
            return
        specs = []
        for spec in recipe.get("rewards") or []:
            if isinstance(spec, dict) and spec.get("name"):
                specs.append(
                    RewardSpec(
                        name=str(spec["name"]),
                        weight=float(spec.get("weight", 1.0)),
                        kwargs=dict(spec.get("kwargs") or {}),
                    )
                )
        if specs:
            sid = RULES_PREFIX + name
            label = " + ".join(f"{s.weight:g}×{s.name}" for s in specs)
            scorers[sid] = ScorerEntry(sid, "rules", f"{name} · rules ({label})", name, specs=tuple(specs))

    # ---- lookups ----------------------------------------------------------------------------------------------
    def choices(self) -> list[tuple[str, str]]:
        """(label, id) pairs for a dropdown: base first, then runs (final, then steps, newest first), then exports."""
        order = {"base": 0, "adapter": 1, "export": 2}

        def key(e: Entry):
            step = -int(e.id.rsplit("-", 1)[1]) if "/step-" in e.id else 0
            final = 0 if e.id.endswith("/policy") else 1
            return (order[e.kind], e.run or "", final, step)

        return [(e.label, e.id) for e in sorted(self.entries.values(), key=key)]

    def scorer_choices(self) -> list[tuple[str, str]]:
        return [("off", NO_REWARD)] + [(s.label, s.id) for s in sorted(self.scorers.values(), key=lambda s: s.id)]

    def get(self, entry_id: str) -> Entry:
        """The entry for ``entry_id`` (rescanning once if unknown); LorarlError for anything else."""
        if not isinstance(entry_id, str) or not entry_id:
            raise LorarlError(f"unknown checkpoint {entry_id!r}")
        entry = self.entries.get(entry_id)
        if entry is None:
            entry = self.scan().entries.get(entry_id)
        if entry is None:
            raise LorarlError(f"unknown checkpoint {entry_id!r} (not found under {self.root}; press Refresh)")
        if entry.folder is not None:
            self.folder(entry)
        return entry

    def folder(self, entry: Entry) -> Path:
        """The entry's folder, resolved, checked again to be inside the runs directory and to still exist."""
        resolved = Path(entry.folder).resolve()
        if not resolved.is_relative_to(self.root):
            raise LorarlError(f"{entry.id}: resolves outside the runs directory {self.root}; refused")
        marker = "config.json" if entry.kind == "export" else "adapter_config.json"
        if not (resolved / marker).is_file():
            raise LorarlError(f"{entry.id}: {resolved} no longer exists (pruned checkpoint?); press Refresh")
        return resolved

    def get_scorer(self, scorer_id: str) -> ScorerEntry | None:
        if not scorer_id or scorer_id == NO_REWARD:
            return None
        s = self.scorers.get(scorer_id) or self.scan().scorers.get(scorer_id)
        if s is None:
            raise LorarlError(f"unknown reward {scorer_id!r} (press Refresh)")
        if s.folder is not None and not Path(s.folder).resolve().is_relative_to(self.root):
            raise LorarlError(f"{scorer_id}: resolves outside the runs directory; refused")
        return s


# ---------------------------------------------------------------------------------------------------------------
# Generation
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class Sampling:
    """Sampling settings shared by all panes. ``temperature == 0`` is greedy; ``seed < 0`` leaves the RNG as it is."""

    temperature: float = 0.7
    top_p: float = 0.9
    max_new_tokens: int = 128
    seed: int = 0

    def validate(self) -> Sampling:
        if not 0.0 <= float(self.temperature) <= 5.0:
            raise LorarlError(f"temperature must be in [0, 5], got {self.temperature}")
        if not 0.0 < float(self.top_p) <= 1.0:
            raise LorarlError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 1 <= int(self.max_new_tokens) <= 4096:
            raise LorarlError(f"max_new_tokens must be in 1..4096, got {self.max_new_tokens}")
        return Sampling(float(self.temperature), float(self.top_p), int(self.max_new_tokens), int(self.seed))


@dataclass
class Answer:
    pane: int
    checkpoint: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finished: bool = False  # ended with EOS (not cut by max_new_tokens or stop)


@dataclass
class RewardResult:
    total: float | None = None
    parts: dict[str, float | None] = field(default_factory=dict)
    error: str | None = None

    def markdown(self) -> str:
        if self.error:
            return f"reward: n/a ({self.error})"
        if self.total is None:
            return "reward: n/a"
        parts = ", ".join(f"{k} {_fmt(v)}" for k, v in self.parts.items())
        return f"**reward {self.total:.3f}**" + (f" ({parts})" if parts and len(self.parts) > 1 else "")


def _fmt(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.3f}"


class StopFlag:
    """A StoppingCriteria that ends every row once ``event`` is set (the Stop button)."""

    def __init__(self, event: threading.Event):
        self.event = event

    def __call__(self, input_ids: torch.Tensor, scores: Any = None, **kwargs) -> torch.Tensor:
        return torch.full((input_ids.shape[0],), self.event.is_set(), dtype=torch.bool, device=input_ids.device)


def _stopping(event: threading.Event):
    from transformers import StoppingCriteria, StoppingCriteriaList

    class _Stop(StopFlag, StoppingCriteria):
        pass

    return StoppingCriteriaList([_Stop(event)])


def _streamer_class():
    from transformers.generation.streamers import BaseStreamer

    class PaneStreamer(BaseStreamer):
        """Receives the ``[B]`` new tokens of each decoding step; decodes every row incrementally.

        The first ``put`` is the prompt (skipped). A row's text stops growing at its first EOS. ``on_text(row, text)``
        is called for rows whose visible text changed (an unfinished multi-byte character is held back).
        """

        def __init__(self, tokenizer, eos_ids: set[int], n_rows: int, on_text: Callable[[int, str], None]):
            self.tok = tokenizer
            self.eos = eos_ids
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

    return PaneStreamer


def render_prompt(tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> str:
    """The chat template applied to ``messages`` (a plain ``role: content`` fallback for tokenizers without one)."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
    return text + ("assistant:" if add_generation_prompt else "")


def _eos_ids(model, tokenizer) -> set[int]:
    ids: set[int] = set()
    gen = getattr(model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None) if gen is not None else None
    for e in eos if isinstance(eos, (list, tuple)) else [eos]:
        if e is not None:
            ids.add(int(e))
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids


def _left_pad(rows: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`lorarl.rollout.pad_left` with a long mask, on ``device``."""
    from lorarl.model.tokens import pad_left

    ids, mask = pad_left(rows, pad_id)
    return ids.to(device), mask.long().to(device)


def _adapter_name(prefix: str, key: str) -> str:
    """A PEFT-safe adapter name for ``key`` (letters, digits, underscores) that stays unique."""
    digest = hashlib.sha1(key.encode()).hexdigest()[:10]
    return f"{prefix}_{re.sub(r'[^0-9A-Za-z_]', '_', key)[:40]}_{digest}"


def _stamp(folder: Path) -> str:
    files = sorted(folder.glob("adapter_model.*")) + sorted(folder.glob("*.safetensors"))
    return ";".join(f"{f.name}:{f.stat().st_mtime_ns}:{f.stat().st_size}" for f in files)


class ChatEngine:
    """One shared base, adapters loaded lazily onto it, merged exports loaded once each; all under one lock."""

    def __init__(self, shared, catalog: Catalog):
        self.shared = shared
        self.catalog = catalog
        self.lock = threading.RLock()
        self._adapters: dict[str, tuple[str, str]] = {}  # entry id -> (peft adapter name, files stamp)
        self._exports: dict[str, tuple[Any, Any]] = {}  # entry id -> (model, tokenizer)
        self._scorers: dict[str, Any] = {}

    # ---- loading ----------------------------------------------------------------------------------------------
    def loaded(self) -> dict[str, list[str]]:
        return {"adapters": sorted(self._adapters), "exports": sorted(self._exports)}

    def prepare(self, entry_id: str) -> Entry:
        """Load what ``entry_id`` needs (once); return its entry."""
        entry = self.catalog.get(entry_id)
        with self.lock:
            if entry.kind == "adapter":
                self._adapter(entry)
            elif entry.kind == "export":
                self._export(entry)
        return entry

    def _adapter(self, entry: Entry) -> str:
        folder = self.catalog.folder(entry)
        stamp = _stamp(folder)
        have = self._adapters.get(entry.id)
        if have is not None and have[1] == stamp:
            return have[0]
        name = _adapter_name("ck", f"{entry.id}@{stamp}")
        if not self.shared.has_adapter(name):
            self.shared.add_adapter(name, init_from=folder, trainable=False, head=False)
        if have is not None:  # the run saved a newer adapter in place: drop the old copy
            self._delete_adapter(have[0])
        self._adapters[entry.id] = (name, stamp)
        return name

    def _delete_adapter(self, name: str) -> None:
        peft = self.shared.peft
        if peft is None or name not in peft.peft_config:
            return
        try:
            if peft.active_adapter == name:
                others = [a for a in peft.peft_config if a != name]
                if others:
                    peft.set_adapter(others[0])
            peft.delete_adapter(name)
        except Exception:  # keeping an old copy in memory is harmless
            pass

    def _export(self, entry: Entry):
        if entry.id not in self._exports:
            from lorarl.config import ModelConfig
            from lorarl.model import load_base

            cfg = self.shared.cfg
            mcfg = ModelConfig(
                name=str(self.catalog.folder(entry)),
                quantization=cfg.quantization,
                dtype=cfg.dtype,
                gradient_checkpointing=False,
                trust_remote_code=False,
            )
            model, tok, _ = load_base(mcfg, self.shared.device)
            model.eval()
            self._exports[entry.id] = (model, tok)
        return self._exports[entry.id]

    # ---- generation -------------------------------------------------------------------------------------------
    def generate(
        self,
        panes: Sequence[str],
        conversations: Sequence[list[dict]],
        sampling: Sampling | None = None,
        *,
        stop: threading.Event | None = None,
        on_update: Callable[[int, str], None] | None = None,
    ) -> list[Answer]:
        """Answer ``conversations[i]`` (chat messages ending with the user's turn) with checkpoint ``panes[i]``.

        All panes on the shared base are answered by ONE batched ``generate`` call (per-row ``adapter_names``);
        each merged export answers its panes in its own batch afterwards. ``on_update(pane, text)`` streams text.
        """
        if len(panes) != len(conversations) or not panes:
            raise LorarlError("need one conversation per pane, and at least one pane")
        sampling = (sampling or Sampling()).validate()
        stop = stop or threading.Event()
        entries = [self.catalog.get(p) for p in panes]
        answers = [Answer(i, e.id) for i, e in enumerate(entries)]
        groups: dict[str, list[int]] = {}
        for i, e in enumerate(entries):
            groups.setdefault(e.id if e.kind == "export" else "", []).append(i)
        with self.lock, torch.no_grad():
            for key, rows in groups.items():
                if stop.is_set():
                    break
                if key:
                    model, tok = self._export(entries[rows[0]])
                    names = None
                else:
                    names = [PEFT_BASE if entries[i].kind == "base" else self._adapter(entries[i]) for i in rows]
                    model, tok = self.shared.module, self.shared.tokenizer  # after loading: the PeftModel now
                    if self.shared.peft is None:
                        names = None
                    else:
                        self.shared.peft.eval()
                self._generate_group(model, tok, names, rows, conversations, sampling, stop, on_update, answers)
        return answers

    def _generate_group(
        self, model, tok, adapter_names, rows, conversations, sampling, stop, on_update, answers
    ) -> None:
        prompts = [tok(render_prompt(tok, conversations[i]), add_special_tokens=False)["input_ids"] for i in rows]
        max_pos = getattr(getattr(model, "config", None), "max_position_embeddings", None)
        if isinstance(max_pos, int) and max_pos > 0:
            keep = max(1, max_pos - sampling.max_new_tokens)
            prompts = [p[-keep:] for p in prompts]
        pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        device = next(model.parameters()).device
        input_ids, attention_mask = _left_pad(prompts, pad_id, device)
        eos = _eos_ids(model, tok)

        def on_text(r: int, text: str) -> None:
            answers[rows[r]].text = text
            if on_update is not None:
                on_update(rows[r], text)

        kwargs: dict[str, Any] = {
            "max_new_tokens": sampling.max_new_tokens,
            "pad_token_id": pad_id,
            "eos_token_id": sorted(eos),
            "use_cache": True,
            "streamer": _streamer_class()(tok, eos, len(rows), on_text),
            "stopping_criteria": _stopping(stop),
        }
        if sampling.temperature > 0:
            kwargs.update(do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p, top_k=0)
        else:
            kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        if adapter_names is not None:
            kwargs["adapter_names"] = adapter_names
        if sampling.seed >= 0:
            torch.manual_seed(sampling.seed)
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        completions = out[:, input_ids.shape[1] :].tolist()
        for r, ids in enumerate(completions):
            cut = next((k for k, t in enumerate(ids) if t in eos), None)
            a = answers[rows[r]]
            a.finished = cut is not None
            a.token_ids = ids if cut is None else ids[:cut]
            a.text = tok.decode(a.token_ids, skip_special_tokens=True)
            if on_update is not None:
                on_update(rows[r], a.text)

    # ---- rewards ----------------------------------------------------------------------------------------------
    def score(
        self,
        scorer_id: str,
        conversations: Sequence[list[dict]],
        answers: Sequence[Answer],
        columns: dict[str, Any] | None = None,
    ) -> list[RewardResult] | None:
        """Score each answer with a run's rule rewards or reward adapter (None when ``scorer_id`` is ``none``)."""
        scorer = self.catalog.get_scorer(scorer_id)
        if scorer is None:
            return None
        if scorer.kind == "rules":
            return self._score_rules(scorer, conversations, answers, columns or {})
        return self._score_reward_model(scorer, conversations, answers)

    def _score_rules(self, scorer: ScorerEntry, conversations, answers, columns) -> list[RewardResult]:
        from lorarl.rewards import RewardScorer

        fn = self._scorers.get(scorer.id)
        if fn is None:
            fn = self._scorers[scorer.id] = RewardScorer(list(scorer.specs), timeout_s=10.0)
        n = len(answers)
        prompts = [list(c) for c in conversations]
        completions = [[{"role": "assistant", "content": a.text}] for a in answers]
        cols = {str(k): [v] * n for k, v in columns.items()}
        res = fn(prompts, completions, cols, completion_ids=[a.token_ids for a in answers])
        out = []
        for i in range(n):
            parts = {
                name: (None if torch.isnan(res.per_function[i, k]) else float(res.per_function[i, k]))
                for k, name in enumerate(res.names)
            }
            total = None if torch.isnan(res.total[i]) else float(res.total[i])
            err = "; ".join(f"{k}: {v}" for k, v in res.failures.items()) if total is None and res.failures else None
            out.append(RewardResult(total, parts, err))
        return out

    def _score_reward_model(self, scorer: ScorerEntry, conversations, answers) -> list[RewardResult]:
        from lorarl.data import encode_prompt, prompt_text
        from lorarl.data.preferences import encode_response

        with self.lock, torch.no_grad():
            folder = Path(scorer.folder).resolve()
            stamp = _stamp(folder)
            name = _adapter_name("rm", f"{scorer.id}@{stamp}")
            if not self.shared.has_adapter(name):
                self.shared.add_adapter(name, init_from=folder, trainable=False, head=True)
            tok = self.shared.tokenizer
            # tokenized exactly as the reward model was trained (lorarl.data.preferences.encode_pair): the prompt as the
            # rollout renders it (the run's system prompt when the chat has none), the answer's tokens, one EOS
            rows = []
            for conv, a in zip(conversations, answers):
                prompt = encode_prompt(prompt_text(list(conv), tok, scorer.system_prompt), tok, templated=True)
                rows.append(prompt + encode_response(a.text, tok))
            ids, mask = _left_pad(rows, tok.pad_token_id, self.shared.device)
            with self.shared.role(name):
                scores = self.shared.scores(ids, mask, head=name).float().cpu().tolist()
        return [RewardResult(float(s), {"reward model": float(s)}) for s in scores]


# ---------------------------------------------------------------------------------------------------------------
# Preferences
# ---------------------------------------------------------------------------------------------------------------

_write_lock = threading.Lock()


def append_jsonl(path: Path, record: dict) -> None:
    """Append one JSON line, flushed and fsynced (a crash never leaves half a line of an earlier vote)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    line = json.dumps(record, ensure_ascii=False) + "\n"
    with _write_lock, open(path, "a", encoding="utf-8") as f:
        f.write(line)
        f.flush()
        os.fsync(f.fileno())


def preference_record(
    system: str,
    left: list[dict],
    right: list[dict],
    left_model: str,
    right_model: str,
    verdict: str,
) -> tuple[dict, bool]:
    """(record, is_tie) from two panes' histories, each ending with the assistant's answer to the same prompt.

    ``verdict``: ``left`` | ``right`` | ``tie``. Raises LorarlError when there is no answer to compare or the two
    panes' earlier turns differ (a preference pair needs one shared prompt).
    """
    if verdict not in ("left", "right", "tie"):
        raise LorarlError(f"vote must be left, right or tie, got {verdict!r}")
    for side, h in (("left", left), ("right", right)):
        if not h or h[-1]["role"] != "assistant" or len(h) < 2 or h[-2]["role"] != "user":
            raise LorarlError(f"the {side} pane has no answer to vote on yet")
    if left[:-1] != right[:-1]:
        raise LorarlError(
            "the two panes' earlier turns differ, so they do not share one prompt; Clear and ask again to vote"
        )
    prompt = ([{"role": "system", "content": system}] if system.strip() else []) + [dict(m) for m in left[:-1]]
    a, b = (left, right) if verdict != "right" else (right, left)
    ma, mb = (left_model, right_model) if verdict != "right" else (right_model, left_model)
    record = {
        "prompt": prompt,
        "chosen": [{"role": "assistant", "content": a[-1]["content"]}],
        "rejected": [{"role": "assistant", "content": b[-1]["content"]}],
        "chosen_model": ma,
        "rejected_model": mb,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    if verdict == "tie":
        record["tie"] = True
    return record, verdict == "tie"


# ---------------------------------------------------------------------------------------------------------------
# The app
# ---------------------------------------------------------------------------------------------------------------


def _content_text(content: Any) -> str:
    """Gradio message content (a string, or a list of ``{"type": "text", "text": ...}`` parts) -> text."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, dict):
        return str(content.get("text", content.get("content", "")) or "")
    if isinstance(content, (list, tuple)):
        return "".join(_content_text(c) for c in content)
    return str(content)


def plain_history(history: Any) -> list[dict]:
    """A Chatbot value -> ``[{"role": "user" | "assistant", "content": str}]``."""
    out = []
    for m in history or []:
        if isinstance(m, dict) and m.get("role") in ("user", "assistant"):
            out.append({"role": m["role"], "content": _content_text(m.get("content"))})
    return out


def parse_columns(text: str) -> dict[str, Any]:
    text = (text or "").strip()
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise LorarlError(f'reward columns must be a JSON object, e.g. {{"answer": "42"}} ({e.msg})') from None
    if not isinstance(value, dict):
        raise LorarlError('reward columns must be a JSON object, e.g. {"answer": "42"}')
    return value


class ChatSession:
    """The app's logic without Gradio: used by the event handlers and by the ``/respond`` API."""

    def __init__(self, engine: ChatEngine, preferences: Path, ties: Path):
        self.engine = engine
        self.catalog = engine.catalog
        self.preferences = preferences
        self.ties = ties
        self._stops: dict[str, threading.Event] = {}

    def stop_event(self, session: str) -> threading.Event:
        ev = threading.Event()
        self._stops[session] = ev
        return ev

    def stop(self, session: str) -> bool:
        ev = self._stops.get(session)
        if ev is None:
            return False
        ev.set()
        return True

    def respond(
        self,
        prompt: str,
        panes: Sequence[str],
        system: str = "",
        sampling: Sampling | None = None,
        reward: str = NO_REWARD,
        columns: dict | None = None,
    ) -> dict:
        if not prompt or not prompt.strip():
            raise LorarlError("empty prompt")
        if not 1 <= len(panes) <= MAX_PANES:
            raise LorarlError(f"choose 1 to {MAX_PANES} panes, got {len(panes)}")
        msgs = ([{"role": "system", "content": system}] if system and system.strip() else []) + [
            {"role": "user", "content": prompt}
        ]
        convs = [list(msgs) for _ in panes]
        answers = self.engine.generate(list(panes), convs, sampling)
        rewards = self.engine.score(reward, convs, answers, columns)
        return {
            "panes": [a.checkpoint for a in answers],
            "answers": [a.text for a in answers],
            "finished": [a.finished for a in answers],
            "rewards": [r.total for r in rewards] if rewards is not None else None,
        }

    def vote(
        self, verdict: str, system: str, left: list[dict], right: list[dict], left_model: str, right_model: str
    ) -> str:
        record, tie = preference_record(system, left, right, left_model, right_model, verdict)
        path = self.ties if tie else self.preferences
        append_jsonl(path, record)
        return str(path)


CSS = """
.pane-reward {min-height: 1.5em; font-size: 0.9em}
#status {min-height: 1.5em}
"""


def build_app(
    runs_dir: str | os.PathLike = "runs",
    model: str | None = None,
    shared=None,
    preferences: str | os.PathLike | None = None,
):
    """The Gradio app (``gr.Blocks``). ``shared``: an already loaded :class:`~lorarl.model.SharedBase` to use;
    else ``model`` (a model name or folder; default: the model the runs were trained on, else the embedded default)
    is loaded once. Votes go to ``preferences`` (default ``RUNS/preferences.jsonl``; ties beside it)."""
    import gradio as gr

    from lorarl.config import ModelConfig
    from lorarl.model import SharedBase

    runs = Path(runs_dir).expanduser()
    if shared is None:
        name = model or default_base_model(runs)
        shared = SharedBase.load(ModelConfig(name=name, gradient_checkpointing=False))
    else:
        name = model or shared.cfg.name
    catalog = Catalog(runs, name)
    engine = ChatEngine(shared, catalog)
    pref_path = Path(preferences) if preferences else catalog.root / PREFERENCES_FILE
    session = ChatSession(engine, pref_path, pref_path.with_name(pref_path.stem + "_ties" + pref_path.suffix))

    choices = catalog.choices()
    ids = [c[1] for c in choices]
    adapters = [i for i in ids if i != BASE_ID]
    defaults = [BASE_ID] + adapters[:1] + adapters[1:3]
    defaults += [BASE_ID] * (MAX_PANES - len(defaults))

    def status_line(extra: str = "") -> str:
        n_ad = sum(1 for e in catalog.entries.values() if e.kind == "adapter")
        n_ex = sum(1 for e in catalog.entries.values() if e.kind == "export")
        text = f"`{catalog.root}`: {n_ad} adapter checkpoint(s), {n_ex} merged export(s), {len(catalog.scorers)} reward(s)."
        if catalog.skipped:
            text += " Skipped: " + "; ".join(catalog.skipped) + "."
        return (extra + " · " if extra else "") + text

    with gr.Blocks(title="lorarl chat", analytics_enabled=False) as demo:
        gr.Markdown(
            "## lorarl chat — checkpoints side by side\n"
            f"One base (`{name}`) loaded once; every pane is the base or a LoRA adapter on it, all answered in one batch."
        )
        turn = gr.State({})  # system prompt and panes of the last request (what a vote records)
        with gr.Row():
            n_panes = gr.Radio([2, 3, 4], value=2, label="Panes", scale=1)
            refresh = gr.Button("Refresh list", scale=0, elem_id="refresh")
        pickers, bots, rewards, cols = [], [], [], []
        with gr.Row(equal_height=False):
            for i in range(MAX_PANES):
                with gr.Column(visible=i < 2, min_width=240) as col:
                    pickers.append(gr.Dropdown(choices, value=defaults[i], label=f"Pane {i + 1}", elem_id=f"pick-{i}"))
                    bots.append(
                        gr.Chatbot(
                            label=f"Pane {i + 1}",
                            height=320,
                            elem_id=f"chat-{i}",
                            feedback_options=None,
                            buttons=["copy"],
                        )
                    )
                    rewards.append(gr.Markdown("", elem_id=f"reward-{i}", elem_classes=["pane-reward"]))
                cols.append(col)
        with gr.Row():
            msg = gr.Textbox(placeholder="Ask all panes…", show_label=False, scale=6, elem_id="prompt", lines=1)
            send = gr.Button("Send", variant="primary", scale=1, elem_id="send")
        with gr.Row():
            stop = gr.Button("Stop", elem_id="stop")
            regen = gr.Button("Regenerate", elem_id="regen")
            clear = gr.Button("Clear", elem_id="clear")
        with gr.Row():
            left_pane = gr.Dropdown([1, 2, 3, 4], value=1, label="Vote: left pane", scale=1)
            right_pane = gr.Dropdown([1, 2, 3, 4], value=2, label="right pane", scale=1)
            vote_left = gr.Button("← Left better", elem_id="vote-left")
            vote_tie = gr.Button("Tie", elem_id="vote-tie")
            vote_right = gr.Button("Right better →", elem_id="vote-right")
        status = gr.Markdown(status_line(), elem_id="status")
        with gr.Accordion("Settings", open=True):
            system = gr.Textbox(
                label="System prompt (shared; empty: the chat template's default)", lines=2, elem_id="system"
            )
            with gr.Row():
                temperature = gr.Slider(
                    0.0, 2.0, value=0.7, step=0.05, label="Temperature (0 = greedy)", elem_id="temperature"
                )
                top_p = gr.Slider(0.05, 1.0, value=0.9, step=0.05, label="top_p", elem_id="top_p")
                max_new = gr.Slider(1, 1024, value=128, step=1, label="Max new tokens", elem_id="max_new")
                seed = gr.Number(value=0, precision=0, label="Seed (-1: random)", elem_id="seed")
            with gr.Row():
                reward = gr.Dropdown(
                    catalog.scorer_choices(), value=NO_REWARD, label="Reward under each answer", elem_id="reward"
                )
                columns = gr.Textbox(label='Reward columns (JSON, e.g. {"answer": "42"})', elem_id="columns")

        # ---- handlers --------------------------------------------------------------------------------------
        def _stream(message, n, pick, hist, sys_p, temp, tp, mx, sd, rw, colj, request: gr.Request):
            n = int(n)
            samp = Sampling(temp, tp, int(mx), int(sd if sd is not None else 0))
            try:
                samp = samp.validate()
                col_values = parse_columns(colj)
                for p in pick[:n]:
                    catalog.get(p)
            except LorarlError as e:
                raise gr.Error(str(e)) from None
            hist = [plain_history(h) for h in hist]
            before = [list(h) for h in hist]
            sys_msgs = [{"role": "system", "content": sys_p}] if sys_p and sys_p.strip() else []
            convs = [sys_msgs + hist[i] + [{"role": "user", "content": message}] for i in range(n)]
            for i in range(n):
                hist[i] = hist[i] + [{"role": "user", "content": message}, {"role": "assistant", "content": ""}]
            texts = [""] * n
            changed = threading.Event()
            box: dict[str, Any] = {}
            stop_ev = session.stop_event(getattr(request, "session_hash", None) or "api")
            new_turn = {"system": sys_p or "", "panes": list(pick[:n])}

            def on_update(i: int, text: str) -> None:
                texts[i] = text
                changed.set()

            def work() -> None:
                try:
                    answers = engine.generate(pick[:n], convs, samp, stop=stop_ev, on_update=on_update)
                    box["answers"] = answers
                    if rw and rw != NO_REWARD and not stop_ev.is_set():
                        box["scoring"] = True
                        changed.set()
                        box["rewards"] = engine.score(rw, convs, answers, col_values)
                except Exception as e:  # shown to the user below
                    box["error"] = e
                finally:
                    changed.set()

            def view(done: bool, reward_md: list[str] | None = None, note: str = ""):
                for i in range(n):
                    hist[i][-1]["content"] = texts[i] if (texts[i] or done) else "…"
                bots_out = [hist[i] if i < n else gr.update() for i in range(MAX_PANES)]
                rw_out = [(reward_md[i] if reward_md else "") if i < n else gr.update() for i in range(MAX_PANES)]
                return [*bots_out, *rw_out, note, new_turn]

            thread = threading.Thread(target=work, daemon=True, name="lorarl-chat-generate")
            t0 = time.monotonic()
            thread.start()
            yield [*view(False, note="generating…")[:-2], "", "generating…", new_turn]
            try:
                while thread.is_alive():
                    if not changed.wait(0.25):
                        continue
                    changed.clear()
                    note = "scoring…" if box.get("scoring") else "generating…"
                    out = view(False, note=note)
                    yield [*out[:-2], gr.update(), note, new_turn]
                    time.sleep(0.04)  # at most ~25 screen updates a second
                thread.join()
                stopped = stop_ev.is_set()
            finally:
                stop_ev.set()  # a cancelled or disconnected request stops its generation
            if "error" in box:  # put the panes back as they were, then say what went wrong
                yield [
                    *before[:n],
                    *[gr.update()] * (MAX_PANES - n),
                    *[gr.update()] * MAX_PANES,
                    gr.update(),
                    "error",
                    {},
                ]
                raise gr.Error(str(box["error"]))
            reward_md = [r.markdown() for r in box["rewards"]] if box.get("rewards") else None
            answers = box.get("answers") or []
            ntok = sum(len(a.token_ids) for a in answers)
            dt = time.monotonic() - t0
            state = "stopped" if stopped else "done"
            note = f"{state}: {ntok} tokens in {dt:.1f} s"
            for i, a in enumerate(answers):
                texts[i] = a.text
            out = view(True, reward_md, note)
            yield [*out[:-2], gr.update(), note, new_turn]

        # Explicit parameters (no *args): gradio passes the request by its position in the signature.
        def on_send(message, n, p0, p1, p2, p3, h0, h1, h2, h3, sys_p, temp, tp, mx, sd, rw, colj, request: gr.Request):
            message = (message or "").strip()
            if not message:
                raise gr.Error("type a message first")
            pick, hist = [p0, p1, p2, p3], [h0, h1, h2, h3]
            yield from _stream(message, n, pick, hist, sys_p, temp, tp, mx, sd, rw, colj, request)

        def on_regen(n, p0, p1, p2, p3, h0, h1, h2, h3, sys_p, temp, tp, mx, sd, rw, colj, request: gr.Request):
            pick = [p0, p1, p2, p3]
            n = int(n)
            hist = [plain_history(h) for h in (h0, h1, h2, h3)]
            message = None
            for h in hist[:n]:
                users = [m["content"] for m in h if m["role"] == "user"]
                if users:
                    message = users[-1]
                    break
            if message is None:
                raise gr.Error("nothing to regenerate yet")
            for i in range(n):
                h = hist[i]
                if len(h) >= 2 and h[-1]["role"] == "assistant" and h[-2] == {"role": "user", "content": message}:
                    hist[i] = h[:-2]
                elif h and h[-1] == {"role": "user", "content": message}:
                    hist[i] = h[:-1]
            yield from _stream(message, n, pick, hist, sys_p, temp, tp, mx, sd, rw, colj, request)

        def on_stop(request: gr.Request):
            session.stop(getattr(request, "session_hash", None) or "api")
            return "stopped"

        def on_clear():
            return [[] for _ in range(MAX_PANES)] + ["" for _ in range(MAX_PANES)] + ["cleared", {}]

        def on_pick(value):
            try:
                entry = engine.prepare(value)
            except LorarlError as e:
                raise gr.Error(str(e)) from None
            return [], "", f"ready: {entry.label}"

        def on_panes(n):
            return [gr.Column(visible=i < int(n)) for i in range(MAX_PANES)]

        def on_refresh(*picked):
            catalog.scan()
            new = catalog.choices()
            valid = {c[1] for c in new}
            picks = [gr.Dropdown(choices=new, value=v if v in valid else BASE_ID) for v in picked]
            return [*picks, gr.Dropdown(choices=catalog.scorer_choices()), status_line("list refreshed")]

        def make_vote(verdict: str):
            def on_vote(li, ri, tr, *hist):
                li, ri = int(li) - 1, int(ri) - 1
                if li == ri:
                    raise gr.Error("pick two different panes to compare")
                tr = dict(tr or {})
                panes = tr.get("panes") or []
                if max(li, ri) >= len(panes):
                    raise gr.Error("those panes have not answered yet")
                if tr.get("voted"):
                    raise gr.Error(f"already voted on this answer ({tr['voted']}); send or regenerate to vote again")
                try:
                    path = session.vote(
                        verdict,
                        tr.get("system", ""),
                        plain_history(hist[li]),
                        plain_history(hist[ri]),
                        panes[li],
                        panes[ri],
                    )
                except LorarlError as e:
                    raise gr.Error(str(e)) from None
                what = "tie" if verdict == "tie" else f"pane {(li if verdict == 'left' else ri) + 1} preferred"
                tr["voted"] = what
                return f"saved vote ({what}) to `{path}`", tr

            return on_vote

        # This module postpones annotations and imports gradio lazily, so gradio cannot resolve the string
        # "gr.Request" by itself: give it the class, or it would not pass the request (and its session) in.
        for fn in (on_send, on_regen, on_stop):
            fn.__annotations__["request"] = gr.Request

        settings = [system, temperature, top_p, max_new, seed, reward, columns]
        outs = [*bots, *rewards, msg, status, turn]
        private = {"api_visibility": "private"}
        e_send = send.click(on_send, [msg, n_panes, *pickers, *bots, *settings], outs, **private)
        e_submit = msg.submit(on_send, [msg, n_panes, *pickers, *bots, *settings], outs, **private)
        e_regen = regen.click(on_regen, [n_panes, *pickers, *bots, *settings], outs, **private)
        stop.click(on_stop, None, status, cancels=[e_send, e_submit, e_regen], queue=False, **private)
        clear.click(on_clear, None, [*bots, *rewards, status, turn], **private)
        for i in range(MAX_PANES):
            pickers[i].change(on_pick, pickers[i], [bots[i], rewards[i], status], **private)
        n_panes.change(on_panes, n_panes, cols, **private)
        refresh.click(on_refresh, pickers, [*pickers, reward, status], **private)
        for verdict, btn in (("left", vote_left), ("right", vote_right), ("tie", vote_tie)):
            btn.click(make_vote(verdict), [left_pane, right_pane, turn, *bots], [status, turn], **private)

        # ---- API (gradio_client) ------------------------------------------------------------------------------
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

            Returns {"panes", "answers", "finished", "rewards"}; ``reward`` is an id from /rewards or "none",
            ``columns`` a JSON object of extra reward columns (e.g. {"answer": "42"}).
            """
            try:
                samp = Sampling(temperature, top_p, int(max_new_tokens), int(seed))
                return session.respond(prompt, list(panes), system, samp, reward, parse_columns(columns))
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

    demo.lorarl_session = session  # for tests and embedding
    return demo


def launch(
    runs_dir: str | os.PathLike = "runs",
    host: str = "127.0.0.1",
    port: int = 7860,
    model: str | None = None,
    share: bool = False,
    shared=None,
    prevent_thread_lock: bool = False,
    quiet: bool = False,
):
    """Build and serve the app (127.0.0.1 by default: it has no authentication). Returns the app."""
    import gradio as gr

    if host not in ("127.0.0.1", "localhost", "::1") and not quiet:
        print(f"lorarl chat: warning: serving on {host} without authentication; anyone who can reach it can use it")
    demo = build_app(runs_dir, model=model, shared=shared)
    demo.queue(default_concurrency_limit=4)
    system_fonts = ["ui-sans-serif", "system-ui", "sans-serif"]  # no web fonts: the app works offline
    demo.launch(
        server_name=host,
        server_port=port,
        share=share,
        prevent_thread_lock=prevent_thread_lock,
        quiet=quiet,
        theme=gr.themes.Soft(font=system_fonts, font_mono=["ui-monospace", "monospace"]),
        css=CSS,
        footer_links=["api"],
    )
    return demo


__all__ = [
    "BASE_ID",
    "Answer",
    "Catalog",
    "ChatEngine",
    "ChatSession",
    "Entry",
    "RewardResult",
    "Sampling",
    "append_jsonl",
    "build_app",
    "launch",
    "preference_record",
]
