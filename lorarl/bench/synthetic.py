"""Stand-ins for measurements where only shapes matter: randomly initialised models of published shapes (NF4 like
``lorarl.model.load_base`` loads them, nothing downloaded), prompts of random token ids and a tokenizer that reads
them, a reward with a spread but no meaning, and a reward adapter with random weights.

They let a recipe drive the real algorithm (:func:`lorarl.algos.make_algorithm`, its data loading, reward source
and step) on a randomly initialised model with no tokenizer files and no trained reward model:

* :func:`random_model` builds a model of a shape (``lorarl.plan.KNOWN_CONFIGS`` or :data:`TINY`), optionally with
  every decoder projection swapped for a bitsandbytes NF4 ``Linear4bit`` (:func:`quantize_nf4`);
* :class:`IdTokenizer` "encodes" a prompt written as space-separated token ids and decodes ids back to that form;
* :func:`write_id_prompts` writes such prompts as a ``.jsonl`` data source, with controlled lengths;
* :func:`hashed_reward` gives each completion a reproducible reward in [0, 1) from a hash of its text, so groups
  have a spread (GRPO skips rows whose advantage is exactly 0, which would leave training unmeasured);
* :func:`add_random_reward_adapter` makes a frozen reward adapter + score head for ``reward.adapter``;
* :func:`tiny_llama_folder` saves a tiny random Llama with the embedded model's real tokenizer (the test suite's
  model, and ``lorarl bench gpu --smoke``'s where a part needs real text).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from lorarl.config import LoraSettings

TINY = {  # a test shape: a random Llama of hidden size 64, 2 layers, 512 tokens
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "tie_word_embeddings": True,
    "max_position_embeddings": 1024,
    "attention_bias": False,
}
SHAPE_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
    "tie_word_embeddings",
    "max_position_embeddings",
)
LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def shape_config(d: dict):
    """A transformers config of shape ``d`` (``model_type`` and the sizes), with pad 0, EOS 1, BOS 2 (as
    :class:`IdTokenizer` has them)."""
    from transformers import AutoConfig

    kw = {k: d[k] for k in SHAPE_KEYS}
    if d["model_type"] == "llama":
        kw["attention_bias"] = bool(d.get("attention_bias", False))
    cfg = AutoConfig.for_model(d["model_type"], pad_token_id=0, eos_token_id=1, bos_token_id=2, **kw)
    cfg.use_cache = True
    return cfg


def quantize_nf4(model, compute_dtype: torch.dtype) -> int:
    """Replace every decoder projection by a bitsandbytes NF4 Linear4bit (double quantization), in place, one at
    a time on the weights' device. ``lm_head`` and embeddings stay in the compute dtype (as transformers does).
    Returns how many were replaced."""
    import bitsandbytes as bnb

    from lorarl.model.loading import keep_nf4_trainable
    from lorarl.model.nf4_dequant import check_cpu_dequantize

    n = 0
    targets = [(name, mod) for name, mod in model.named_modules() if name.split(".")[-1] in LINEAR_NAMES]
    for name, lin in targets:
        parent = model.get_submodule(name.rsplit(".", 1)[0])
        new = bnb.nn.Linear4bit(
            lin.in_features,
            lin.out_features,
            bias=lin.bias is not None,
            compute_dtype=compute_dtype,
            compress_statistics=True,
            quant_type="nf4",
            device="meta",
        )
        new.weight = bnb.nn.Params4bit(
            lin.weight.data, requires_grad=False, compress_statistics=True, quant_type="nf4", module=new
        ).to(lin.weight.device)
        if lin.bias is not None:
            new.bias = torch.nn.Parameter(lin.bias.data, requires_grad=False)
        setattr(parent, name.rsplit(".", 1)[1], new)
        del lin
        n += 1
    model.is_loaded_in_4bit = True  # peft dispatches its bnb LoRA layers on this flag
    keep_nf4_trainable(model)  # as load_base: no CPU inference repacking, bitsandbytes' CPU dequantize checked
    check_cpu_dequantize(model)
    return n


def random_model(d: dict, device: torch.device, dtype: torch.dtype, quantization: str = "none"):
    """A randomly initialised causal LM of shape ``d``, built directly on ``device`` in ``dtype`` (seed 0), in eval
    mode; ``quantization="nf4"`` swaps its projections (:func:`quantize_nf4`). Returns ``(model, NF4 count)``."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(shape_config(d), dtype=dtype, attn_implementation="sdpa")
    model.eval()
    n_quant = quantize_nf4(model, dtype) if quantization == "nf4" else 0
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return model, n_quant


