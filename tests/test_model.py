"""One base, many roles: sharing, reference == base, isolation of updates, chunked log-probs, switching, NF4."""

from __future__ import annotations

import pytest
import torch

from lorarl.config import LoraSettings, ModelConfig
from lorarl.errors import LorarlError
from lorarl.model import SharedBase, chunked_token_logprobs, last_token_index


def _batch(tok, texts):
    enc = tok(texts, return_tensors="pt", padding=True)
    return enc["input_ids"], enc["attention_mask"]


def _three_roles(sb: SharedBase) -> None:
    sb.add_adapter("policy", LoraSettings(r=8))
    sb.add_adapter("critic", LoraSettings(r=8))
    sb.add_adapter("reward", LoraSettings(r=8))
    # LoRA B starts at zero; give every adapter non-zero weights so roles really differ
    torch.manual_seed(1)
    with torch.no_grad():
        for name in ("policy", "critic", "reward"):
            for p in sb.adapter_parameters(name):
                p.add_(torch.randn_like(p) * 0.05)


def test_roles_share_one_set_of_base_weights(tiny_shared):
    sb = tiny_shared
    base_before = {id(p) for p in sb.base.parameters()}
    bytes_base_alone = sb.parameter_bytes()["base"]
    _three_roles(sb)
    # the same base tensors back every role: the PeftModel wraps the very module we loaded
    assert sb.peft.get_base_model() is sb.base
    q = sb.peft.get_base_model().model.layers[0].self_attn.q_proj
    assert (
        q.base_layer.weight.data_ptr()
        == next(
            p for n, p in sb.base.named_parameters() if n.endswith("layers.0.self_attn.q_proj.base_layer.weight")
        ).data_ptr()
    )
    sizes = sb.parameter_bytes()
    assert sizes["base"] == bytes_base_alone
    total = sum(sizes.values())
    assert total < 1.1 * bytes_base_alone, sizes
    # no parameter was copied: every base tensor of the start is still there, and the adapters add new ones only
    assert base_before <= {id(p) for p in sb.base.parameters()}


def test_reference_logprobs_equal_plain_base_model(tiny_model_dir, tiny_shared):
    from transformers import AutoModelForCausalLM

    sb = tiny_shared
    _three_roles(sb)
    ids, mask = _batch(sb.tokenizer, ["The cat sat on the mat.", "2 + 2 = 4, and 3 + 5 ="])
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        logits = plain(input_ids=ids, attention_mask=mask, position_ids=pos).logits.float()
        # the same arithmetic as ours (gather - logsumexp) on the plain model's logits: must match bit for bit
        want = logits[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1) - torch.logsumexp(logits[:, :-1], -1)
        with sb.role("reference"):
            got, _ = sb.token_logprobs(ids, mask, start=1)
        with sb.role("policy"):
            pol, _ = sb.token_logprobs(ids, mask, start=1)
    valid = mask[:, 1:].bool()
    assert torch.equal(got[valid], want[valid])
    naive = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    torch.testing.assert_close(got[valid], naive[valid], atol=1e-5, rtol=0)
    assert not torch.allclose(pol[valid], want[valid])  # the policy adapter really changes the outputs


def test_policy_step_changes_only_the_policy_adapter(tiny_shared):
    sb = tiny_shared
    _three_roles(sb)
    snapshot = {n: p.detach().clone() for n, p in sb.peft.named_parameters()}
    heads = {n: p.detach().clone() for n, p in sb.heads.named_parameters()}
    params = sb.trainable_parameters("policy")
    assert params and all(p.requires_grad for p in params)
    opt = torch.optim.AdamW(params, lr=1e-2)
    ids, mask = _batch(sb.tokenizer, ["hello world, this is a test", "another sentence"])
    with sb.role("policy", train=True):
        lp, _ = sb.token_logprobs(ids, mask, start=1)
        loss = -(lp * mask[:, 1:]).sum()
    loss.backward()
    opt.step()
    policy_ids = {id(p) for p in params}
    changed, unchanged_policy = [], []
    for n, p in sb.peft.named_parameters():
        same = torch.equal(p, snapshot[n])
        if id(p) in policy_ids:
            if same:
                unchanged_policy.append(n)
        elif not same:
            changed.append(n)
    assert not changed, changed  # base, critic and reward adapters bit-identical
    assert len(unchanged_policy) < len(policy_ids)  # the policy did move
    for n, p in sb.heads.named_parameters():
        assert torch.equal(p, heads[n])
    # the frozen roles never even received gradients
    for name in ("critic", "reward"):
        assert all(p.grad is None for p in sb.trainable_parameters(name))


