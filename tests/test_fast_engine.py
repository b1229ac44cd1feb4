"""The fast decode engine (``generation.engine: fast``) against transformers' ``generate`` (the HF engine):
greedy tokens identical (tiny model and the real embedded model), seeded draws identical, sampled tokens drawn
from the model's distribution (a probability-integral-transform test with a negative control), sampler log-probs
equal to scoring's, an adapter updated between rollouts used by the next one, roles, the captured-step bookkeeping
of the CUDA-graph path exercised on CPU, and the fallback for models the engine cannot drive."""

from __future__ import annotations

import math
import shutil

import pytest
import torch
from test_fast_graphs import ReplayGuard  # checks a replay against an independent snapshot, not adapter_key

from lorarl.config import GenerationConfig, LoraSettings, ModelConfig
from lorarl.model import SharedBase
from lorarl.rollout import generate_rollout
from lorarl.rollout.engines import HFEngine
from lorarl.rollout.fast import FastEngine, adapter_key, cache_length, unsupported_reason
from lorarl.rollout.fast import graphs as fast_graphs
from lorarl.rollout.fast.sampling import (
    SamplerSettings,
    exponential_race,
    filtered_scores,
    inverse_cdf,
    mask_finished,
    select_tokens,
)
from lorarl.rollout.fast.state import unique_prompts
from lorarl.rollout.registry import ENGINES, make_engine


# ---- pure functions ------------------------------------------------------------------------------------------
def test_exponential_race_draws_what_torch_multinomial_draws():
    probs = torch.softmax(torch.randn(8, 1000) * 3, dim=-1)
    torch.manual_seed(5)
    want = torch.multinomial(probs, 1).squeeze(1)
    torch.manual_seed(5)
    assert torch.equal(exponential_race(probs), want)


def test_inverse_cdf_draws_in_proportion_and_never_a_zero_probability_token():
    probs = torch.tensor([[0.2, 0.0, 0.8]]).expand(20000, 3)
    torch.manual_seed(0)
    tokens = inverse_cdf(probs)
    counts = torch.bincount(tokens, minlength=3)
    assert counts[1] == 0
    assert abs(counts[0] / 20000 - 0.2) < 4 * (0.2 * 0.8 / 20000) ** 0.5  # within 4 standard errors


@pytest.mark.parametrize("top_k, top_p", [(5, 1.0), (0, 0.7), (20, 0.5), (1, 1.0)])
def test_filters_equal_transformers_warpers(top_k, top_p):
    from transformers import LogitsProcessorList, TopKLogitsWarper, TopPLogitsWarper

    from lorarl.model.sampling import TemperatureScaling

    logits = torch.randn(6, 300) * 2
    procs = [TemperatureScaling(0.7)]
    if top_k:
        procs.append(TopKLogitsWarper(top_k))
    if top_p < 1:
        procs.append(TopPLogitsWarper(top_p))
    want = LogitsProcessorList(procs)(torch.zeros(6, 1, dtype=torch.long), logits.clone())
    got = filtered_scores(logits, SamplerSettings(temperature=0.7, top_k=top_k, top_p=top_p))
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    torch.testing.assert_close(got[~torch.isinf(got)], want[~torch.isinf(want)], rtol=0, atol=0)


def test_select_tokens_greedy_and_recorded_logprobs():
    logits = torch.tensor([[2.0, 1.0, 0.0], [0.0, 0.0, 5.0]])
    tokens, lp = select_tokens(logits, SamplerSettings(greedy=True, temperature=0.5, record=True))
    assert tokens.tolist() == [0, 2]
    torch.testing.assert_close(lp, torch.log_softmax(logits, -1)[[0, 1], [0, 2]])  # greedy: T = 1
    _, lp_t = select_tokens(logits, SamplerSettings(temperature=0.5, record=True))
    assert lp_t is not None and lp_t.shape == (2,)
    assert select_tokens(logits, SamplerSettings())[1] is None


def test_the_planner_sizes_the_cache_the_engine_allocates():
    from lorarl.plan.terms import GRAPH_BUCKET, static_cache_columns
    from lorarl.rollout.fast import engine as fast_engine

    assert GRAPH_BUCKET == fast_engine.GRAPH_BUCKET
    for P, C, bucket in [(100, 128, 64), (128, 128, 64), (7, 3, 1), (1, 1, 64)]:
        assert static_cache_columns(P, C, bucket) == cache_length(P, C, bucket)


