"""lorarl.chat: the catalog (and what it refuses), one batched generate for all panes, streaming, stop, rewards,
votes, and the app's API through gradio_client (tiny model, perturbed adapter, greedy so answers are deterministic)."""

from __future__ import annotations

import ast
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
import yaml

from lorarl.chat import (
    Catalog,
    ChatEngine,
    ChatSession,
    Entry,
    build_app,
    default_base_model,
    preference_record,
)
from lorarl.config import GenerationConfig, LoraSettings, ModelConfig
from lorarl.errors import LorarlError
from lorarl.model import SharedBase

REPO = Path(__file__).resolve().parents[1]
USER = [{"role": "user", "content": "What is 2 + 2?"}]
GREEDY = GenerationConfig(temperature=0.0, top_p=1.0, max_new_tokens=12)  # seed 0: generate's default


def load_tiny(model_dir: Path) -> SharedBase:
    return SharedBase.load(
        ModelConfig(name=str(model_dir), quantization="none", dtype="float32", gradient_checkpointing=False)
    )


def make_runs(root: Path, model_dir: Path) -> Path:
    """A runs directory: run ``demo`` (final adapter, a complete step, an incomplete step, rule rewards), run
    ``rm`` (a reward adapter with its head), run ``other`` (another base: skipped), a merged export ``merged`` (the
    base's own weights), and ``evil``, a symlink to a run outside the runs directory."""
    runs = root / "runs"
    runs.mkdir(parents=True)
    sb = load_tiny(model_dir)
    sb.add_adapter("policy", LoraSettings(r=4, alpha=8))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in sb.adapter_parameters("policy"):
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)  # strongly perturbed: its answers differ from the base
    sb.add_adapter("reward", LoraSettings(r=4, alpha=8))  # with a score head
    recipe = {"algo": "grpo", "model": {"name": str(model_dir)}, "rewards": [{"name": "numeric_match", "weight": 1.0}]}

    demo = runs / "demo"
    sb.save_adapter("policy", demo / "policy")
    for step, complete in ((2, True), (4, False)):
        cp = demo / "checkpoints" / f"step-{step:06d}"
        sb.save_adapter("policy", cp / "policy")
        if complete:
            (cp / "COMPLETE").write_text("")
    (demo / "recipe.yaml").write_text(yaml.safe_dump(recipe))

    rm = runs / "rm"
    sb.save_adapter("reward", rm / "reward")
    (rm / "recipe.yaml").write_text(yaml.safe_dump({**recipe, "algo": "reward_model"}))

    other = runs / "other"
    sb.save_adapter("policy", other / "policy")
    (other / "recipe.yaml").write_text(yaml.safe_dump({**recipe, "model": {"name": "someone/another-model"}}))

    shutil.copytree(model_dir, runs / "merged")

    outside = root / "outside-run"
    sb.save_adapter("policy", outside / "policy")
    os.symlink(outside, runs / "evil")
    return runs


@pytest.fixture(scope="module")
def runs_dir(tmp_path_factory, tiny_model_dir) -> Path:
    return make_runs(tmp_path_factory.mktemp("chat"), tiny_model_dir)


@pytest.fixture(scope="module")
def engine(runs_dir, tiny_model_dir) -> ChatEngine:
    return ChatEngine(load_tiny(tiny_model_dir), Catalog(runs_dir, str(tiny_model_dir)))


# ---- catalog ------------------------------------------------------------------------------------------------------


def test_catalog_lists_base_runs_steps_and_exports(runs_dir, tiny_model_dir):
    cat = Catalog(runs_dir, str(tiny_model_dir))
    ids = [i for _, i in cat.choices()]
    assert ids == ["base", "demo/policy", "demo/step-000002", "export:merged"]  # no incomplete step, no `other`
    assert any("other" in s and "someone/another-model" in s for s in cat.skipped)
    assert any("evil" in s and "outside" in s for s in cat.skipped)
    assert sorted(cat.scorers) == ["rm:rm", "rules:demo"]
    assert cat.get("demo/policy").folder == runs_dir / "demo" / "policy"
    # without --model, chat loads the base the runs were trained on (ignoring bases that are not available here)
    assert default_base_model(runs_dir) == str(tiny_model_dir)
    assert default_base_model(runs_dir / "missing") == "smollm2-135m"