def test_role_switch_restores_state_when_body_raises(tiny_shared):
    sb = tiny_shared
    _three_roles(sb)
    sb.peft.set_adapter("critic")
    sb.module.eval()
    with pytest.raises(RuntimeError, match="boom"):
        with sb.role("policy", train=True):
            assert sb.peft.active_adapter == "policy"
            assert sb.module.training
            raise RuntimeError("boom")
    assert sb.peft.active_adapter == "critic"
    assert not sb.module.training
    with pytest.raises(RuntimeError):
        with sb.role("reference"):
            assert (
                sb.peft._adapters_disabled or not sb.peft.base_model._adapters_enabled
                if hasattr(sb.peft.base_model, "_adapters_enabled")
                else True
            )
            raise RuntimeError("inside reference")
    # adapters enabled again: policy output differs from the base's
    ids, mask = _batch(sb.tokenizer, ["abc def"])
    with torch.no_grad(), sb.role("policy"):
        a, _ = sb.token_logprobs(ids, mask, start=1)
    with torch.no_grad(), sb.role("base"):
        b, _ = sb.token_logprobs(ids, mask, start=1)
    assert not torch.allclose(a, b)
    with pytest.raises(LorarlError, match="no adapter for role"):
        with sb.role("nonexistent"):
            pass


def test_chunked_logprobs_match_naive_and_use_less_memory():
    torch.manual_seed(0)
    B, T, H, V = 2, 64, 32, 32000
    hidden = torch.randn(B, T, H)
    head = torch.nn.Linear(H, V, bias=False)
    targets = torch.randint(0, V, (B, T))
    naive = torch.log_softmax(head(hidden).float() / 0.7, -1).gather(-1, targets[..., None]).squeeze(-1)
    got, ent = chunked_token_logprobs(hidden, head, targets, temperature=0.7, chunk_size=8, with_entropy=True)
    torch.testing.assert_close(got, naive, atol=1e-5, rtol=0)
    want_ent = torch.distributions.Categorical(logits=head(hidden).float() / 0.7).entropy()
    torch.testing.assert_close(ent, want_ent, atol=1e-4, rtol=0)

    # peak memory of forward + backward on a large-vocabulary case, each in a fresh process (peak RSS growth)
    naive_peak = _peak_rss_growth("naive")
    chunk_peak = _peak_rss_growth("chunked")
    full_logits_bytes = 4 * 256 * 49152 * 4
    assert naive_peak >= full_logits_bytes, (naive_peak, full_logits_bytes)
    assert chunk_peak < 0.5 * naive_peak, (chunk_peak, naive_peak)


_PEAK_SCRIPT = """
import sys, torch
from lorarl.model import chunked_token_logprobs
torch.manual_seed(0)
B, T, H, V = 4, 256, 64, 49152
hidden = torch.randn(B, T, H, requires_grad=True)
head = torch.nn.Linear(H, V, bias=False)
targets = torch.randint(0, V, (B, T))
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
open("/proc/self/clear_refs", "w").write("5")  # reset the peak-RSS mark (VmHWM)
before = status("VmRSS")
if sys.argv[1] == "naive":
    lp = torch.log_softmax(head(hidden).float(), -1).gather(-1, targets[..., None]).squeeze(-1)
else:
    lp = chunked_token_logprobs(hidden, head, targets, chunk_size=8)[0]
lp.sum().backward()
print(status("VmHWM") - before)
"""


def _peak_rss_growth(mode: str) -> int:
    import os
    import subprocess
    import sys

    # a fixed mmap threshold makes glibc return freed blocks to the OS, so peak RSS tracks live tensors
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    out = subprocess.run(
        [sys.executable, "-c", _PEAK_SCRIPT, mode], capture_output=True, text=True, check=True, env=env
    )
    return int(out.stdout.strip().splitlines()[-1])


def test_chunked_logprob_gradients_match_naive():
    torch.manual_seed(0)
    hidden = torch.randn(2, 10, 16, requires_grad=True)
    head = torch.nn.Linear(16, 50)
    targets = torch.randint(0, 50, (2, 10))
    w = torch.randn(2, 10)
    (chunked_token_logprobs(hidden, head, targets, chunk_size=3)[0] * w).sum().backward()
    g1 = hidden.grad.clone()
    hidden.grad = None
    (torch.log_softmax(head(hidden), -1).gather(-1, targets[..., None]).squeeze(-1) * w).sum().backward()
    torch.testing.assert_close(g1, hidden.grad, atol=1e-6, rtol=1e-5)