def test_small_helpers_match_their_docstring_examples():
    assert mask_finished(torch.tensor([5, 6]), torch.tensor([True, False]), 0).tolist() == [5, 0]
    assert cache_length(100, 128, 128) == 256 and cache_length(100, 128) == 228
    assert unique_prompts([4, 4, 7, 4]) == ([4, 7], [0, 0, 1, 0])


# ---- fixtures -------------------------------------------------------------------------------------------------
def _perturb(sb: SharedBase, name: str, seed: int, scale: float = 0.1) -> None:
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in sb.adapter_parameters(name):
            p.add_(torch.randn_like(p) * scale)


@pytest.fixture()
def policy_shared(tiny_shared):
    tiny_shared.add_adapter("policy", LoraSettings(r=4, dropout=0.5))  # dropout must be off while decoding
    _perturb(tiny_shared, "policy", 3)
    return tiny_shared


@pytest.fixture(scope="module")
def peaked_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model with its (tied) embeddings x8: next-token entropies of 5-9 nats instead of a flat 10.8, so a
    wrong temperature visibly changes the distribution."""
    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("peaked") / "model"
    shutil.copytree(tiny_model_dir, out)
    w = load_file(str(out / "model.safetensors"))
    w["model.embed_tokens.weight"] = w["model.embed_tokens.weight"] * 8.0
    save_file(w, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def _prompts(sb, texts):
    return [sb.tokenizer(t)["input_ids"] for t in texts]


def _chat(tok, question: str) -> list[int]:
    text = tok.apply_chat_template([{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True)
    return tok(text, add_special_tokens=False)["input_ids"]


TEXTS = ["What is 12 + 7?", "A much longer prompt, to get left padding in the batch"]


def _both(sb, prompts, G, gen, role="policy", **kw):
    """HF's and the fast engine's Sampled for the same call (each after torch.manual_seed(11); the fast engine
    draws with torch.multinomial's algorithm)."""
    out = []
    for engine in (HFEngine(), FastEngine(draw="race")):
        torch.manual_seed(11)
        with sb.role(role):
            out.append(engine.sample(sb, prompts, G, gen, **kw))
    return out


# ---- parity with generate -------------------------------------------------------------------------------------
def test_registered_as_fast_and_its_recipe_keys_are_checked():
    from lorarl.config import recipe_from_dict
    from lorarl.errors import LorarlError

    assert ENGINES["fast"] is FastEngine and isinstance(make_engine("fast"), FastEngine)
    g = recipe_from_dict({"generation": {"engine": "fast", "cuda_graphs": False, "eos_check_every": 4}}).generation
    assert (g.engine, g.cuda_graphs, g.eos_check_every) == ("fast", False, 4)
    with pytest.raises(LorarlError, match="generation.eos_check_every"):
        recipe_from_dict({"generation": {"eos_check_every": 0}})
    with pytest.raises(LorarlError, match="generation.engine"):
        recipe_from_dict({"generation": {"engine": "vllm"}})


def test_the_default_engine_decodes_with_generate_on_cpu_and_fast_on_cuda(policy_shared, monkeypatch):
    """``generation.engine: auto`` (the default) resolves by the shared base's device: ``generate_rollout`` on this
    CPU model builds the hf engine; the same config on a CUDA device names the fast one."""
    from lorarl.config import GenerationConfig
    from lorarl.rollout import generate as rollout_generate
    from lorarl.rollout.generate import generate_rollout

    built = []
    monkeypatch.setattr(rollout_generate, "make_engine", lambda name: built.append(name) or make_engine(name))
    gen = GenerationConfig(max_new_tokens=3)
    assert gen.engine == "auto"
    generate_rollout(policy_shared, _prompts(policy_shared, TEXTS), gen, group_size=2, role="policy")
    assert built == ["hf"]
    assert isinstance(make_engine(gen.engine_for("cuda")), FastEngine)
    assert GenerationConfig(engine="hf").engine_for("cuda") == "hf"


@pytest.mark.parametrize("batch_size", [None, 6, 4], ids=["shared-prefix", "plain", "chunks-cut-groups"])
def test_greedy_tokens_identical_to_generate(policy_shared, batch_size):
    sb = policy_shared
    hf, fast = _both(
        sb, _prompts(sb, TEXTS), 3, GenerationConfig(max_new_tokens=10), greedy=True, batch_size=batch_size
    )
    assert hf.completion_ids.shape == fast.completion_ids.shape == (6, 10)
    assert torch.equal(hf.completion_ids, fast.completion_ids)


def test_seeded_sampling_draws_the_same_tokens_as_generate(policy_shared):
    """Same logits (to fp32 rounding) and the same random stream: the exponential race draws generate's tokens."""
    sb = policy_shared
    gen = GenerationConfig(max_new_tokens=12, temperature=0.7)
    hf, fast = _both(sb, _prompts(sb, TEXTS), 3, gen, record_logprobs=True)
    assert torch.equal(hf.completion_ids, fast.completion_ids)
    torch.testing.assert_close(fast.sampler_logprobs, hf.sampler_logprobs, rtol=0, atol=1e-5)
    torch.manual_seed(12)
    with sb.role("policy"):
        other = FastEngine(draw="race").sample(sb, _prompts(sb, TEXTS), 3, gen)
    assert not torch.equal(other.completion_ids, fast.completion_ids)  # the seed matters


@pytest.mark.slow
def test_greedy_identical_on_the_real_embedded_model(default_model_dir):
    """SmolLM2-135M-Instruct, fp32: chat prompts of different lengths, answers that end with EOS at different steps
    (then padding), one that runs to the cap."""
    sb = SharedBase.load(ModelConfig(name=str(default_model_dir), quantization="none", dtype="float32"))
    questions = ["What is 47 + 38? Reply with only the number.", "Name three colors.", "Tell a story."]
    prompts = [_chat(sb.tokenizer, q) for q in questions]
    hf, fast = _both(sb, prompts, 1, GenerationConfig(max_new_tokens=40), role="base", greedy=True)
    assert torch.equal(hf.completion_ids, fast.completion_ids)
    ended = torch.isin(fast.completion_ids, torch.tensor(sb.eos_ids)).any(dim=1)
    assert ended[:2].all() and not ended.all()  # EOS handled mid-batch, and one row hit the cap


# ---- the distribution -----------------------------------------------------------------------------------------
def pit_values(sb, rollout, temperature: float, seed: int = 0) -> torch.Tensor:
    """Randomised probability integral transform of every sampled token: ``u = F(x - 1) + U p(x)`` with ``p`` the
    model's ``softmax(logits / T)`` given the row's history and ``F`` its CDF over token ids. If every token was
    drawn from ``p``, the ``u`` are i.i.d. uniform on [0, 1] (independent across steps too)."""
    gen = torch.Generator().manual_seed(seed)
    ids, att, P = rollout.input_ids, rollout.attention_mask, rollout.prompt_ids.shape[1]
    out = []
    with torch.no_grad(), sb.role("base"):
        for s in range(0, len(rollout), 64):
            pos = (att[s : s + 64].cumsum(-1) - 1).clamp(min=0)
            logits = sb.module(input_ids=ids[s : s + 64], attention_mask=att[s : s + 64], position_ids=pos).logits
            p = torch.softmax(logits[:, P - 1 : -1].float() / temperature, dim=-1)  # [n, T, V]
            x = rollout.completion_ids[s : s + 64]
            cdf_before = p.cumsum(-1).gather(-1, x[..., None]).squeeze(-1) - p.gather(-1, x[..., None]).squeeze(-1)
            u = cdf_before + torch.rand(x.shape, generator=gen) * p.gather(-1, x[..., None]).squeeze(-1)
            out.append(u[rollout.completion_mask[s : s + 64]])
    return torch.cat(out)


def ks_statistic(u: torch.Tensor) -> float:
    """Kolmogorov-Smirnov distance of a sample from the uniform distribution: ``max |F_n(u) - u|``."""
    u, _ = torch.sort(u.double())
    n = len(u)
    i = torch.arange(1, n + 1, dtype=torch.float64)
    return float(torch.maximum(i / n - u, u - (i - 1) / n).max())


@pytest.mark.parametrize("draw", ["race", "inverse_cdf"])
def test_sampled_tokens_follow_the_models_distribution(peaked_dir, draw):
    """256 completions of 6 tokens at T = 0.5 (about 1500 draws): their PIT values are uniform (KS distance below
    the 0.1% critical value 1.95 / sqrt(n)); scored at T = 1, which the sampler did not use, they are not."""
    sb = SharedBase.load(ModelConfig(name=str(peaked_dir), quantization="none", dtype="float32"))
    gen = GenerationConfig(max_new_tokens=6, temperature=0.5)
    torch.manual_seed(0)
    engine = FastEngine(draw=draw)
    r = generate_rollout(sb, _prompts(sb, TEXTS), gen, group_size=128, role="base", engine=engine)
    u = pit_values(sb, r, temperature=0.5)
    critical = 1.95 / math.sqrt(len(u))
    assert len(u) >= 1200
    assert ks_statistic(u) < critical
    assert ks_statistic(pit_values(sb, r, temperature=1.0)) > 3 * critical  # the test sees a wrong distribution


def test_sampler_logprobs_equal_what_scoring_computes(policy_shared):
    """The parity health check: the log-prob the sampler drew each token with equals the trainer's recomputation."""
    sb = policy_shared
    gen = GenerationConfig(max_new_tokens=12, temperature=0.7, engine="fast")
    torch.manual_seed(0)
    r = generate_rollout(sb, _prompts(sb, TEXTS), gen, group_size=4, record_old=True, record_sampler=True)
    m = r.completion_mask
    assert int(m.sum()) >= 40
    torch.testing.assert_close(r.sampler_logprobs[m], r.old_logprobs[m], rtol=0, atol=1e-5)
    assert float(r.sampler_logprobs[~m].abs().sum()) == 0.0


# ---- adapters and roles ---------------------------------------------------------------------------------------
def test_an_adapter_updated_between_rollouts_is_the_one_used(policy_shared):
    """In-place updates (what AdamW does) and a reload of the adapter's weights both reach the next rollout."""
    sb = policy_shared
    prompts, gen = _prompts(sb, TEXTS), GenerationConfig(max_new_tokens=8, engine="fast")
    first = generate_rollout(sb, prompts, gen, group_size=2, greedy=True)
    _perturb(sb, "policy", 7, scale=0.5)  # in place
    second = generate_rollout(sb, prompts, gen, group_size=2, greedy=True)
    want = generate_rollout(sb, prompts, GenerationConfig(max_new_tokens=8, engine="hf"), group_size=2, greedy=True)
    assert not torch.equal(first.completion_ids, second.completion_ids)
    assert torch.equal(second.completion_ids, want.completion_ids)
    from peft import get_peft_model_state_dict

    saved = {k: v.clone() for k, v in get_peft_model_state_dict(sb.peft, adapter_name="policy").items()}
    _perturb(sb, "policy", 8, scale=0.5)
    sb.load_adapter_weights("policy", saved)  # back to the weights of `second`
    third = generate_rollout(sb, prompts, gen, group_size=2, greedy=True)
    assert torch.equal(third.completion_ids, second.completion_ids)


def test_roles_decode_with_their_own_adapter(policy_shared):
    sb = policy_shared
    sb.add_adapter("critic", LoraSettings(r=4))
    _perturb(sb, "critic", 9, scale=0.5)
    prompts, gen = _prompts(sb, TEXTS), GenerationConfig(max_new_tokens=8)
    outs = {}
    for role in ("policy", "base", "reference", "critic"):
        hf, fast = _both(sb, prompts, 2, gen, role=role, greedy=True)
        assert torch.equal(hf.completion_ids, fast.completion_ids), role
        outs[role] = fast.completion_ids
    assert torch.equal(outs["base"], outs["reference"])  # no reference adapter: adapters disabled
    assert not torch.equal(outs["policy"], outs["base"]) and not torch.equal(outs["critic"], outs["policy"])
    assert sb.peft.active_adapter == "policy" and not sb.module.training  # restored


def test_adapter_key_tracks_what_a_captured_step_bakes_in(policy_shared):
    sb = policy_shared
    with sb.role("policy"):
        k_policy = adapter_key(sb)
        _perturb(sb, "policy", 4)  # in place: a replay reads the new values, no new capture needed
        assert adapter_key(sb) == k_policy
    with sb.role("base"):
        assert adapter_key(sb) != k_policy
    layer = fast_graphs.lora_layers(sb.module)[0]
    with sb.role("policy"):
        old = layer.lora_A["policy"].weight
        layer.lora_A["policy"].weight = torch.nn.Parameter(old.detach().clone())  # a new tensor: new address
        assert adapter_key(sb) != k_policy
        layer.lora_A["policy"].weight = old
        assert adapter_key(sb) == k_policy
        layer.scaling["policy"] *= 2
        assert adapter_key(sb) != k_policy


def test_captured_step_bookkeeping_on_cpu(policy_shared, monkeypatch):
    """The CUDA-graph path's reuse logic, run on CPU: one state per shape kept and reloaded in place (results equal
    a fresh state's), one capture per (adapter state, sampler), a new capture after a role switch or a replaced
    weight tensor, and the same tokens as the eager path."""
    sb = policy_shared
    monkeypatch.setattr(FastEngine, "_graphs_on", lambda self, shared, generation: True)
    monkeypatch.setattr(fast_graphs, "CapturedStep", ReplayGuard)
    monkeypatch.setattr(ReplayGuard, "shared", sb)
    ReplayGuard.captures = 0
    fast_graphs.release(sb)
    gen = GenerationConfig(max_new_tokens=8)
    long_prompts, short_prompts = _prompts(sb, TEXTS), _prompts(sb, ["Hi", "Short one"])
    eager = {}
    for name, prompts in (("long", long_prompts), ("short", short_prompts)):
        with sb.role("policy"):
            eager[name] = FastEngine(cuda_graphs=False).sample(sb, prompts, 2, gen, greedy=True).completion_ids
    for _ in range(2):
        for name, prompts in (("long", long_prompts), ("short", short_prompts)):
            with sb.role("policy"):
                got = FastEngine().sample(sb, prompts, 2, gen, greedy=True).completion_ids
            assert torch.equal(got, eager[name])  # a reused, reloaded state decodes like a fresh one
    pool = fast_graphs.pool_for(sb)
    assert len(pool.states) == 1 and ReplayGuard.captures == 1  # both prompt lengths share one bucketed cache
    with sb.role("base"):
        FastEngine().sample(sb, long_prompts, 2, gen, greedy=True)
    with sb.role("policy"):
        FastEngine().sample(sb, long_prompts, 2, gen)  # sampling: another sampler, another capture
    assert ReplayGuard.captures == 3
    fast_graphs.release(sb)
    assert len(fast_graphs.pool_for(sb).states) == 0


@pytest.mark.parametrize("keep,pool_keep,kept", [(False, True, False), ("auto", False, False), ("auto", True, True)])
def test_keep_cache_false_frees_the_decode_state_after_each_rollout(policy_shared, monkeypatch, keep, pool_keep, kept):
    """``generation.keep_cache`` false (or ``auto`` resolved false for this base by the run loop): after each
    rollout the pool holds no decode state and no captured step, so the next rollout captures again; the tokens
    are the eager path's either way and the capture counters outlive the clear."""
    sb = policy_shared
    gen = GenerationConfig(max_new_tokens=8, keep_cache=keep)
    prompts = _prompts(sb, TEXTS)
    with sb.role("policy"):
        eager = FastEngine(cuda_graphs=False).sample(sb, prompts, 2, gen, greedy=True).completion_ids
    monkeypatch.setattr(FastEngine, "_graphs_on", lambda self, shared, generation: True)
    monkeypatch.setattr(fast_graphs, "CapturedStep", ReplayGuard)
    monkeypatch.setattr(ReplayGuard, "shared", sb)
    ReplayGuard.captures = 0
    fast_graphs.release(sb)
    fast_graphs.pool_for(sb).keep = pool_keep
    with sb.role("policy"):
        for _ in range(2):
            got = FastEngine().sample(sb, prompts, 2, gen, greedy=True).completion_ids
            assert torch.equal(got, eager)
            pool = fast_graphs.pool_for(sb)
            assert (len(pool.states), len(pool.graphs)) == ((1, 1) if kept else (0, 0))
    assert ReplayGuard.captures == (1 if kept else 2) == pool.captures
    fast_graphs.release(sb)


def test_eos_checked_every_k_steps_pads_the_extra_columns(default_model_dir):
    """Reading "all rows ended?" every 4 steps: up to 3 more steps run, into padding; the rollout is unchanged."""
    sb = SharedBase.load(ModelConfig(name=str(default_model_dir), quantization="none", dtype="float32"))
    prompts = [_chat(sb.tokenizer, "What is 2 + 2? Answer with one number.")]
    gen = GenerationConfig(max_new_tokens=30)
    with sb.role("base"):
        every = FastEngine(eos_check_every=1).sample(sb, prompts, 1, gen, greedy=True).completion_ids
        every4 = FastEngine(eos_check_every=4)
        ids4 = every4.sample(sb, prompts, 1, gen, greedy=True).completion_ids
    w = every.shape[1]
    assert w < 30 and ids4.shape[1] == min(30, -(-w // 4) * 4) and every4.steps_run == ids4.shape[1]
    assert torch.equal(ids4[:, :w], every) and bool((ids4[:, w:] == sb.pad_id).all())


# ---- fallback -------------------------------------------------------------------------------------------------
def test_a_model_it_cannot_drive_falls_back_to_generate(tmp_path, tiny_model_dir):
    """Sliding-window attention (a Mistral-shaped tiny model): the fast engine says why and decodes with hf."""
    from transformers import MistralConfig, MistralForCausalLM

    from lorarl.model import load_tokenizer

    tok = load_tokenizer(str(tiny_model_dir))
    cfg = MistralConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=16,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    MistralForCausalLM(cfg).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    sb = SharedBase.load(ModelConfig(name=str(tmp_path), quantization="none", dtype="float32"))
    assert "SlidingWindow" in unsupported_reason(sb)
    with pytest.warns(UserWarning, match="using hf") as caught:
        hf, fast = _both(sb, _prompts(sb, TEXTS), 2, GenerationConfig(max_new_tokens=6), role="base", greedy=True)
    assert torch.equal(hf.completion_ids, fast.completion_ids)
    assert [w.filename for w in caught if "using hf" in str(w.message)] == [__file__]  # the line calling sample


def test_recording_with_top_p_is_refused_like_generate(policy_shared):
    with policy_shared.role("policy"), pytest.raises(ValueError, match="top-p"):
        FastEngine().sample(
            policy_shared, [[5, 6]], 1, GenerationConfig(max_new_tokens=2, top_p=0.9), record_logprobs=True
        )


# ---- lorarl bench rollout -------------------------------------------------------------------------------------
def test_weight_bytes_per_step_counts_what_a_step_reads():
    """Every weight once (a tied lm_head reads the embedding table); an untied input embedding table is left out
    (a step reads B rows of it)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from lorarl.bench.rollout import weight_bytes_per_step
    from lorarl.bench.synthetic import IdTokenizer

    for tied in (True, False):
        cfg = LlamaConfig(
            vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, tie_word_embeddings=tied, pad_token_id=0, eos_token_id=1,
        )  # fmt: skip
        model = LlamaForCausalLM(cfg)
        sb = SharedBase(model, IdTokenizer(300), ModelConfig(quantization="none", dtype="float32"))
        every = {t.data_ptr(): t.numel() * 4 for t in list(model.parameters()) + list(model.buffers())}
        embed = 300 * 32 * 4
        assert weight_bytes_per_step(sb) == sum(every.values()) - (0 if tied else embed)


def test_rollout_bench_runs_the_gpu_rows_code_path_on_cpu(tmp_path, capsys):
    """A random-init shape built like the GPU rows (here tiny, unquantized, on CPU): both engines, the bound, the
    ratios, JSON as the last stdout line and in result.json."""
    import json

    from lorarl.bench.rollout import main

    argv = ["--device", "cpu", "--shapes", "tiny", "--quantization", "none", "--batches", "1,2", "--profile"]
    assert main(argv + ["--new-tokens", "4", "--repeats", "1", "--out", str(tmp_path)]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result == json.loads((tmp_path / "result.json").read_text())
    assert [r["batch"] for r in result["rows"]] == [1, 2] and result["bandwidth_bytes_per_s"] > 0
    for row in result["rows"]:
        assert row["hf"]["steps"] == row["fast"]["steps"] == 4  # a random model never says EOS in 4 tokens
        assert row["bound_ms"] == pytest.approx(
            1000 * row["weight_bytes_per_step"] / result["bandwidth_bytes_per_s"], abs=1e-6
        )
        for engine in ("hf", "fast"):
            assert row[engine]["tokens_per_s"] > 0 and len(row[engine]["wall_s"]) == 1
        assert row["fast"]["cuda_graphs"] is False
        for engine in ("hf", "fast"):  # eager on CPU: both run the model's own ~100 ops per step of a 2-layer model
            assert 50 < row["profile"][engine]["aten_ops_per_step"] < 1000
            assert row["profile"][engine]["top_9_tokens"][0]["calls"] > 0