@pytest.mark.parametrize(
    "bad", ["../outside-run/policy", "/etc", "evil/policy", "demo/step-000004", "demo/checkpoints", "", "export:../x"]
)
def test_catalog_refuses_anything_it_did_not_find(runs_dir, tiny_model_dir, bad):
    cat = Catalog(runs_dir, str(tiny_model_dir))
    with pytest.raises(LorarlError):
        cat.get(bad)


def test_catalog_refuses_a_folder_that_resolves_outside(runs_dir, tiny_model_dir):
    cat = Catalog(runs_dir, str(tiny_model_dir))
    sneaky = Entry("demo/policy", "adapter", "x", runs_dir / "evil" / "policy", "demo")
    with pytest.raises(LorarlError, match="outside"):
        cat.folder(sneaky)


# ---- generation ---------------------------------------------------------------------------------------------------


def _reference(shared: SharedBase, adapter: str | None, max_new: int) -> list[int]:
    """The same prompt answered alone, by switching the active role (no per-row adapter batch)."""
    from lorarl.chat import render_prompt

    ids = shared.tokenizer(render_prompt(shared.tokenizer, USER), add_special_tokens=False, return_tensors="pt")
    with shared.role(adapter or "base"):
        out = shared.generate(ids["input_ids"], ids["attention_mask"], max_new_tokens=max_new, do_sample=False)
    gen = out[0, ids["input_ids"].shape[1] :].tolist()
    eos = shared.tokenizer.eos_token_id
    return gen[: gen.index(eos)] if eos in gen else gen


def test_one_batch_answers_every_pane_like_separate_runs(engine, monkeypatch):
    groups = []
    real = ChatEngine._generate_group

    def spy(self, model, tok, names, rows, *args):
        groups.append((list(rows), names))
        return real(self, model, tok, names, rows, *args)

    monkeypatch.setattr(ChatEngine, "_generate_group", spy)
    updates: dict[int, list[str]] = {}
    panes = ["base", "demo/policy", "export:merged", "demo/step-000002"]
    assert "export:merged" not in engine.loaded()["exports"]  # merged exports load only when chosen
    answers = engine.generate(panes, [USER] * 4, GREEDY, on_update=lambda i, t: updates.setdefault(i, []).append(t))
    # base and both adapters in ONE generate call with per-row adapter names; the export in its own batch
    assert [g[0] for g in groups] == [[0, 1, 3], [2]]
    names = groups[0][1]
    assert names[0] == "__base__" and names[1] != names[2] and all(n.isidentifier() for n in names)
    assert engine.loaded()["exports"] == ["export:merged"]
    base, tuned, export, step = answers
    assert base.token_ids == _reference(engine.shared, None, 12)
    assert tuned.token_ids == _reference(engine.shared, names[1], 12)
    assert export.token_ids == base.token_ids  # the export holds the base's weights
    assert step.token_ids == tuned.token_ids  # the step checkpoint holds the same adapter weights
    assert tuned.text != base.text
    # streamed: each pane's text grew step by step to its final answer
    for i, a in enumerate(answers):
        assert updates[i][-1] == a.text
        assert len(updates[i]) >= 2
    # a second request reuses the loaded adapters (loaded once)
    n_adapters = len(engine.shared.adapters)
    engine.generate(["demo/policy"], [USER], GREEDY)
    assert len(engine.shared.adapters) == n_adapters


def test_seed_makes_sampling_reproducible(engine):
    s = GenerationConfig(temperature=1.0, top_p=1.0, max_new_tokens=4)
    a = [x.token_ids for x in engine.generate(["base", "demo/policy"], [USER] * 2, s, seed=3)]
    b = [x.token_ids for x in engine.generate(["base", "demo/policy"], [USER] * 2, s, seed=3)]
    assert a == b


