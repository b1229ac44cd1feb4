"""Answering panes: adapters and merged exports loaded on demand, one batched ``generate`` for all panes on the
shared base, streaming, stop.

:class:`ChatEngine` holds ONE :class:`~lorarl.model.SharedBase`. Adapters are loaded onto it lazily, once, under
sanitized names, and every pane that runs on it is answered by ONE batched ``generate`` call with PEFT's per-row
``adapter_names`` (``"__base__"`` for the base), so memory stays close to one model and the base and tuned answers
come from the same batch. A :class:`~lorarl.chat.streaming.PaneStreamer` receives the ``[B]`` new tokens of each
step and decodes every row incrementally, so all panes stream at once; a row stops at its EOS. Merged exports are
separate full models: each is loaded once, when first chosen, and answers its panes in its own batch after the
shared-base batch. Sampling is built like training's (:func:`lorarl.model.sampling.generate_kwargs`, every field
explicit; an export's own generation config is replaced by a clean one), plus the top_p / top_k chat may use.
"""

from __future__ import annotations

import hashlib
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from lorarl.chat.catalog import Catalog, Entry, folder_stamp
from lorarl.chat.inputs import check_generation, check_seed
from lorarl.chat.scoring import AnswerScorer, RewardResult
from lorarl.chat.streaming import PaneStreamer, render_prompt, stopping_criteria
from lorarl.chat.tools import RunTools, answer_with_tools
from lorarl.config import GenerationConfig
from lorarl.errors import LorarlError
from lorarl.model.sampling import generate_kwargs, use_clean_generation_config
from lorarl.model.shared import SharedBase
from lorarl.model.tokens import eos_token_ids, pad_left
from lorarl.user_code import guarded

PEFT_BASE = "__base__"  # PEFT's name for "no adapter" in a mixed adapter batch


@dataclass
class Answer:
    """One pane's answer: its text (growing while it streams), its token ids without the EOS, and whether it
    ended with an EOS (not cut by max_new_tokens or Stop)."""

    pane: int
    checkpoint: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finished: bool = False
    steps: list = field(default_factory=list)  # tool panes: the calls and results before the answer (ToolStep)
    turns: int = 0  # tool panes: model turns taken (the answer is the last one's text)


@dataclass
class _Request:
    """What every group of one :meth:`ChatEngine.generate` call shares."""

    conversations: Sequence[list[dict]]
    generation: GenerationConfig
    seed: int
    stop: threading.Event
    on_update: Callable[[int, str], None] | None
    answers: list[Answer]
    on_steps: Callable[[int, list], None] | None = None


def adapter_name(prefix: str, key: str) -> str:
    """A PEFT-safe adapter name for ``key`` (letters, digits, underscores) that stays unique."""
    digest = hashlib.sha1(key.encode()).hexdigest()[:10]
    return f"{prefix}_{re.sub(r'[^0-9A-Za-z_]', '_', key)[:40]}_{digest}"


def _pad_id(tok) -> int:
    """The id padding is written with: the tokenizer's pad, else its EOS (as :attr:`SharedBase.pad_id`)."""
    return int(tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)


