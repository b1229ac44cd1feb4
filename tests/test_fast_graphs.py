"""The fast engine's CUDA-graph guard, exercised on CPU (issue 22).

A captured decode step replays the kernels it recorded with everything the Python code decided at capture time.
:func:`~lorarl.rollout.fast.graphs.adapter_key` must change whenever any of that changes, or a replay decodes with
a stale adapter. These tests check it against an independent, brute-force snapshot (:func:`baked_state`: every
module's plain attributes and mode, every parameter's and buffer's storage, autocast and the default dtype), not
against itself; they check the decode states kept side by side (training + held-out evaluation), and that a
failed capture becomes a run metric, a health warning and a ``lorarl doctor`` line."""

from __future__ import annotations

import contextlib

import pytest
import torch

from lorarl.config import GenerationConfig, LoraSettings, recipe_from_dict
from lorarl.model import SharedBase
from lorarl.rollout.fast import FastEngine, adapter_key
from lorarl.rollout.fast import graphs as fast_graphs

PLAIN = (type(None), bool, int, float, str, torch.dtype, torch.device)


def _freeze(value):
    """A hashable copy of a plain value (numbers, strings, dtypes and containers of them); TypeError otherwise."""
    if isinstance(value, PLAIN):
        return value
    if isinstance(value, dict):
        return tuple(sorted((str(k), _freeze(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    if isinstance(value, (set, frozenset)):
        return tuple(sorted(_freeze(v) for v in value))
    raise TypeError(type(value))


def baked_state(shared: SharedBase) -> tuple:
    """Everything a captured step could have read from Python, by brute force: per module (by name) its train mode,
    its plain attributes (PEFT's active adapter, disabled flag, ranks, scalings, dropout probabilities, ...) and the
    storage / shape / strides / dtype of its parameters and buffers; then autocast and the default dtype."""
    modules = []
    for name, m in shared.module.named_modules():
        attrs = []
        for key, value in sorted(vars(m).items()):
            if key in ("_parameters", "_buffers", "_modules") or "hook" in key:
                continue
            with contextlib.suppress(TypeError):
                attrs.append((key, _freeze(value)))
        tensors = [
            (key, t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)
            for key, t in [*m._parameters.items(), *m._buffers.items()]
            if t is not None
        ]
        modules.append((name, type(m).__name__, tuple(attrs), tuple(tensors)))
    autocast = tuple((d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cuda", "cpu"))
    return tuple(modules), autocast, torch.get_default_dtype()


class ReplayGuard:
    """Stands in for a CUDA graph on CPU: it runs the step eagerly, but first checks that nothing a real graph would
    have baked in differs from capture time (:func:`baked_state`, independent of ``adapter_key``): a replay in a
    changed state means the pool reused a capture that a real GPU would have replayed stale. Counts captures."""

    captures = 0
    shared: SharedBase | None = None

    def __init__(self, step, rewind, pool):
        self.step, self.baked = step, baked_state(self.shared)
        ReplayGuard.captures += 1

    def __call__(self):
        assert baked_state(self.shared) == self.baked, "replayed a captured step in a state it did not capture"
        self.step()


@pytest.fixture()
def policy_shared(tiny_shared):
    tiny_shared.add_adapter("policy", LoraSettings(r=4, dropout=0.5))
    torch.manual_seed(3)
    with torch.no_grad():
        for p in tiny_shared.adapter_parameters("policy"):
            p.add_(torch.randn_like(p) * 0.1)
    return tiny_shared


@pytest.fixture()
def guarded(policy_shared, monkeypatch):
    """The CUDA-graph path forced on CPU, each capture a :class:`ReplayGuard`."""
    monkeypatch.setattr(FastEngine, "_graphs_on", lambda self, shared, generation: True)
    monkeypatch.setattr(fast_graphs, "CapturedStep", ReplayGuard)
    monkeypatch.setattr(ReplayGuard, "shared", policy_shared)
    ReplayGuard.captures = 0
    fast_graphs.release(policy_shared)
    yield policy_shared
    fast_graphs.release(policy_shared)


def _layer(sb):
    return fast_graphs.lora_layers(sb.module)[0]


# Each change a capture bakes in, as a context manager that applies it inside the policy role and undoes it.
@contextlib.contextmanager
def other_rank(sb):
    layer = _layer(sb)
    a, b, r = layer.lora_A["policy"], layer.lora_B["policy"], layer.r["policy"]
    layer.lora_A["policy"] = torch.nn.Linear(a.in_features, 2, bias=False)
    layer.lora_B["policy"] = torch.nn.Linear(2, b.out_features, bias=False)
    layer.r["policy"] = 2
    try:
        yield
    finally:
        layer.lora_A["policy"], layer.lora_B["policy"], layer.r["policy"] = a, b, r


@contextlib.contextmanager
def one_lora_dropout_in_train_mode(sb):
    d = _layer(sb).lora_dropout["policy"]
    d.train()
    try:
        yield
    finally:
        d.eval()


@contextlib.contextmanager
def one_base_module_in_train_mode(sb):
    m = sb.decoder().layers[0].mlp
    m.train()
    try:
        yield
    finally:
        m.eval()


@contextlib.contextmanager
def lora_dropout_probability(sb):
    d = _layer(sb).lora_dropout["policy"]
    p = d.p
    d.p = 0.25
    try:
        yield
    finally:
        d.p = p


@contextlib.contextmanager
def scaling(sb):
    layer = _layer(sb)
    layer.scaling["policy"] *= 2
    try:
        yield
    finally:
        layer.scaling["policy"] /= 2


@contextlib.contextmanager
def replaced_weight(sb):
    layer = _layer(sb)
    old = layer.lora_A["policy"].weight
    layer.lora_A["policy"].weight = torch.nn.Parameter(old.detach().clone())
    try:
        yield
    finally:
        layer.lora_A["policy"].weight = old


@contextlib.contextmanager
def autocast_bf16(sb):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        yield


@contextlib.contextmanager
def one_layer_disabled(sb):
    layer = _layer(sb)
    layer._disable_adapters = True
    try:
        yield
    finally:
        layer._disable_adapters = False


CHANGES = [
    other_rank,
    one_lora_dropout_in_train_mode,
    one_base_module_in_train_mode,
    lora_dropout_probability,
    scaling,
    replaced_weight,
    autocast_bf16,
    one_layer_disabled,
]


@pytest.mark.parametrize("change", CHANGES, ids=[c.__name__ for c in CHANGES])
def test_the_key_changes_with_everything_a_capture_bakes_in(policy_shared, change):
    """Each change moves both the independent snapshot and the key; undone, the key is the same again."""
    sb = policy_shared
    with sb.role("policy"):
        key, baked = adapter_key(sb), baked_state(sb)
        with change(sb):
            assert baked_state(sb) != baked  # the snapshot sees it (the guard below relies on that)
            assert adapter_key(sb) != key
        assert adapter_key(sb) == key and baked_state(sb) == baked


def test_the_key_ignores_in_place_updates_and_tells_roles_apart(policy_shared):
    sb = policy_shared
    sb.add_adapter("critic", LoraSettings(r=4))
    with sb.role("policy"):
        key = adapter_key(sb)
        with torch.no_grad():
            for p in sb.adapter_parameters("policy"):
                p.mul_(1.5)  # what an optimizer step does: a replay reads the new values
        assert adapter_key(sb) == key
    keys = {}
    for role in ("policy", "critic", "base"):
        with sb.role(role):
            keys[role] = adapter_key(sb)
    assert len(set(keys.values())) == 3


# autocast is left out here: lorarl never decodes under autocast (the static cache takes one dtype; under CPU autocast
# the keys come out fp32 and the values bf16); the key test above covers it
ENGINE_CHANGES = [c for c in CHANGES if c is not autocast_bf16]


@pytest.mark.parametrize("change", ENGINE_CHANGES, ids=[c.__name__ for c in ENGINE_CHANGES])
def test_the_engine_recaptures_after_each_change(guarded, change):
    """Decode, change one thing, decode again: a new capture (the guard would fail a stale replay), then back."""
    sb = guarded
    gen, prompts = GenerationConfig(max_new_tokens=4), [sb.tokenizer("What is 12 + 7?")["input_ids"]]
    with sb.role("policy"):
        FastEngine().sample(sb, prompts, 2, gen, greedy=True)
        assert ReplayGuard.captures == 1
        with change(sb):
            FastEngine().sample(sb, prompts, 2, gen, greedy=True)
            assert ReplayGuard.captures == 2
        FastEngine().sample(sb, prompts, 2, gen, greedy=True)  # back to the first key: its capture is reused
        assert ReplayGuard.captures == 2


def test_the_guard_fails_a_key_that_leaves_state_out(guarded, monkeypatch):
    """Negative control: with the earlier key (train mode of the root module only, no dropout modules, no
    autocast), a LoRA dropout module switched to train mode replays the old capture, and the guard says so."""

    def old_key(shared):
        layers = []
        for m in fast_graphs.lora_layers(shared.module):
            active = tuple(a for a in m.active_adapters if a in m.lora_A)
            weights = tuple((m.lora_A[a].weight.data_ptr(), m.lora_B[a].weight.data_ptr()) for a in active)
            layers.append((active, bool(m.disable_adapters), tuple(float(m.scaling[a]) for a in active), weights))
        return (bool(shared.module.training), tuple(layers))

    monkeypatch.setattr(fast_graphs, "adapter_key", old_key)
    sb = guarded
    gen, prompts = GenerationConfig(max_new_tokens=4), [sb.tokenizer("What is 12 + 7?")["input_ids"]]
    with sb.role("policy"):
        FastEngine().sample(sb, prompts, 2, gen, greedy=True)
        with one_lora_dropout_in_train_mode(sb), pytest.raises(AssertionError, match="did not capture"):
            FastEngine().sample(sb, prompts, 2, gen, greedy=True)


def test_an_evaluation_between_training_rollouts_costs_no_new_capture(guarded):
    """Training rollouts (4 prompts x 2, sampled) around a held-out evaluation (3 prompts, greedy): the training
    state and its capture survive the evaluation; both states are kept."""
    sb = guarded
    gen = GenerationConfig(max_new_tokens=4)
    train_prompts = [sb.tokenizer(f"What is {i} + 7?")["input_ids"] for i in range(4)]
    eval_prompts = [sb.tokenizer(f"What is {i} + 9?")["input_ids"] for i in range(3)]
    with sb.role("policy"):
        FastEngine().sample(sb, train_prompts, 2, gen)
        FastEngine().sample(sb, eval_prompts, 1, gen, greedy=True)
        assert ReplayGuard.captures == 2
        for _ in range(2):
            FastEngine().sample(sb, train_prompts, 2, gen)
            FastEngine().sample(sb, eval_prompts, 1, gen, greedy=True)
    assert ReplayGuard.captures == 2
    assert len(fast_graphs.pool_for(sb).states) == 2
    counts = fast_graphs.engine_metrics(sb)
    assert counts == {
        "rollout/graph_captures": 2,
        "rollout/graph_capture_failures": 0,
        "rollout/eager_fallbacks": 0,
    }


def test_engine_metrics_are_empty_without_cuda_graphs(policy_shared):
    fast_graphs.release(policy_shared)
    with policy_shared.role("policy"):
        FastEngine().sample(policy_shared, [[5, 6, 7]], 2, GenerationConfig(max_new_tokens=3), greedy=True)
    assert fast_graphs.engine_metrics(policy_shared) == {}  # CPU: eager by design, not a fallback


def test_a_failed_capture_is_a_run_metric_a_health_warning_and_a_doctor_line(tiny_model_dir, tmp_path, monkeypatch):
    """Capture forced to fail in a 2-step GRPO run (fast engine, CUDA graphs forced on CPU): the counts are in
    metrics.jsonl, the health checks warn once, and ``lorarl doctor`` reports it."""
    from lorarl.algos.loop import train
    from lorarl.doctor import diagnose, format_report
    from lorarl.runs import read_metrics

    def capture_fails(step, rewind, pool):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(FastEngine, "_graphs_on", lambda self, shared, generation: True)
    monkeypatch.setattr(fast_graphs, "CapturedStep", capture_fails)
    reward_file = tmp_path / "r.py"
    reward_file.write_text(
        "def first_odd(prompts, completions, completion_ids, **kw):\n"
        "    return [float(ids[0] % 2) if ids else 0.0 for ids in completion_ids]\n"
    )
    recipe = recipe_from_dict(
        {
            "model": {"name": str(tiny_model_dir), "quantization": "none", "dtype": "float32"},
            "lora": {"r": 4, "alpha": 8},
            "data": {"train_size": 16, "eval_size": 2},
            "reward": {"functions": [{"name": f"{reward_file}:first_odd"}]},
            "generation": {"max_new_tokens": 3, "engine": "fast"},
            "train": {"steps": 2, "prompts_per_step": 2, "micro_batch_size": 8},
            "grpo": {"group_size": 2},
            "eval": {"n": 2, "batch_size": 2},
        }
    )
    with pytest.warns(UserWarning, match="CUDA graph capture failed, decoding eagerly"):
        train(recipe, tmp_path / "run")
    rows = read_metrics(tmp_path / "run")
    failures = [r["rollout/graph_capture_failures"] for r in rows]
    # one failed capture per decode-state shape: 1, or 2 when step 2's prompts need the next 64-column bucket
    assert failures[0] == 1 and failures[1] in (1, 2)
    assert [r["rollout/eager_fallbacks"] for r in rows] == [1, 2]  # one decode batch per step, both eager
    assert rows[0]["rollout/graph_captures"] == 0
    assert "operation not permitted" in rows[0]["rollout/graph_capture_error"]
    assert "CUDA graphs: 1 capture(s) failed" in rows[0]["health/warning"]
    assert "health/warning" not in rows[1] or "CUDA graphs" not in rows[1]["health/warning"]  # said once
    report = diagnose(tmp_path / "run")
    assert (report["graph_capture_failures"], report["eager_fallbacks"]) == (failures[1], 2)
    text = format_report(report)
    assert f"CUDA graphs      0 captured, {failures[1]} failed, 2 decode batches eager" in text
    assert any(
        f.startswith(f"the fast engine decoded eagerly: {failures[1]} CUDA graph capture(s) failed")
        for f in report["findings"]
    )


class PlainCapture:
    """A capture stand-in that keeps what a real :class:`CapturedStep` keeps: the step and rewind closures."""

    def __init__(self, step, rewind, pool):
        self.step, self.rewind = step, rewind

    def __call__(self):
        self.step()


def test_a_dropped_shared_base_frees_its_kept_decode_states(tiny_model_dir, monkeypatch):
    """The kept decode states and captures die with their shared base. They were kept in a weak-keyed table whose
    values (the states) referred back to the key, so a base that had decoded with CUDA graphs was never freed: on an
    H200 the planner's validation found each earlier algorithm's whole NF4 base (5.8 GiB for Llama-3.1-8B) still
    allocated, and a pipeline's stages run in one process."""
    import gc
    import weakref

    from lorarl.config import ModelConfig

    monkeypatch.setattr(FastEngine, "_graphs_on", lambda self, shared, generation: True)
    monkeypatch.setattr(fast_graphs, "CapturedStep", PlainCapture)
    sb = SharedBase.load(ModelConfig(name=str(tiny_model_dir), quantization="none", dtype="float32"))
    sb.add_adapter("policy", LoraSettings(r=4))
    with sb.role("policy"):
        FastEngine().sample(sb, [[5, 6, 7], [8, 9]], 2, GenerationConfig(max_new_tokens=3))
    pool = fast_graphs.pool_for(sb)
    assert len(pool.states) == 1 and len(pool.graphs) == 1
    model, pool_ref = weakref.ref(sb.module), weakref.ref(pool)
    state_cache = weakref.ref(next(iter(pool.states.values())).cache)
    del sb, pool
    gc.collect()
    assert model() is None, "the shared base's model outlived it"
    assert pool_ref() is None and state_cache() is None, "its decode states outlived it"
