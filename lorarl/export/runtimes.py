"""The runtimes the fidelity gate (:mod:`.gate`) runs a model in: each decodes greedily and scores given tokens.

| runtime | what it runs |
|---|---|
| :class:`TrainingRuntime` | the model as it trained: :class:`lorarl.model.SharedBase` (the recipe's quantization, NF4 where it trained NF4) with the policy adapter, greedy through :func:`lorarl.rollout.generate_rollout` like ``lorarl eval`` |
| :class:`TransformersRuntime` | a transformers model: a merged export, PEFT (an adapter export on its base loaded in fp32), or a GGUF dequantized by transformers' GGUF loader; sampling from a clean generation config (:mod:`lorarl.model.sampling`) |
| :class:`LlamaCppRuntime` | a GGUF in llama.cpp (llama-cpp-python): the runtime llama.cpp, Ollama and LM Studio users run |

Every runtime takes prompts as token ids (the ids the training model saw), returns each greedy completion as ids up
to and including its first EOS (at most ``max_new_tokens``), and scores a completion teacher-forced: the log-prob
``log softmax(logits)[token]`` (temperature 1) of each of its tokens and the argmax token at each position.
"""

from __future__ import annotations

import dataclasses
import gc
import os
from pathlib import Path
from typing import Any

import torch

from lorarl.model.tokens import completion_mask, pad_left, pad_right, position_ids

Scores = tuple[list[list[float]], list[list[int]]]  # per completion: log-prob of each token, argmax at each position


def _cut(ids: torch.Tensor, eos_ids: list[int]) -> list[list[int]]:
    """Generated ids ``[B, T]`` -> each row up to and including its first EOS."""
    mask, _ = completion_mask(ids, eos_ids)
    return [row[keep].tolist() for row, keep in zip(ids.cpu(), mask.cpu())]


@torch.no_grad()
def _score_batch(module: Any, prompts: list[list[int]], completions: list[list[int]], pad: int, device) -> Scores:
    """One forward of ``[left-padded prompt | right-padded completion]``; logits kept only where they predict a
    completion token."""
    p_ids, p_mask = pad_left(prompts, pad)
    c_ids, c_mask = pad_right(completions, pad)
    T = c_ids.shape[1]
    ids = torch.cat([p_ids, c_ids], dim=1).to(device)
    mask = torch.cat([p_mask.long(), c_mask], dim=1).to(device)
    out = module(
        input_ids=ids, attention_mask=mask, position_ids=position_ids(mask), use_cache=False, logits_to_keep=T + 1
    )
    logits = out.logits[:, -(T + 1) : -1].float()  # [B, T, V]: position t predicts completion token t
    logp = torch.log_softmax(logits, dim=-1).gather(-1, c_ids.to(device).unsqueeze(-1)).squeeze(-1).cpu()
    top = logits.argmax(-1).cpu()
    lens = [len(c) for c in completions]
    return [logp[i, :n].tolist() for i, n in enumerate(lens)], [top[i, :n].tolist() for i, n in enumerate(lens)]