def test_stop_flag_ends_generation_early(engine):
    stop = threading.Event()
    answers = engine.generate(
        ["base", "demo/policy"],
        [USER] * 2,
        GenerationConfig(temperature=0.0, top_p=1.0, max_new_tokens=200),
        stop=stop,
        on_update=lambda i, t: stop.set(),
    )
    assert all(len(a.token_ids) < 10 and not a.finished for a in answers)


def test_sampling_is_validated(engine):
    for bad in (GenerationConfig(temperature=-1), GenerationConfig(top_p=0), GenerationConfig(max_new_tokens=0)):
        with pytest.raises(LorarlError):
            engine.generate(["base"], [USER], bad)


def test_an_exports_generation_config_does_not_leak_into_sampling(engine, tiny_model_dir, tmp_path):
    """A merged export's generation_config.json (here: suppress the base's first answer token, and a repetition
    penalty) is replaced by a clean one: the export, holding the base's weights, answers exactly like the base."""
    (base,) = engine.generate(["base"], [USER], GREEDY)
    runs = tmp_path / "runs"
    shutil.copytree(tiny_model_dir, runs / "merged")
    gen_file = runs / "merged" / "generation_config.json"
    gen = json.loads(gen_file.read_text()) if gen_file.is_file() else {}
    gen.update(suppress_tokens=[base.token_ids[0]], repetition_penalty=1.5)
    gen_file.write_text(json.dumps(gen))
    local = ChatEngine(engine.shared, Catalog(runs, str(tiny_model_dir)))
    (export,) = local.generate(["export:merged"], [USER], GREEDY)
    assert export.token_ids == base.token_ids


# ---- rewards ------------------------------------------------------------------------------------------------------


def test_rewards_from_rules_and_reward_adapter(engine):
    answers = engine.generate(["base", "demo/policy"], [USER] * 2, GREEDY)
    assert engine.score("none", [USER] * 2, answers) is None
    answers[0].text = "2 + 2 = 4"
    rules = engine.score("rules:demo", [USER] * 2, answers, {"answer": "4"})
    assert [r.total for r in rules] == [1.0, 0.0]
    assert rules[0].parts == {"numeric_match": 1.0}
    missing = engine.score("rules:demo", [USER] * 2, answers, {})  # numeric_match needs the `answer` column
    assert missing[0].total is None and "answer" in missing[0].error
    rm = engine.score("rm:rm", [USER] * 2, answers)
    assert all(isinstance(r.total, float) and r.total == r.total for r in rm)
    assert rm[0].total != rm[1].total
    with pytest.raises(LorarlError):
        engine.score("rm:../outside-run", [USER] * 2, answers)


def test_a_reward_without_its_column_is_asked_for_and_regenerate_takes_the_next_seed(engine, tmp_path):
    """The page asks for the column a chosen reward reads (choosing it, and sending without it: the panes answer,
    nothing is scored, one line says what to fill) instead of a ValueError in each pane; Regenerate samples with the
    next seed (a fixed seed would repeat the answer), a negative (random) seed stays."""
    import gradio as gr

    from lorarl.chat.handlers import Handlers
    from lorarl.chat.session import ChatSession

    h = Handlers(ChatSession(engine, tmp_path / "prefs.jsonl", tmp_path / "ties.jsonl"))
    ask = "reward rules:demo: numeric_match reads the column 'answer'; give it in “Reward columns”"
    example = ' (e.g. {"answer": "..."}: the expected answer)'
    assert h.on_reward("rules:demo", 2, "base", "base", "base", "base") == ask + example
    assert "Reward columns" not in h.on_reward("rules:demo", 2, "base", "base", "base", "base", '{"answer": "4"}')
    request = gr.Request()
    frames = list(h.on_send("What is 2 + 2?", 2, "base", "demo/policy", "base", "base", *[[]] * 4,
                            "", 0.0, 1.0, 4, 0, "rules:demo", "", request))  # fmt: skip
    last = frames[-1]
    assert last[4:6] == ["", ""]  # no reward under either answer ...
    assert last[9].startswith("done: ") and last[9].endswith(f" · not scored: {ask}{example}")  # ... one line says
    assert "greedy (the same answer for any seed)" in last[9]
    assert h.next_seed(0) == 1 and h.next_seed(41.0) == 42 and h.next_seed(-1) == -1
    with pytest.raises(gr.Error):
        h.next_seed(1.5)