def test_logit_chunk_positions_bounds_the_tokens_of_a_chunk():
    from lorarl.core.chunking import logit_chunk_positions

    # c = max(1, min(chunk_size, positions, chunk_tokens // rows)), by hand
    assert logit_chunk_positions(8, 1024, 256, 2048) == 256  # 8 x 256 = 2048 tokens: the position bound holds
    assert logit_chunk_positions(64, 1024, 256, 2048) == 32  # 64 rows: 2048 // 64 positions
    assert logit_chunk_positions(64, 16, 256, 2048) == 16  # fewer positions than either bound
    assert logit_chunk_positions(5000, 100, 256, 2048) == 1  # more rows than tokens: one position at a time
    with pytest.raises(ValueError):
        logit_chunk_positions(0, 10, 256, 2048)


def test_chunk_tokens_bounds_every_head_call_and_changes_no_value():
    """``chunk_tokens``: each output-head call sees at most that many tokens (10 rows x 6 positions for 64 tokens),
    and the log-probs, entropies and gradients equal the unchunked softmax's."""
    torch.manual_seed(0)
    B, T, H, V = 10, 50, 16, 300
    hidden = torch.randn(B, T, H, requires_grad=True)
    linear = torch.nn.Linear(H, V, bias=False)
    seen = []

    def head(h):
        seen.append(tuple(h.shape))
        return linear(h)

    targets = torch.randint(0, V, (B, T))
    lp, ent = chunked_token_logprobs(hidden, head, targets, 0.7, chunk_size=16, with_entropy=True, chunk_tokens=64)
    assert seen == [(B, 6, H)] * 8 + [(B, 2, H)]
    logits = linear(hidden).float() / 0.7
    torch.testing.assert_close(lp, torch.log_softmax(logits, -1).gather(-1, targets[..., None]).squeeze(-1))
    torch.testing.assert_close(ent, torch.distributions.Categorical(logits=logits).entropy(), atol=1e-5, rtol=0)
    w = torch.randn(B, T)
    (lp * w).sum().backward()
    g = hidden.grad.clone()
    hidden.grad = None
    (torch.log_softmax(linear(hidden) / 0.7, -1).gather(-1, targets[..., None]).squeeze(-1) * w).sum().backward()
    torch.testing.assert_close(g, hidden.grad, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_fused_chunk_equals_the_checkpointed_path_bit_for_bit(dtype, temperature):
    """An entropy that is only logged (``entropy_grad=False``) takes :class:`ChunkLogprobs`; an entropy bonus the
    checkpointed autograd path. Where both apply (the loss reads only the log-probs) they must agree exactly: the
    log-probs, the logged entropy and the gradient into the hidden states, with a banned (-inf) token, a soft-capped
    head (Gemma-2's transform) and masked positions whose gradient is 0."""
    from lorarl.model.chunked import ChunkLogprobs

    torch.manual_seed(0)
    B, T, H, V = 3, 20, 16, 500
    linear = torch.nn.Linear(H, V, bias=False).to(dtype)

    def head(h):  # the model's own logit transform: soft-capping, then a banned token
        z = torch.tanh(linear(h) / 30.0) * 30.0
        return z.masked_fill(torch.arange(V) == 7, float("-inf"))

    hidden0 = torch.randn(B, T, H, dtype=dtype)
    targets = torch.randint(8, V, (B, T))
    weights = torch.randn(B, T)
    weights[:, -3:] = 0.0  # masked positions
    out = {}
    for grad_through_entropy in (True, False):
        hidden = hidden0.clone().requires_grad_(True)
        lp, ent = chunked_token_logprobs(
            hidden, head, targets, temperature, chunk_size=6, with_entropy=True, entropy_grad=grad_through_entropy
        )
        (lp * weights).sum().backward()
        out[grad_through_entropy] = (lp.detach(), ent.detach(), hidden.grad)
        assert ent.requires_grad is grad_through_entropy
    for a, b in zip(out[True], out[False]):
        assert torch.equal(a, b)
    assert torch.isfinite(out[False][2]).all() and out[False][2][:, -3:].abs().sum() == 0
    seen = []
    hidden = hidden0.clone().requires_grad_(True)
    orig = ChunkLogprobs.apply
    try:
        ChunkLogprobs.apply = lambda *a: seen.append(a[0].shape) or orig(*a)
        chunked_token_logprobs(hidden, head, targets, temperature, chunk_size=6)
    finally:
        ChunkLogprobs.apply = orig
    assert seen == [(B, 6, H)] * 3 + [(B, 2, H)]  # no entropy asked: every chunk through the fused function


def test_last_token_index_uses_attention_mask_not_pad_id():
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    assert last_token_index(mask).tolist() == [2, 4, 4]


def test_values_and_scores_shapes_and_fp32_heads(tiny_shared):
    sb = tiny_shared
    _three_roles(sb)
    ids, mask = _batch(sb.tokenizer, ["one two three four", "five"])
    with torch.no_grad():
        with sb.role("critic"):
            v = sb.values(ids, mask, start=2)
        with sb.role("reward"):
            s = sb.scores(ids, mask)
    assert v.shape == (2, ids.shape[1] - 2) and v.dtype == torch.float32
    assert s.shape == (2,) and s.dtype == torch.float32
    assert all(p.dtype == torch.float32 and p.device == sb.device for p in sb.heads.parameters())


def test_adapter_saves_in_peft_format_and_plain_peft_loads_it(tiny_model_dir, tiny_shared, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    sb = tiny_shared
    _three_roles(sb)
    out = sb.save_adapter("policy", tmp_path / "policy")
    assert (out / "adapter_config.json").is_file() and (out / "adapter_model.safetensors").is_file()
    sb.save_adapter("critic", tmp_path / "critic")
    assert (tmp_path / "critic" / "head.safetensors").is_file()

    ids, mask = _batch(sb.tokenizer, ["check the saved adapter"])
    with torch.no_grad(), sb.role("policy"):
        ours, _ = sb.token_logprobs(ids, mask, start=1)
    plain = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), str(out)).eval()
    with torch.no_grad():
        logits = plain(input_ids=ids, attention_mask=mask).logits
    theirs = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)

    # reload into a fresh shared base: identical values from the critic head too
    sb2 = SharedBase.load(ModelConfig(name=str(tiny_model_dir), quantization="none", dtype="float32"))
    sb2.add_adapter("critic", init_from=tmp_path / "critic")
    with torch.no_grad(), sb.role("critic"):
        v1 = sb.values(ids, mask, start=1)
    with torch.no_grad(), sb2.role("critic"):
        v2 = sb2.values(ids, mask, start=1)
    torch.testing.assert_close(v1, v2, atol=0, rtol=0)