class ChatEngine:
    """One shared base, adapters loaded lazily onto it, merged exports loaded once each; all under one lock."""

    def __init__(self, shared, catalog: Catalog):
        self.shared = shared
        self.catalog = catalog
        self.lock = threading.RLock()
        self.scoring = AnswerScorer(shared, self.lock)
        self._adapters: dict[str, tuple[str, str]] = {}  # entry id -> (peft adapter name, files stamp)
        self._exports: dict[str, tuple[Any, Any]] = {}  # entry id -> (model, tokenizer)
        self.tools = RunTools(catalog, shared)  # the tools of runs trained with an agent section

    # ---- loading ----------------------------------------------------------------------------------------------
    def loaded(self) -> dict[str, list[str]]:
        """The entry ids whose adapters / exports are in memory."""
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
        """The name of ``entry``'s adapter on the shared base, loading it (again, if the run saved new weights)."""
        folder = self.catalog.folder(entry)
        stamp = folder_stamp(folder)
        have = self._adapters.get(entry.id)
        if have is not None and have[1] == stamp:
            return have[0]
        name = adapter_name("ck", f"{entry.id}@{stamp}")
        if not self.shared.has_adapter(name):
            self.shared.add_adapter(name, init_from=folder, trainable=False, head=False)
        if have is not None:  # the run saved a newer adapter in place: drop the old copy
            try:
                self.shared.remove_adapter(have[0])
            except Exception:  # keeping an old copy in memory is harmless
                pass
        self._adapters[entry.id] = (name, stamp)
        return name

    def _export(self, entry: Entry) -> tuple[Any, Any]:
        """``(model, tokenizer)`` of a merged export, loaded once like the base (same quantization and dtype) and
        with a clean generation config (the folder's repetition penalty etc. must not leak into sampling)."""
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
            use_clean_generation_config(model, eos_token_ids(model, tok), _pad_id(tok))
            self._exports[entry.id] = (model, tok)
        return self._exports[entry.id]

    # ---- generation -------------------------------------------------------------------------------------------
    def generate(
        self,
        panes: Sequence[str],
        conversations: Sequence[list[dict]],
        generation: GenerationConfig | None = None,
        *,
        seed: int = 0,
        stop: threading.Event | None = None,
        on_update: Callable[[int, str], None] | None = None,
        on_steps: Callable[[int, list], None] | None = None,
    ) -> list[Answer]:
        """Answer ``conversations[i]`` (chat messages ending with the user's turn) with checkpoint ``panes[i]``.

        ``generation``: sampling settings (temperature 0: greedy; default :data:`~lorarl.chat.inputs.CHAT_DEFAULTS`);
        ``seed`` seeds torch before each batch (negative: the RNG is left as it is). All panes on the shared base
        are answered by ONE batched ``generate`` call (per-row ``adapter_names``); each merged export answers its
        panes in its own batch afterwards. ``on_update(pane, text)`` streams text; ``stop`` ends every row.

        A pane whose run trained with tools (its ``recipe.yaml`` has an ``agent`` section) answers through the tool
        loop with the run's tools (:mod:`lorarl.chat.tools`): ``Answer.steps`` holds its calls and results, each
        new one reported by ``on_steps(pane, steps)``, and ``Answer.text`` its final answer.
        """
        if len(panes) != len(conversations) or not panes:
            raise LorarlError("need one conversation per pane, and at least one pane")
        generation = check_generation(generation)
        entries = [self.catalog.get(p) for p in panes]
        answers = [Answer(i, e.id) for i, e in enumerate(entries)]
        request = _Request(
            conversations, generation, check_seed(seed), stop or threading.Event(), on_update, answers, on_steps
        )
        groups: dict[str, list[int]] = {}  # "" (the shared base) or an export's id -> its panes
        for i, e in enumerate(entries):
            groups.setdefault(e.id if e.kind == "export" else "", []).append(i)
        with self.lock, torch.no_grad():
            for key, rows in groups.items():
                if request.stop.is_set():
                    break
                model, tok, names = self._group_model(entries, key, rows)
                eos = eos_token_ids(model.module if isinstance(model, SharedBase) else model, tok)
                agents = [self.tools.agent(entries[i], tok, eos) for i in rows]
                for with_tools in (False, True):
                    part = [k for k, a in enumerate(agents) if (a is not None) == with_tools]
                    if not part or request.stop.is_set():
                        continue
                    sub_names = [names[k] for k in part] if names is not None else None
                    if with_tools:
                        tooled = [agents[k] for k in part]
                        answer_with_tools(self, model, tok, sub_names, [rows[k] for k in part], tooled, request)
                    else:
                        self._generate_group(model, tok, sub_names, [rows[k] for k in part], request)
        return answers

    def _group_model(self, entries: list[Entry], key: str, rows: list[int]) -> tuple[Any, Any, list[str] | None]:
        """``(model, tokenizer, adapter name per row)`` answering one group: a merged export (no names), or the shared
        base (:meth:`SharedBase.generate_mixed`) with each row's adapter loaded (``__base__`` for the base; no names
        while no adapter exists)."""
        if key:
            model, tok = self._export(entries[rows[0]])
            return model, tok, None
        names = [PEFT_BASE if entries[i].kind == "base" else self._adapter(entries[i]) for i in rows]
        return self.shared, self.shared.tokenizer, names if self.shared.adapters else None

    def _generate_group(self, model, tok, adapter_names: list[str] | None, rows: list[int], request: _Request) -> None:
        """Answer panes ``rows`` in one ``generate`` call of ``model`` (a merged export, or the shared base with
        ``adapter_names``: one per row, or None)."""
        prompts = [
            tok(render_prompt(tok, request.conversations[i]), add_special_tokens=False)["input_ids"] for i in rows
        ]

        def on_text(r: int, text: str) -> None:
            request.answers[rows[r]].text = text
            if request.on_update is not None:
                request.on_update(rows[r], text)

        out = self.generate_ids(model, tok, adapter_names, prompts, request, request.generation.max_new_tokens, on_text)
        eos = set(eos_token_ids(model.module if isinstance(model, SharedBase) else model, tok))
        for r, ids in enumerate(out):
            self._finish(request, rows[r], ids, eos, tok)

    def generate_ids(
        self,
        model,
        tok,
        adapter_names: list[str] | None,
        prompts: list[list[int]],
        request: _Request,
        max_new_tokens: int,
        on_text: Callable[[int, str], None],
        seed: bool = True,
    ) -> list[list[int]]:
        """One batched ``generate`` of ``model`` (a merged export, or the shared base with ``adapter_names``) after
        the token-id ``prompts``, streaming each row's text to ``on_text(row, text)``; returns the new ids of each row
        (EOS and padding included). ``seed``: reseed torch with the request's seed first."""
        net = model.module if isinstance(model, SharedBase) else model
        generation = request.generation
        max_pos = getattr(getattr(net, "config", None), "max_position_embeddings", None)
        if isinstance(max_pos, int) and max_pos > 0:
            keep = max(1, max_pos - max_new_tokens)
            longest = max(len(p) for p in prompts)
            if seed and longest > keep:  # a request's first call: refused, never cut silently
                raise LorarlError(
                    f"the conversation is {longest} tokens; this model reads {max_pos}, {keep} of them before "
                    f"{max_new_tokens} new ones: shorten the message, Clear the chat or lower max new tokens"
                )
            prompts = [p[-keep:] for p in prompts]  # a tool pane's later turn: its oldest tokens go
        pad_id = _pad_id(tok)
        device = next(net.parameters()).device
        input_ids, attention_mask = pad_left(prompts, pad_id)
        eos = eos_token_ids(net, tok)
        kwargs = generate_kwargs(
            greedy=generation.temperature == 0,
            temperature=generation.temperature,
            top_p=generation.top_p,
            top_k=generation.top_k,
            max_new_tokens=max_new_tokens,
            eos_ids=eos,
            pad_id=pad_id,
        )
        kwargs.update(use_cache=True, streamer=PaneStreamer(tok, eos, len(prompts), on_text))
        kwargs["stopping_criteria"] = stopping_criteria(request.stop)
        if seed and request.seed >= 0:
            torch.manual_seed(request.seed)
        ids, mask = input_ids.to(device), attention_mask.long().to(device)
        if isinstance(model, SharedBase):
            out = model.generate_mixed(ids, mask, adapter_names, **kwargs)
        else:
            out = model.generate(input_ids=ids, attention_mask=mask, **kwargs)
        return out[:, input_ids.shape[1] :].tolist()

    @staticmethod
    def _finish(request: _Request, pane: int, ids: list[int], eos: set[int], tok) -> None:
        """Set a pane's final answer from its generated ids (cut at the first EOS) and report its text."""
        cut = next((k for k, t in enumerate(ids) if t in eos), None)
        a = request.answers[pane]
        a.finished = cut is not None
        a.token_ids = ids if cut is None else ids[:cut]
        a.text = tok.decode(a.token_ids, skip_special_tokens=True)
        if request.on_update is not None:
            request.on_update(pane, a.text)

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
        code = self.catalog.scorer_code(scorer)
        self.catalog.consent.require(code, f"reward {scorer_id}")  # nothing from a run folder runs unseen
        with guarded(self.catalog.consent.check_load):  # (each load checked again: lorarl.chat.consent)
            return self.scoring.score(scorer, conversations, answers, columns, code.digest if code else "")