def test_rule_rewards_are_read_from_old_and_new_recipe_layouts(tmp_path):
    """Runs saved before the recipe's ``reward`` section (``rewards``, ``ppo.reward_source``) and after it."""
    from lorarl.chat.catalog import read_recipe, rule_specs

    old = {"algo": "ppo", "ppo": {"reward_source": "both"}, "rewards": [{"name": "format", "weight": 0.5}]}
    new = {"algo": "grpo", "reward": {"source": "rules", "functions": [{"name": "numeric_match"}]}}
    rm_only = {"algo": "ppo", "reward": {"source": "reward_model", "functions": [{"name": "numeric_match"}]}}
    for i, (recipe, names) in enumerate(
        ((old, ["format"]), (new, ["numeric_match"]), (rm_only, []), ({"algo": "reward_model"}, []))
    ):
        (tmp_path / str(i)).mkdir()
        (tmp_path / str(i) / "recipe.yaml").write_text(yaml.safe_dump(recipe))
        assert [s.name for s in rule_specs(read_recipe(tmp_path / str(i)))] == names


# ---- votes --------------------------------------------------------------------------------------------------------


def test_votes_are_saved_as_trl_preference_pairs(engine, tmp_path):
    prefs = tmp_path / "preferences.jsonl"
    session = ChatSession(engine, prefs, tmp_path / "preferences_ties.jsonl")
    left = USER + [{"role": "assistant", "content": "4"}]
    right = USER + [{"role": "assistant", "content": "5"}]
    session.vote("left", "Be brief.", left, right, "demo/policy", "base")
    session.vote("right", "", left, right, "demo/policy", "base")
    session.vote("tie", "", left, right, "demo/policy", "base")
    rows = [json.loads(line) for line in prefs.read_text().splitlines()]
    assert rows[0]["prompt"] == [{"role": "system", "content": "Be brief."}] + USER
    assert rows[0]["chosen"] == [{"role": "assistant", "content": "4"}]
    assert rows[0]["rejected"] == [{"role": "assistant", "content": "5"}]
    assert (rows[0]["chosen_model"], rows[0]["rejected_model"]) == ("demo/policy", "base")
    assert rows[1]["prompt"] == USER and rows[1]["chosen"][0]["content"] == "5" and rows[1]["chosen_model"] == "base"
    assert len(rows) == 2  # the tie went to its own file
    (tie,) = [json.loads(line) for line in (tmp_path / "preferences_ties.jsonl").read_text().splitlines()]
    assert tie["tie"] is True and tie["chosen"][0]["content"] == "4"

    from lorarl.data.preferences import load_preferences

    pairs = load_preferences(str(prefs), engine.shared.tokenizer)  # ready for recipes/reward_model.yaml
    assert len(pairs) == 2


def test_votes_need_a_shared_prompt_and_answers():
    a = USER + [{"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?"}]
    left = a + [{"role": "assistant", "content": "6"}]
    right = USER + [{"role": "assistant", "content": "four"}, {"role": "user", "content": "and 3+3?"}]
    right += [{"role": "assistant", "content": "7"}]
    with pytest.raises(LorarlError, match="differ"):
        preference_record("", left, right, "a", "b", "left")
    with pytest.raises(LorarlError, match="no answer"):
        preference_record("", USER, left, "a", "b", "left")
    record, tie = preference_record(
        "", left, list(left[:-1]) + [{"role": "assistant", "content": "7"}], "a", "b", "right"
    )
    assert not tie and record["prompt"] == a and record["chosen"][0]["content"] == "7"


