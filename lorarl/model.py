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
from torch.utils.checkpoint import checkpoint

from lorarl.config import LoraSettings, ModelConfig
from lorarl.errors import LorarlError
from lorarl.models import resolve_model

REFERENCE = "reference"
HEAD_FILE = "head.safetensors"
HEAD_ROLES = ("critic", "reward")


def pick_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def resolve_quantization(cfg: ModelConfig, device: torch.device) -> str:
    if cfg.quantization == "auto":
        return "nf4" if device.type == "cuda" else "none"
    return cfg.quantization


def resolve_dtype(cfg: ModelConfig, device: torch.device) -> torch.dtype:
    if cfg.dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[cfg.dtype]


def load_tokenizer(path: str, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"  # prompts are left padded so every completion starts at the same column
    return tok


def load_base(cfg: ModelConfig, device: torch.device | None = None):
    """Load the base model once: NF4 (bitsandbytes, double quantization, bf16 compute) or full precision."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    device = device or pick_device()
    path = resolve_model(cfg.name)
    quant = resolve_quantization(cfg, device)
    dtype = resolve_dtype(cfg, device)
    kwargs: dict = {"dtype": dtype, "trust_remote_code": cfg.trust_remote_code}
    if quant == "nf4":
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=dtype if dtype != torch.float32 or device.type == "cpu" else torch.bfloat16,
        )
        kwargs["device_map"] = {"": str(device) if device.type == "cpu" else device.index or 0}
    try:
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    except OSError as e:
        raise LorarlError(f"model {cfg.name}: cannot load ({e})") from None
    if quant != "nf4":
        model.to(device)
    tok = load_tokenizer(path, cfg.trust_remote_code)
    return model, tok, path


def lora_config(settings: LoraSettings):
    from peft import LoraConfig

    return LoraConfig(
        r=settings.r,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=settings.target_modules,
        bias="none",
        task_type="CAUSAL_LM",
    )


def new_head(hidden_size: int, device) -> nn.Linear:
    """Value / score head: hidden -> 1, kept in fp32 on the base's device (small; no dtype traps)."""
    head = nn.Linear(hidden_size, 1, bias=True, dtype=torch.float32, device=device)
    nn.init.normal_(head.weight, std=1.0 / (hidden_size + 1) ** 0.5)
    nn.init.zeros_(head.bias)
    return head


def chunked_token_logprobs(
    hidden: torch.Tensor,
    lm_head: nn.Module,
    targets: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int = 256,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(lm_head(h_t) / temperature)[targets_t], computed ``chunk_size`` positions at a time.

    hidden [B, T, H], targets [B, T] -> logprobs [B, T] fp32 (and entropy [B, T] if asked). Each chunk's logits are
    recomputed in the backward pass (activation checkpointing), so at most one chunk of ``[B, chunk, V]`` fp32
    logits is alive at a time, forward or backward.
    """

    def one_chunk(h: torch.Tensor, tgt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = lm_head(h).float() / temperature  # [B, c, V]
        lse = torch.logsumexp(logits, dim=-1)  # [B, c]
        lp = logits.gather(-1, tgt.unsqueeze(-1)).squeeze(-1) - lse
        if with_entropy:
            ent = lse - (torch.softmax(logits, dim=-1) * logits).sum(-1)
        else:
            ent = torch.zeros_like(lse)
        return lp, ent

    outs_lp, outs_ent = [], []
    for s in range(0, hidden.shape[1], chunk_size):
        h, tgt = hidden[:, s : s + chunk_size], targets[:, s : s + chunk_size]
        if torch.is_grad_enabled() and h.requires_grad:
            lp, ent = checkpoint(one_chunk, h, tgt, use_reentrant=False)
        else:
            lp, ent = one_chunk(h, tgt)
        outs_lp.append(lp)
        outs_ent.append(ent)
    lp = torch.cat(outs_lp, dim=1)
    return lp, (torch.cat(outs_ent, dim=1) if with_entropy else None)


def _is_lora_of(param_name: str, adapter: str) -> bool:
    """PEFT names LoRA weights ``...q_proj.lora_A.<adapter>.weight`` (embeddings: ``lora_embedding_A.<adapter>``)."""
    return "lora_" in param_name and f".{adapter}." in param_name + "."


def last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """Index of the last non-pad position of each row, from the attention mask (never from pad_token_id)."""
    T = attention_mask.shape[1]
    positions = torch.arange(T, device=attention_mask.device).expand_as(attention_mask)
    return torch.where(attention_mask.bool(), positions, torch.full_like(positions, -1)).max(dim=1).values


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
    def role(self, name: str, train: bool = False) -> Iterator[SharedBase]:
        """Run the body with role ``name`` active (``policy``, ``critic``, ``reward``, ``reference``, ``base``).

        ``reference`` is the frozen ``reference`` adapter if there is one, else the base with adapters disabled;
        ``base`` always disables adapters. ``train`` sets train mode (needed for gradient checkpointing) - dropout
        is off otherwise. The previous adapter and mode are restored even when the body raises.
        """
        module = self.module
        was_training = module.training
        prev = self.peft.active_adapter if self.peft is not None else None
        disable = name == "base" or (name == REFERENCE and not self.has_adapter(REFERENCE))
        if not disable and not self.has_adapter(name):
            raise LorarlError(f"no adapter for role {name!r} (have: {', '.join(self.adapters) or 'none'})")
        grads = {n: [p.requires_grad for p in self.adapter_parameters(n)] for n in self.adapters}
        try:
            module.train(train)
            if disable:
                ctx = self.peft.disable_adapter() if self.peft is not None else contextlib.nullcontext()
                with ctx:
                    yield self
            else:
                self.peft.set_adapter(name)
                yield self
        finally:
            if self.peft is not None and prev is not None:
                self.peft.set_adapter(prev)
                # peft's set_adapter flips requires_grad; restore what each adapter had
                for n, flags in grads.items():
                    for p, f in zip(self.adapter_parameters(n), flags):
                        p.requires_grad_(f)
            module.train(was_training)

    # ---- forward functions ----------------------------------------------------------------------------------
    def _decoder(self) -> nn.Module:
        inner = self.peft.get_base_model() if self.peft is not None else self.base
        return inner.get_decoder() if hasattr(inner, "get_decoder") else inner.model

    def _lm_head(self) -> nn.Module:
        """The output projection hidden -> vocabulary (its LoRA layers, if any, follow the active role)."""
        return (self.peft.get_base_model() if self.peft is not None else self.base).get_output_embeddings()

    def hidden_states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Last hidden states [B, T, H] of the active role (no logits computed)."""
        position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        out = self._decoder()(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        )
        return out.last_hidden_state

    def token_logprobs(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        start: int,
        temperature: float = 1.0,
        with_entropy: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Policy / reference: log p(input_ids[:, t] | input_ids[:, :t]) for t >= start, at ``temperature``.

        input_ids, attention_mask [B, L] -> logprobs [B, L - start] fp32 (entropy [B, L - start] if asked).
        """
        if start < 1:
            raise ValueError("start must be >= 1 (the first token has no prediction)")
        hidden = self.hidden_states(input_ids, attention_mask)[:, start - 1 : -1]
        head = self._lm_head()
        return chunked_token_logprobs(
            hidden, head, input_ids[:, start:], temperature, self.cfg.logprob_chunk_size, with_entropy
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

    # ---- saving and loading ---------------------------------------------------------------------------------
    def save_adapter(self, name: str, folder: str | os.PathLike) -> Path:
        """Write adapter ``name`` as a PEFT folder (adapter_config.json + adapter_model.safetensors, plus
        head.safetensors for roles with a head) at ``folder``, atomically (temp folder, then rename)."""
        from safetensors.torch import save_file

        folder = Path(folder)
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
