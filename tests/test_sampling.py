"""What is sampled is what is scored: a model folder's generation config cannot add logits processors, the recorded
log-probs equal those ``generate`` actually sampled from, and training recipes refuse top-p / top-k."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from lorarl.config import GenerationConfig, LoraSettings, ModelConfig
from lorarl.model import SharedBase
from lorarl.model.sampling import inherited_processors
from lorarl.rollout import generate_rollout


@pytest.fixture(scope="module")
def qwen_style_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model with a generation config like Qwen2.5-Instruct's, only stronger: repetition penalty 1.3,
    top-k 20, top-p 0.8, sampling on. Its (tied) embeddings are scaled x4 so its logits are far from flat and a
    repetition penalty visibly changes them (while fp32 rounding of the two forward paths stays below 1e-5)."""
    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("qwen-style") / "model"
    shutil.copytree(tiny_model_dir, out)
    w = load_file(str(out / "model.safetensors"))
    w["model.embed_tokens.weight"] = w["model.embed_tokens.weight"] * 4.0
    save_file(w, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((out / "generation_config.json").read_text())
    cfg.update(do_sample=True, repetition_penalty=1.3, top_k=20, top_p=0.8, temperature=0.7)
    (out / "generation_config.json").write_text(json.dumps(cfg))
    return out


def _shared(folder) -> SharedBase:
    sb = SharedBase.load(ModelConfig(name=str(folder), quantization="none", dtype="float32"))
    sb.add_adapter("policy", LoraSettings(r=4))
    torch.manual_seed(1)
    with torch.no_grad():
        for p in sb.adapter_parameters("policy"):
            p.add_(torch.randn_like(p) * 0.05)
    return sb


def test_the_folders_processors_are_reported_and_not_inherited(qwen_style_dir):
    sb = _shared(qwen_style_dir)
    assert inherited_processors(sb.hub_generation_config) == {"repetition_penalty": 1.3, "top_k": 20, "top_p": 0.8}
    clean = sb.base.generation_config
    assert clean.repetition_penalty == 1.0 and clean.top_k is None and clean.top_p is None
    assert list(clean.eos_token_id) == sb.eos_ids


def test_recorded_logprobs_equal_what_generate_sampled_from(qwen_style_dir):
    sb = _shared(qwen_style_dir)
    seen: list[torch.Tensor] = []
    real_generate = sb.module.generate

    def generate_keeping_scores(*args, **kwargs):
        out = real_generate(*args, **kwargs, output_scores=True, return_dict_in_generate=True)
        seen.append(torch.stack(out.scores, dim=1).float())  # [N, T, V]: the scores generate sampled from
        return out.sequences

    sb.module.generate = generate_keeping_scores
    tok = sb.tokenizer
    prompts = [tok("Say something:")["input_ids"], tok("Count to three:")["input_ids"]]
    gen = GenerationConfig(max_new_tokens=12, temperature=0.7)
    torch.manual_seed(0)
    r = generate_rollout(sb, prompts, gen, group_size=4, record_old=True, record_sampler=True)
    scores = seen[0][:, : r.completion_ids.shape[1]]  # [N, T, V]
    sampled_from = torch.log_softmax(scores, dim=-1).gather(-1, r.completion_ids.unsqueeze(-1)).squeeze(-1)
    m = r.completion_mask
    assert int(m.sum()) >= 40
    # the trainer's log-probs (recorded by a separate forward, as the update computes them) and the sampler's own
    torch.testing.assert_close(r.old_logprobs[m], sampled_from[m], rtol=0, atol=1e-5)
    torch.testing.assert_close(r.sampler_logprobs[m], sampled_from[m], rtol=0, atol=1e-5)
    # and what generate sampled from is the plain softmax(logits / T): no repetition penalty, no top-k / top-p
    ids, att = r.input_ids, r.attention_mask
    with torch.no_grad(), sb.role("policy"):
        logits = sb.module(input_ids=ids, attention_mask=att).logits[:, r.prompt_ids.shape[1] - 1 : -1].float()
    plain = torch.log_softmax(logits / 0.7, dim=-1).gather(-1, r.completion_ids.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(plain[m], sampled_from[m], rtol=0, atol=1e-5)
    assert (torch.log_softmax(scores, dim=-1) > -float("inf")).all()  # no token truncated away


def test_inheriting_the_folders_config_would_change_what_is_sampled(qwen_style_dir):
    """The trap this guards against, shown on the same model: with the folder's config, generate samples from a
    distribution the plain softmax does not describe."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(qwen_style_dir)
    tok = _shared(qwen_style_dir).tokenizer
    ids = torch.tensor([tok("Count to three: one two one two")["input_ids"]])
    out = model.generate(ids, max_new_tokens=4, output_scores=True, return_dict_in_generate=True, pad_token_id=0)
    finite = torch.isfinite(out.scores[0]).sum()
    assert finite <= 20  # top-k 20 (and top-p 0.8) applied behind the caller's back