# ---- the app's API through gradio_client --------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_gradio_client_calls_the_app_api(runs_dir, engine):
    from gradio_client import Client

    demo = build_app(runs_dir, shared=engine.shared)
    demo.queue().launch(server_name="127.0.0.1", server_port=_free_port(), prevent_thread_lock=True, quiet=True)
    try:
        client = Client(demo.local_url, verbose=False)
        listed = client.predict(api_name="/checkpoints")
        assert [c["id"] for c in listed] == ["base", "demo/policy", "demo/step-000002", "export:merged"]
        assert [r["id"] for r in client.predict(api_name="/rewards")] == ["none", "rm:rm", "rules:demo"]
        args = ("What is 2 + 2?", ["base", "demo/policy"], "", 0.0, 1.0, 12, 0, "rules:demo", '{"answer": "4"}')
        first = client.predict(*args, api_name="/respond")
        assert first["panes"] == ["base", "demo/policy"]
        assert first["answers"][0] != first["answers"][1]
        assert len(first["rewards"]) == 2
        assert client.predict(*args, api_name="/respond") == first  # greedy: deterministic
        direct = engine.generate(["base", "demo/policy"], [USER] * 2, GREEDY)
        assert first["answers"] == [a.text for a in direct]
        with pytest.raises(Exception, match="unknown checkpoint"):
            client.predict("hi", ["../outside-run/policy"], api_name="/respond")
    finally:
        demo.close()
    assert not (runs_dir / "preferences.jsonl").exists()


def test_host_header_check_and_the_served_app_answers_loopback_names_only(runs_dir, engine):
    """DNS rebinding: a page of another site whose name resolves to 127.0.0.1 reaches the loopback port with its own
    name as Host; the app served on loopback refuses it."""
    import http.client

    from lorarl.chat.app import host_header_is_loopback, launch

    for value, ok in [("127.0.0.1:7860", True), ("localhost", True), ("[::1]:7860", True), ("127.9.9.9", True),
                      ("evil.example:7860", False), ("", False), ("[::1", False), ("192.168.1.5:7860", False)]:  # fmt: skip
        assert host_header_is_loopback(value) is ok, value
    port = _free_port()
    demo = launch(runs_dir, host="127.0.0.1", port=port, shared=engine.shared, prevent_thread_lock=True, quiet=True)
    try:

        def get(host: str) -> tuple[int, bytes]:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            conn.request("GET", "/config", headers={"Host": host})
            r = conn.getresponse()
            return r.status, r.read()

        assert get(f"127.0.0.1:{port}")[0] == 200 and get(f"localhost:{port}")[0] == 200
        status, body = get(f"rebound.example:{port}")
        assert status == 403 and b"127.0.0.1 / localhost" in body
    finally:
        demo.close()


def test_handlers_that_need_the_request_get_it():
    """gradio passes the request (its session: what Stop stops) only to callbacks whose annotation it resolves."""
    import gradio as gr
    from gradio.utils import get_type_hints

    from lorarl.chat.handlers import Handlers

    for fn in (Handlers.on_send, Handlers.on_regen, Handlers.on_stop):
        assert get_type_hints(fn)["request"] is gr.Request


# ---- entry points -------------------------------------------------------------------------------------------------


def test_apps_chat_is_lorarl_chat(tmp_path):
    """``python apps/chat.py`` is ``lorarl chat``: the CLI's own entry point (no copy of its options), so the same
    defaults, refusals and exit codes."""
    from lorarl.cli import build_parser

    args = build_parser().parse_args(["chat"])
    assert (args.runs, args.host, args.port) == ("runs", "127.0.0.1", 7860)
    tree = ast.parse((REPO / "apps" / "chat.py").read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert {m for m in imported if m and m.startswith("lorarl")} == {"lorarl.cli"}
    r = subprocess.run(
        [sys.executable, str(REPO / "apps" / "chat.py"), "--host", "0.0.0.0", "--runs", str(tmp_path)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 2, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "--host 0.0.0.0" in lines[0] and "127.0.0.1" in lines[0]