class IdTokenizer:
    """What the data loader, SharedBase and the rollout read from a tokenizer, for texts that are token ids."""

    pad_token_id = 0
    eos_token_id = 1
    bos_token_id = 2
    chat_template = None
    padding_side = "left"

    def __init__(self, vocab: int):
        self.vocab = vocab

    def __len__(self) -> int:
        return self.vocab

    def __call__(self, text: str, add_special_tokens: bool = True, **kwargs) -> dict[str, list[int]]:
        return {"input_ids": [int(t) for t in text.split()]}

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return " ".join(str(int(i)) for i in ids)

    def batch_decode(self, sequences, skip_special_tokens: bool = True) -> list[str]:
        return [self.decode(s, skip_special_tokens) for s in sequences]


def write_id_prompts(path: Path, n: int, prompt_len: int, vocab: int, seed: int = 1) -> Path:
    """``n`` prompts of random ids in ``[3, vocab)`` (no pad / EOS / BOS), lengths in ``[prompt_len / 2,
    prompt_len]`` with the first exactly ``prompt_len`` (left padding as real prompts have; the longest fixed), as
    a ``.jsonl`` data source for :class:`IdTokenizer`."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(prompt_len // 2, prompt_len + 1, (n,), generator=gen).tolist()
    lengths[0] = prompt_len
    rows = [{"prompt": " ".join(map(str, torch.randint(3, vocab, (k,), generator=gen).tolist()))} for k in lengths]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def write_id_rows(path: Path, n: int, prompt_len: int, response_len: int, vocab: int, kind: str, seed: int = 1) -> Path:
    """``n`` rows of random ids in ``[3, vocab)`` for :class:`IdTokenizer`, every one exactly ``prompt_len`` +
    ``response_len`` ids (the loaders add the end-of-turn EOS): ``kind`` ``pairs`` (TRL's ``prompt`` / ``chosen`` /
    ``rejected``, the two responses different) or ``sft`` (``prompt`` / ``completion``). Every row at the planner's
    length, so a measured step and its plan see the same shapes."""
    gen = torch.Generator().manual_seed(seed)

    def ids(k: int) -> str:
        return " ".join(map(str, torch.randint(3, vocab, (k,), generator=gen).tolist()))

    rows = []
    for _ in range(n):
        row = {"prompt": ids(prompt_len)}
        if kind == "pairs":
            row.update(chosen=ids(response_len), rejected=ids(response_len))
        else:
            row["completion"] = ids(response_len)
        rows.append(row)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def hashed_reward(prompts: list, completions: list, **kwargs) -> list[float]:
    """A reward in [0, 1) that depends only on the completion's text (a hash): spread, reproducible, meaningless."""
    return [int.from_bytes(hashlib.sha256(str(c).encode()).digest()[:4], "big") / 2**32 for c in completions]


HASHED_REWARD = f"{__name__}:hashed_reward"  # its name in a recipe's reward.functions


def add_random_reward_adapter(shared, folder: Path, lora: LoraSettings, seed: int = 0) -> Path:
    """Add a frozen ``reward`` adapter + score head with random weights to ``shared`` and write it at ``folder``
    (for ``reward.adapter``). An algorithm set up on ``shared`` then finds the role present and uses it, as it uses
    one it loaded from ``folder``; another process loads it from ``folder``."""
    torch.manual_seed(seed)
    shared.add_adapter("reward", lora, trainable=False, head=True)
    with torch.no_grad():
        for p in shared.adapter_parameters("reward"):
            p.add_(torch.randn_like(p) * 0.01)  # LoRA B starts at 0: make the adapter change the scores
    shared.save_adapter("reward", folder)
    return folder


def tiny_llama_folder(folder: Path, seed: int = 0, hidden: int = 64, layers: int = 2) -> Path:
    """A random-init Llama (``hidden`` wide, ``layers`` deep, ``torch.manual_seed(seed)``) with the embedded default
    model's tokenizer, saved at ``folder`` as a transformers folder."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from lorarl.model import load_tokenizer
    from lorarl.model.registry import DEFAULT_MODEL, convert_embedded

    tok = load_tokenizer(str(convert_embedded(DEFAULT_MODEL)))
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    LlamaForCausalLM(cfg).save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
    return folder