def test_copy_adapter_makes_identical_reference(tiny_shared):
    sb = tiny_shared
    sb.add_adapter("policy", LoraSettings(r=4))
    sb.add_adapter("reference", LoraSettings(r=4), trainable=False)
    with torch.no_grad():
        for p in sb.adapter_parameters("policy"):
            p.add_(torch.randn_like(p) * 0.1)
    sb.copy_adapter("policy", "reference")
    ids, mask = _batch(sb.tokenizer, ["copy me"])
    with torch.no_grad():
        with sb.role("policy"):
            a, _ = sb.token_logprobs(ids, mask, start=1)
        with sb.role("reference"):
            b, _ = sb.token_logprobs(ids, mask, start=1)
    torch.testing.assert_close(a, b, atol=0, rtol=0)
    assert not any(p.requires_grad for p in sb.adapter_parameters("reference"))


def test_nf4_path_runs_through_real_bitsandbytes(tiny_model_dir):
    import bitsandbytes as bnb

    sb = SharedBase.load(ModelConfig(name=str(tiny_model_dir), quantization="nf4", dtype="float32"))
    linears = [m for m in sb.base.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert linears, "no Linear4bit layers: NF4 was not applied"
    assert linears[0].weight.quant_state.quant_type == "nf4"
    sb.add_adapter("policy", LoraSettings(r=4))
    ids, mask = _batch(sb.tokenizer, ["quantized forward", "and backward"])
    params = sb.trainable_parameters("policy")
    with sb.role("policy", train=True):
        lp, _ = sb.token_logprobs(ids, mask, start=1)
        (-(lp * mask[:, 1:]).sum()).backward()
    assert torch.isfinite(lp).all()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in params)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_nf4_gradients_after_a_rollout_equal_those_before(tiny_model_dir, dtype, monkeypatch):
    """A no-grad eval forward (what a rollout runs) must not change how the 4-bit layers train: bitsandbytes would
    otherwise repack them on CPUs with AVX512-BF16 for an inference kernel without a backward
    (lorarl.model.loading.keep_nf4_trainable). bitsandbytes is told every CPU has AVX512-BF16, so the check bites on
    any machine."""
    import bitsandbytes as bnb
    import bitsandbytes.nn.modules as bnb_modules

    monkeypatch.setattr(bnb_modules, "has_avx512bf16", lambda: True)

    sb = SharedBase.load(ModelConfig(name=str(tiny_model_dir), quantization="nf4", dtype=dtype))
    linears = [m for m in sb.base.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert linears and not any(m.support_avx512bf16_for_cpu for m in linears)
    sb.add_adapter("policy", LoraSettings(r=4))
    ids, mask = _batch(sb.tokenizer, ["quantized forward", "and backward"])
    params = sb.trainable_parameters("policy")

    def grads() -> list[torch.Tensor]:
        for p in params:
            p.grad = None
        with sb.role("policy", train=True):
            lp, _ = sb.token_logprobs(ids, mask, start=1)
            (-(lp * mask[:, 1:]).sum()).backward()
        return [p.grad.clone() for p in params]

    before = grads()
    with torch.no_grad(), sb.role("policy"):  # the rollout's forward: eval mode, no gradients
        sb.token_logprobs(ids, mask, start=1)
    assert not any(getattr(m.weight.quant_state, "packing_format_for_cpu", False) for m in linears)
    after = grads()
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    assert any(float(g.abs().sum()) > 0 for g in after)


# ------------------------------------------------------------------ logits as the model's own forward makes them


def _tiny_of(kind: str, folder, tok_dir):
    """A tiny random model of an architecture that transforms its logits after the output layer."""
    import transformers

    from lorarl.model import load_tokenizer

    tok = load_tokenizer(str(tok_dir))
    common = dict(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.bos_token_id,
    )
    if kind == "gemma2":
        cfg = transformers.Gemma2Config(**common, final_logit_softcapping=2.0, query_pre_attn_scalar=16)
        model = transformers.Gemma2ForCausalLM(cfg)
    elif kind == "cohere":
        cfg = transformers.CohereConfig(**common, logit_scale=0.25)
        model = transformers.CohereForCausalLM(cfg)
    else:
        cfg = transformers.GraniteConfig(**common, logits_scaling=4.0)
        model = transformers.GraniteForCausalLM(cfg)
    torch.manual_seed(0)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(20.0)  # large logits: the transform matters
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("kind", ["gemma2", "cohere", "granite"])
def test_logprobs_apply_the_models_own_logit_transform(kind, tmp_path, default_model_dir):
    folder = _tiny_of(kind, tmp_path / kind, default_model_dir)
    sb = SharedBase.load(ModelConfig(name=str(folder), quantization="none", dtype="float32"))
    ids = torch.randint(5, 500, (2, 9), generator=torch.Generator().manual_seed(0))
    att = torch.ones_like(ids)
    with torch.no_grad(), sb.role("base"):
        want = torch.log_softmax(sb.base(input_ids=ids, attention_mask=att).logits.float() / 0.7, dim=-1)
        lp, _ = sb.token_logprobs(ids, att, 1, temperature=0.7)
    want = want[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
    torch.testing.assert_close(lp, want, rtol=0, atol=1e-5)
    # without the transform the log-probs would be far off (what lorarl computed before)
    with torch.no_grad(), sb.role("base"):
        raw = sb.base.get_output_embeddings()(sb.hidden_states(ids, att)).float() / 0.7
    raw_lp = torch.log_softmax(raw, dim=-1)[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
    assert float((raw_lp - want).abs().max()) > 0.1


def test_a_model_with_an_unknown_logit_transform_is_refused(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from lorarl.model import load_tokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    real_forward = model.forward

    def doubled(*args, **kwargs):  # a model whose forward rescales its logits in a way lorarl does not know
        out = real_forward(*args, **kwargs)
        out.logits = out.logits * 2.0
        return out

    model.forward = doubled
    with pytest.raises(LorarlError, match="model type llama: its forward transforms the logits"):
        SharedBase(model, load_tokenizer(str(tiny_model_dir)), ModelConfig(quantization="none"))