@torch.no_grad()
def _logits(module: Any, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The fp32 logits ``[B, T, V]`` of left-padded ``ids`` / ``mask`` ``[B, T]`` (one forward, no cache)."""
    return module(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask), use_cache=False).logits.float()


def _batched_scores(fn: Any, prompts: list, completions: list, batch_size: int) -> Scores:
    logps, tops = [], []
    for s in range(0, len(prompts), batch_size):
        a, b = fn(prompts[s : s + batch_size], completions[s : s + batch_size])
        logps += a
        tops += b
    return logps, tops


class TrainingRuntime:
    """The policy as it trained: the adapter on the training base (the recipe's quantization and dtype)."""

    def __init__(
        self, src: Any, recipe: Any, device: Any = None, quantization: str | None = None, batch_size: int = 16
    ):
        from lorarl.model import SharedBase, pick_device
        from lorarl.model.loading import resolve_dtype, resolve_quantization

        device = torch.device(device) if device is not None else pick_device()
        mcfg = dataclasses.replace(recipe.model, name=src.base_path, gradient_checkpointing=False)
        if quantization:
            mcfg = dataclasses.replace(mcfg, quantization=quantization)
        self.recipe, self.batch_size = recipe, batch_size
        self.shared = SharedBase.load(mcfg, device)
        self.shared.add_adapter("policy", init_from=src.adapter_dir, trainable=False)
        quant = resolve_quantization(mcfg, device)
        dtype = str(resolve_dtype(mcfg, device)).replace("torch.", "")
        self.name = f"lorarl SharedBase + policy adapter ({'nf4' if quant == 'nf4' else dtype} base, {device.type})"
        self.eos_ids, self.pad_id = self.shared.eos_ids, self.shared.pad_id
        self.tokenizer = self.shared.tokenizer

    def greedy(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        from lorarl.rollout import generate_rollout

        out: list[list[int]] = []
        for s in range(0, len(prompts), self.batch_size):
            r = generate_rollout(
                self.shared,
                prompts[s : s + self.batch_size],
                self.recipe.generation,
                role="policy",
                greedy=True,
                max_new_tokens=max_new_tokens,
            )
            out += [ids[m].tolist() for ids, m in zip(r.completion_ids, r.completion_mask)]
        return out

    def score(self, prompts: list[list[int]], completions: list[list[int]]) -> Scores:
        def fn(p: list, c: list) -> Scores:
            with self.shared.role("policy"):
                return _score_batch(self.shared.module, p, c, self.pad_id, self.shared.device)

        return _batched_scores(fn, prompts, completions, self.batch_size)

    def logits(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The policy's fp32 logits ``[B, T, V]`` of left-padded ``ids`` / ``mask`` on this runtime's device."""
        with self.shared.role("policy"):
            return _logits(self.shared.module, ids.to(self.shared.device), mask.to(self.shared.device))

    def close(self) -> None:
        del self.shared
        _free()


class TransformersRuntime:
    """A transformers model (merged export, PEFT adapter on its base, or a dequantized GGUF), greedy through
    :func:`lorarl.model.sampling.generate_kwargs` from a clean generation config with the training model's EOS
    ids and pad."""

    def __init__(self, model: Any, name: str, eos_ids: list[int], pad_id: int, device: Any = None, batch_size=16):
        from lorarl.model import pick_device
        from lorarl.model.sampling import use_clean_generation_config

        self.device = torch.device(device) if device is not None else pick_device()
        self.model = model.to(self.device).eval()
        use_clean_generation_config(self.model, eos_ids, pad_id)
        self.name, self.eos_ids, self.pad_id, self.batch_size = name, list(eos_ids), int(pad_id), batch_size

    @torch.no_grad()
    def greedy(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        from lorarl.model.sampling import generate_kwargs

        gen = generate_kwargs(greedy=True, max_new_tokens=max_new_tokens, eos_ids=self.eos_ids, pad_id=self.pad_id)
        out: list[list[int]] = []
        for s in range(0, len(prompts), self.batch_size):
            ids, mask = pad_left(prompts[s : s + self.batch_size], self.pad_id)
            ids, mask = ids.to(self.device), mask.long().to(self.device)
            generated = self.model.generate(input_ids=ids, attention_mask=mask, use_cache=True, **gen)
            out += _cut(generated[:, ids.shape[1] :], self.eos_ids)
        return out

    def score(self, prompts: list[list[int]], completions: list[list[int]]) -> Scores:
        def fn(p: list, c: list) -> Scores:
            return _score_batch(self.model, p, c, self.pad_id, self.device)

        return _batched_scores(fn, prompts, completions, self.batch_size)

    def logits(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The model's fp32 logits ``[B, T, V]`` of left-padded ``ids`` / ``mask`` on this runtime's device."""
        return _logits(self.model, ids.to(self.device), mask.to(self.device))

    def close(self) -> None:
        del self.model
        _free()


class LlamaCppRuntime:
    """A GGUF file in llama.cpp through llama-cpp-python: one sequence at a time, every position's logits kept
    (``logits_all``); greedy = the argmax of llama.cpp's logits at each step."""

    def __init__(self, gguf_file: Path, eos_ids: list[int], n_ctx: int, threads: int | None = None):
        import llama_cpp

        self.llm = llama_cpp.Llama(
            model_path=str(gguf_file),
            n_ctx=n_ctx,
            n_batch=min(n_ctx, 512),
            logits_all=True,
            n_threads=threads or max(1, torch.get_num_threads() or os.cpu_count() or 1),
            n_gpu_layers=-1,
            seed=0,
            verbose=False,
        )
        self.eos_ids = set(eos_ids)
        self.name = f"llama.cpp (llama-cpp-python {llama_cpp.__version__})"

    def _logits_after(self, tokens: list[int]) -> Any:
        """Evaluate ``tokens`` from an empty context; llama.cpp's logits ``[len(tokens), V]`` (numpy, fp32)."""
        self.llm.reset()
        self.llm.eval(tokens)
        return self.llm.scores[: len(tokens)]

    def greedy(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        out = []
        for prompt in prompts:
            self.llm.reset()
            self.llm.eval(prompt)
            done: list[int] = []
            while len(done) < max_new_tokens:
                token = int(self.llm.scores[self.llm.n_tokens - 1].argmax())
                done.append(token)
                if token in self.eos_ids:
                    break
                self.llm.eval([token])
            out.append(done)
        return out

    def score(self, prompts: list[list[int]], completions: list[list[int]]) -> Scores:
        logps, tops = [], []
        for p, c in zip(prompts, completions):
            logits = torch.from_numpy(self._logits_after(p + c)[len(p) - 1 : len(p) + len(c) - 1].copy()).float()
            logps.append(torch.log_softmax(logits, -1).gather(-1, torch.tensor(c).unsqueeze(-1)).squeeze(-1).tolist())
            tops.append(logits.argmax(-1).tolist())
        return logps, tops

    def tokenize(self, text: str) -> list[int]:
        """``text`` tokenized by the GGUF's own tokenizer (special tokens parsed, BOS as its metadata says)."""
        return self.llm.tokenize(text.encode("utf-8"), add_bos=True, special=True)

    def close(self) -> None:
        self.llm.close()
        del self.llm
        _free()


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def llama_cpp_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("llama_cpp") is not None


def export_runtime(
    fmt: str,
    artefact: Path,
    eos_ids: list[int],
    pad_id: int,
    *,
    device: Any = None,
    runtime: str | None = None,
    n_ctx: int = 512,
    batch_size: int = 16,
) -> Any:
    """The runtime that runs an export as its users do: ``merged`` in transformers (its saved dtype), ``adapter``
    with PEFT on its base in fp32, ``gguf`` in llama.cpp when llama-cpp-python is installed (``runtime`` =
    ``"llama.cpp"`` requires it, ``"transformers"`` forces transformers' dequantizing GGUF loader)."""
    from transformers import AutoModelForCausalLM

    if fmt == "gguf":
        if runtime in (None, "llama.cpp") and llama_cpp_available():
            return LlamaCppRuntime(artefact, eos_ids, n_ctx)
        if runtime == "llama.cpp":
            from lorarl.errors import LorarlError

            raise LorarlError(
                "gate runtime llama.cpp: llama-cpp-python is not installed (pip install llama-cpp-python)"
            )
        model = AutoModelForCausalLM.from_pretrained(str(artefact.parent), gguf_file=artefact.name, dtype=torch.float32)
        why = "" if runtime == "transformers" else "; llama-cpp-python is not installed"
        name = f"transformers GGUF loader (dequantized to fp32{why})"
        return TransformersRuntime(model, name, eos_ids, pad_id, device, batch_size)
    if fmt == "adapter":
        from peft import AutoPeftModelForCausalLM

        model = AutoPeftModelForCausalLM.from_pretrained(str(artefact), dtype=torch.float32)
        return TransformersRuntime(model, "PEFT adapter on its base (fp32)", eos_ids, pad_id, device, batch_size)
    model = AutoModelForCausalLM.from_pretrained(str(artefact), dtype="auto")
    dtype = str(next(model.parameters()).dtype).replace("torch.", "")
    return TransformersRuntime(model, f"transformers ({dtype})", eos_ids, pad_id, device, batch_size)


def reference_runtime(folder: Path, device: Any = None, batch_size: int = 16) -> TransformersRuntime:
    """A merged export as the reference of a comparison (instead of the training model), with its own tokenizer
    and EOS ids."""
    from transformers import AutoModelForCausalLM

    from lorarl.model import load_tokenizer
    from lorarl.model.tokens import eos_token_ids

    tok = load_tokenizer(str(folder))
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype="auto")
    pad = int(tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)
    dtype = str(next(model.parameters()).dtype).replace("torch.", "")
    rt = TransformersRuntime(
        model, f"merged export {folder} (transformers, {dtype})", eos_token_ids(model, tok), pad, device, batch_size
    )
    rt.tokenizer = tok
    return rt
