"""One base model, many roles.

The base is loaded once (NF4 on CUDA by default). Every role is a way of running it:

| role        | how it runs                                               | trainable           |
|-------------|-----------------------------------------------------------|---------------------|
| policy      | LoRA adapter ``policy``                                   | yes                 |
| old policy  | log-probs recorded at rollout (no copy of the model)      | no                  |
| reference   | adapters disabled, or a frozen ``reference`` adapter when | no                  |
|             | RL starts from a trained adapter / iterative GRPO         |                     |
| critic      | LoRA adapter ``critic`` + value head (hidden -> 1, fp32)  | yes                 |
| reward      | LoRA adapter ``reward`` + score head (hidden -> 1, fp32)  | yes (its own stage) |

Only one adapter is active at a time. :meth:`SharedBase.role` switches, and restores the previous adapter and the
train/eval mode in ``finally``. Per-role forward functions return only what the loops need; log-probs are computed
from hidden states in chunks over time, so the full ``[B, T, V]`` fp32 logits never exist at once.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from lorarl.config import LoraSettings, ModelConfig
from lorarl.errors import LorarlError
from lorarl.model.chunked import chunked_token_logprobs
from lorarl.model.loading import OutputHead, load_base, logit_transform, lora_config, new_head
from lorarl.model.sampling import use_clean_generation_config
from lorarl.model.tokens import end_of_turn_id, eos_token_ids, last_token_index, position_ids
from lorarl.runfiles import refuse_links

REFERENCE = "reference"
HEAD_FILE = "head.safetensors"
HEAD_ROLES = ("critic", "reward")


def _applies_dropout(module: nn.Module) -> bool:
    if isinstance(module, nn.Dropout):
        return module.p > 0
    return any(
        "dropout" in k and isinstance(v, float) and not isinstance(v, bool) and v > 0 for k, v in vars(module).items()
    )


def _is_lora_of(param_name: str, adapter: str) -> bool:
    """PEFT names LoRA weights ``...q_proj.lora_A.<adapter>.weight`` (embeddings: ``lora_embedding_A.<adapter>``)."""
    return "lora_" in param_name and f".{adapter}." in param_name + "."


def set_train(module: nn.Module, mode: bool) -> None:
    """``module.train(mode)`` unless every submodule already has that flag (the check walks the modules once; the
    call recurses through ``train`` and ``__setattr__`` of each, ~18 ms of CPU on a 135M model)."""
    if any(m.training != mode for m in module.modules()):
        module.train(mode)


class SharedBase:
    """The base model loaded once, LoRA adapters for the roles, fp32 heads for critic and reward."""

    def __init__(self, model, tokenizer, model_cfg: ModelConfig | None = None, base_path: str | None = None):
        self.base = model
        self.tokenizer = tokenizer
        self.cfg = model_cfg or ModelConfig()
        self.base_path = base_path or getattr(model.config, "_name_or_path", None)
        self.peft = None  # the PeftModel, created with the first adapter
        self.heads = nn.ModuleDict()
        self.device = next(model.parameters()).device
        for p in model.parameters():
            p.requires_grad_(False)
        if self.cfg.gradient_checkpointing:
            enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
            kw = (
                "activation_checkpointing_kwargs"
                if enable.__name__.startswith("activation")
                else "gradient_checkpointing_kwargs"
            )
            enable(**{kw: {"use_reentrant": False}})
        model.config.use_cache = False
        model.eval()
        # sampling is built from scratch: the folder's generation config (repetition penalty, top-k, ...) is kept
        # only for reporting (lorarl.model.sampling)
        self.hub_generation_config = use_clean_generation_config(model, eos_token_ids(model, tokenizer), self.pad_id)
        self.check_output_path()

    # ---- construction ---------------------------------------------------------------------------------------
    @classmethod
    def load(cls, model_cfg: ModelConfig, device: torch.device | None = None) -> SharedBase:
        model, tok, path = load_base(model_cfg, device)
        return cls(model, tok, model_cfg, base_path=path)

    @property
    def module(self) -> nn.Module:
        """What runs forward passes: the PeftModel once an adapter exists, else the plain base."""
        return self.peft if self.peft is not None else self.base

    @property
    def adapters(self) -> list[str]:
        return list(self.peft.peft_config) if self.peft is not None else []

    def has_adapter(self, name: str) -> bool:
        return name in self.adapters

    def add_adapter(
        self,
        name: str,
        settings: LoraSettings | None = None,
        *,
        init_from: str | os.PathLike | None = None,
        trainable: bool = True,
        head: bool | None = None,
    ) -> None:
        """Add a LoRA adapter ``name`` (fresh from ``settings`` or loaded from a PEFT folder ``init_from``).

        ``head`` adds a fp32 hidden -> 1 head (default: for the critic and reward roles); a ``head.safetensors``
        beside a loaded adapter is loaded into it.
        """
        from peft import PeftModel, get_peft_model

        if self.has_adapter(name):
            raise LorarlError(f"adapter {name!r} already exists")
        if init_from is not None:
            folder = Path(init_from)
            if not (folder / "adapter_config.json").is_file():
                raise LorarlError(f"{folder}: not a PEFT adapter folder (no adapter_config.json)")
            if self.peft is None:
                self.peft = PeftModel.from_pretrained(self.base, str(folder), adapter_name=name, is_trainable=trainable)
            else:
                self.peft.load_adapter(str(folder), adapter_name=name, is_trainable=trainable)
        else:
            cfg = lora_config(settings or LoraSettings())
            if self.peft is None:
                self.peft = get_peft_model(self.base, cfg, adapter_name=name)
            else:
                self.peft.add_adapter(name, cfg)
        for p in self.adapter_parameters(name):
            p.requires_grad_(trainable)
        if head is None:
            head = name in HEAD_ROLES
        if head:
            self.heads[name] = new_head(self.base.config.hidden_size, self.device)
            if init_from is not None and (Path(init_from) / HEAD_FILE).is_file():
                self.load_head(name, Path(init_from) / HEAD_FILE)
            self.heads[name].requires_grad_(trainable)
        self.peft.eval()

    def remove_adapter(self, name: str) -> None:
        """Delete adapter ``name`` and its head (a no-op when there is none). If it is the active adapter, another
        one becomes active first (PEFT cannot delete the active adapter while others exist)."""
        if not self.has_adapter(name):
            return
        if self.peft.active_adapter == name:
            others = [a for a in self.adapters if a != name]
            if others:
                self.peft.set_adapter(others[0])
        self.peft.delete_adapter(name)
        if name in self.heads:
            del self.heads[name]

    def load_adapter_weights(self, name: str, weights: dict[str, torch.Tensor]) -> None:
        """Overwrite adapter ``name``'s LoRA weights in place from a PEFT state dict (``adapter_model.safetensors``
        keys); raises LorarlError when the keys do not belong to this adapter's shape."""
        from peft import set_peft_model_state_dict

        result = set_peft_model_state_dict(self.peft, weights, adapter_name=name)
        unexpected = [k for k in getattr(result, "unexpected_keys", []) if "lora_" in k]
        if unexpected:
            raise LorarlError(f"weights do not match adapter {name!r} ({unexpected[0]} ...)")

    def adapter_parameters(self, name: str) -> list[nn.Parameter]:
        """The LoRA parameters of adapter ``name`` (not the head)."""
        if self.peft is None:
            return []
        return [p for n, p in self.peft.named_parameters() if _is_lora_of(n, name)]

    def trainable_parameters(self, name: str) -> list[nn.Parameter]:
        """Exactly the role's adapter and head: what its optimizer holds."""
        params = self.adapter_parameters(name)
        if name in self.heads:
            params += list(self.heads[name].parameters())
        return params

    def copy_adapter(self, src: str, dst: str) -> None:
        """Copy adapter weights (and head) ``src`` -> ``dst`` in place (iterative GRPO's reference refresh)."""
        src_params = dict(zip(self._lora_keys(src), self.adapter_parameters(src)))
        dst_params = dict(zip(self._lora_keys(dst), self.adapter_parameters(dst)))
        if src_params.keys() != dst_params.keys():
            raise LorarlError(f"adapters {src!r} and {dst!r} have different shapes or targets")
        with torch.no_grad():
            for k, p in src_params.items():
                dst_params[k].copy_(p)
            if src in self.heads and dst in self.heads:
                self.heads[dst].load_state_dict(self.heads[src].state_dict())

    def _lora_keys(self, name: str) -> list[str]:
        return [(n + ".").replace(f".{name}.", ".@.") for n, _ in self.peft.named_parameters() if _is_lora_of(n, name)]

    # ---- role switching -------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def role(self, name: str, train: bool = False, dropout: bool = False) -> Iterator[SharedBase]:
        """Run the body with role ``name`` active (``policy``, ``critic``, ``reward``, ``reference``, ``base``).

        ``reference`` is the frozen ``reference`` adapter if there is one, else the base with adapters disabled;
        ``base`` always disables adapters. ``train`` sets train mode (gradient checkpointing needs it). ``dropout``
        turns dropout on (LoRA dropout and the base's own) -- only supervised stages (SFT, the reward model) ask for
        it: RL forwards run without dropout, so the log-probs the update computes are those of the function that
        sampled (with ``lora.dropout > 0`` the first PPO ratio would otherwise not be 1). The previous adapter, mode
        and dropout states are restored even when the body raises (nested roles included).
        """
        module = self.module
        was_training = module.training
        dropouts = self._dropout_modules()
        dropout_states = [m.training for m in dropouts]
        prev = self.peft.active_adapter if self.peft is not None else None
        disable = name == "base" or (name == REFERENCE and not self.has_adapter(REFERENCE))
        if not disable and not self.has_adapter(name):
            raise LorarlError(f"no adapter for role {name!r} (have: {', '.join(self.adapters) or 'none'})")
        # Host time: on SmolLM2-135M (2,499 modules) peft's set_adapter costs ~24 ms and module.train ~18 ms of CPU,
        # twice per role, so a role switch cost ~0.1 s whatever the device. Only what changes is switched: the
        # adapter when another one is asked for, the train flags when one differs.
        switch = not disable and name != prev
        grads = {n: [p.requires_grad for p in self.adapter_parameters(n)] for n in self.adapters} if switch else {}
        try:
            set_train(module, train)
            for m in dropouts:
                m.train(train and dropout)
            if disable:
                ctx = self.peft.disable_adapter() if self.peft is not None else contextlib.nullcontext()
                with ctx:
                    yield self
            else:
                if switch:
                    self.peft.set_adapter(name)
                yield self
        finally:
            if switch and prev is not None and prev in self.adapters:  # (prev may have been removed)
                self.peft.set_adapter(prev)
                # peft's set_adapter flips requires_grad; restore what each adapter had
                for n, flags in grads.items():
                    for p, f in zip(self.adapter_parameters(n), flags):
                        p.requires_grad_(f)
            set_train(module, was_training)
            for m, state in zip(dropouts, dropout_states):
                m.train(state)

    def _dropout_modules(self) -> list[nn.Module]:
        """Every module whose train flag switches dropout on: ``nn.Dropout`` modules (LoRA dropout, GPT-2-style
        residual dropout) and modules applying a functional dropout from a positive ``*dropout*`` attribute
        (e.g. an attention's ``attention_dropout``). Cached per set of adapters."""
        key = tuple(self.adapters)
        if getattr(self, "_dropouts_key", None) != key:
            self._dropouts = [m for m in self.module.modules() if _applies_dropout(m)]
            self._dropouts_key = key
        return self._dropouts

    # ---- forward functions ----------------------------------------------------------------------------------
    def decoder(self) -> nn.Module:
        """The decoder stack without the output head (input ids -> last hidden states); its LoRA layers follow the
        active role."""
        inner = self.peft.get_base_model() if self.peft is not None else self.base
        return inner.get_decoder() if hasattr(inner, "get_decoder") else inner.model

    def output_head(self) -> nn.Module:
        """Hidden states -> logits as the model's own forward computes them: the output projection (its LoRA layers,
        if any, follow the active role), then the model's logit transform (:class:`OutputHead`)."""
        lm_head = (self.peft.get_base_model() if self.peft is not None else self.base).get_output_embeddings()
        transform = logit_transform(self.base.config)
        return OutputHead(lm_head, **transform) if transform else lm_head

    @torch.no_grad()
    def check_output_path(self, n_tokens: int = 8) -> float:
        """Refuse a model whose forward does something to its logits that :meth:`output_head` does not reproduce:
        run a few tokens through the model's own forward and through ``decoder() -> output_head()`` and compare.
        Returns the largest difference; raises LorarlError naming the model type when it is not rounding noise."""
        vocab = self.base.get_output_embeddings().weight.shape[0]
        ids = torch.arange(3, 3 + n_tokens, device=self.device).clamp(max=vocab - 1)[None]
        att = torch.ones_like(ids)
        was_training = self.module.training
        self.module.eval()
        try:
            with self.role("base"):
                ref = self.module(input_ids=ids, attention_mask=att).logits.float()
                ours = self.output_head()(self.hidden_states(ids, att)).float()
        finally:
            self.module.train(was_training)
        diff = float((ref - ours).abs().max())
        scale = float(ref.abs().max()) + 1.0
        if not diff <= 1e-3 * scale:
            mtype = getattr(self.base.config, "model_type", type(self.base).__name__)
            raise LorarlError(
                f"model type {mtype}: its forward transforms the logits after the output layer in a way lorarl does "
                f"not reproduce (max difference {diff:.3g}); log-probs would not describe what it samples: not supported"
            )
        return diff

    @property
    def attn_implementation(self) -> str:
        """The attention implementation the base runs (``sdpa``, ``eager``, ``flash_attention_2``, ...)."""
        return getattr(self.base.config, "_attn_implementation", None) or "sdpa"

    @property
    def eos_ids(self) -> list[int]:
        """Every id that ends a completion (:func:`lorarl.model.tokens.eos_token_ids`)."""
        return eos_token_ids(self.base, self.tokenizer)

    @property
    def end_of_turn_id(self) -> int:
        """The EOS a finished response is scored at (:func:`lorarl.model.tokens.end_of_turn_id`)."""
        if getattr(self, "_end_of_turn", None) is None:
            self._end_of_turn = end_of_turn_id(self.base, self.tokenizer)
        return self._end_of_turn

    @property
    def pad_id(self) -> int:
        """The id padding is written with (the tokenizer's pad, which :func:`load_tokenizer` sets to EOS if none)."""
        tok = self.tokenizer
        return int(tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)

    def hidden_states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Last hidden states [B, T, H] of the active role (no logits computed)."""
        out = self.decoder()(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids(attention_mask),
            use_cache=False,
        )
        return out.last_hidden_state

    def token_logprobs(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        start: int,
        temperature: float = 1.0,
        with_entropy: bool = False,
        entropy_grad: bool = True,
        token_stat=None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Policy / reference: log p(input_ids[:, t] | input_ids[:, :t]) for t >= start, at ``temperature``.

        input_ids, attention_mask [B, L] -> logprobs [B, L - start] fp32 (entropy [B, L - start] if asked, or
        ``token_stat`` in its place; with a gradient only if ``entropy_grad``:
        :func:`~lorarl.model.chunked.chunked_token_logprobs`).
        """
        if start < 1:
            raise ValueError("start must be >= 1 (the first token has no prediction)")
        hidden = self.hidden_states(input_ids, attention_mask)[:, start - 1 : -1]
        return self.hidden_logprobs(hidden, input_ids[:, start:], temperature, with_entropy, entropy_grad, token_stat)

    def hidden_logprobs(
        self,
        hidden: torch.Tensor,
        targets: torch.Tensor,
        temperature: float = 1.0,
        with_entropy: bool = False,
        entropy_grad: bool = True,
        token_stat=None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """log softmax(output_head(hidden) / temperature)[targets]: hidden [B, T, H], targets [B, T] -> [B, T] fp32
        (entropy too if asked), a chunk of logits at a time as ``model.logprob_chunk_size`` and
        ``model.logprob_chunk_tokens`` bound it (:func:`~lorarl.model.chunked.chunked_token_logprobs`)."""
        return chunked_token_logprobs(
            hidden,
            self.output_head(),
            targets,
            temperature,
            self.cfg.logprob_chunk_size,
            with_entropy,
            chunk_tokens=self.cfg.logprob_chunk_tokens,
            entropy_grad=entropy_grad,
            token_stat=token_stat,
        )

    def values(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, start: int) -> torch.Tensor:
        """Critic: V(s_t) for the states before each token t >= start -> [B, L - start] fp32."""
        hidden = self.hidden_states(input_ids, attention_mask)[:, start - 1 : -1]
        return self.heads["critic"](hidden.float()).squeeze(-1)

    def scores(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, head: str = "reward") -> torch.Tensor:
        """Reward model: one score per sequence, read at the last non-pad token -> [B] fp32."""
        hidden = self.hidden_states(input_ids, attention_mask)
        idx = last_token_index(attention_mask)
        last = hidden[torch.arange(hidden.shape[0], device=hidden.device), idx]
        return self.heads[head](last.float()).squeeze(-1)

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, **kwargs) -> torch.Tensor:
        """Sample with the active role (call inside ``role(...)``); returns [B, P + T] token ids."""
        kwargs.setdefault("pad_token_id", self.tokenizer.pad_token_id)
        kwargs.setdefault("use_cache", True)
        return self.module.generate(input_ids=input_ids, attention_mask=attention_mask, **kwargs)

    @torch.no_grad()
    def generate_mixed(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, adapter_names: list[str] | None, **kwargs
    ) -> torch.Tensor:
        """Sample in eval mode (no dropout) with one adapter per row: PEFT's mixed-batch inference,
        ``adapter_names[i]`` for row ``i`` (``"__base__"``: the bare base); ``None``: the active adapter for every row.
        The previous train / eval mode is restored afterwards. Returns [B, P + T] token ids."""
        module = self.module
        was_training = module.training
        module.eval()
        try:
            if adapter_names is not None:
                kwargs["adapter_names"] = list(adapter_names)
            return self.generate(input_ids, attention_mask, **kwargs)
        finally:
            module.train(was_training)

    # ---- saving and loading ---------------------------------------------------------------------------------
    def save_adapter(self, name: str, folder: str | os.PathLike) -> Path:
        """Write adapter ``name`` as a PEFT folder (adapter_config.json + adapter_model.safetensors, plus
        head.safetensors for roles with a head) at ``folder``, atomically (temp folder, then rename)."""
        from safetensors.torch import save_file

        folder = refuse_links(folder)  # (lorarl.runfiles: nothing in a run folder is written through a link)
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-", dir=folder.parent))
        try:
            cfg = self.peft.peft_config[name]
            old_base = cfg.base_model_name_or_path
            cfg.base_model_name_or_path = self.base_path
            try:
                self.peft.save_pretrained(str(tmp / "x"), selected_adapters=[name])
            finally:
                cfg.base_model_name_or_path = old_base
            os.replace(tmp / "x" / name, tmp / "adapter")
            if name in self.heads:
                state = {k: v.detach().contiguous().cpu() for k, v in self.heads[name].state_dict().items()}
                save_file(state, str(tmp / "adapter" / HEAD_FILE))
            (tmp / "adapter" / "lorarl.json").write_text(json.dumps({"role": name}))
            if folder.exists():
                old = Path(tempfile.mkdtemp(prefix=f".{folder.name}.old-", dir=folder.parent))
                os.replace(folder, old / "x")
                os.replace(tmp / "adapter", folder)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(tmp / "adapter", folder)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return folder

    def load_head(self, name: str, file: str | os.PathLike) -> None:
        from safetensors.torch import load_file

        state = load_file(str(file), device=str(self.device))
        self.heads[name].load_state_dict({k: v.float() for k, v in state.items()})

    # ---- accounting -----------------------------------------------------------------------------------------
    def parameter_bytes(self) -> dict[str, int]:
        """Bytes held by the base weights and by each adapter (+ head)."""
        adapter_ids = set()
        out = {}
        for n in self.adapters:
            ps = self.trainable_parameters(n)
            adapter_ids |= {id(p) for p in ps}
            out[n] = sum(p.numel() * p.element_size() for p in ps)
        seen = set()
        base_bytes = 0
        for t in list(self.base.parameters()) + list(self.base.buffers()):
            if id(t) in adapter_ids or id(t) in seen:
                continue
            seen.add(id(t))
            base_bytes += t.numel() * t.element_size()
        out["base"] = base_bytes
        return out
