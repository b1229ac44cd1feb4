"""``lorarl bench agent-turns`` on the tiny model: the real GRPO steps ran with 3 model turns and 2 tool calls per
trajectory against 1 turn, with the same loss tokens and sequence lengths; the sampled tokens differ by the design's
forced end-of-turn ids only (lorarl.bench.agent_turns). Structure, never timing thresholds."""

from __future__ import annotations

import json

from lorarl.bench import agent_turns


def test_three_turn_step_against_single_turn_step_of_the_same_tokens(tiny_model_dir, tmp_path, capsys):
    L, prompts, group = 4, 1, 2
    rows = prompts * group
    agent_turns.main(
        ["--model", str(tiny_model_dir), "--steps", "1", "--prompts", str(prompts), "--group", str(group),
         "--turn-tokens", str(L), "--out", str(tmp_path)]
    )  # fmt: skip
    lines = capsys.readouterr().out.strip().splitlines()
    res = json.loads(lines[-1])
    assert json.loads((tmp_path / "result.json").read_text())["ratio_step"] == res["ratio_step"]
    mu, si = res["multi"], res["single"]
    # turns counted from the trajectories' loss masks: 3 runs of model tokens per row vs 1
    assert mu["turns_per_row"] == [3] * rows and si["turns_per_row"] == [1] * rows
    assert mu["tool_calls"] == 2 * rows and si["tool_calls"] == 0
    assert len(mu["engine_s_per_call"]) == 3 and len(si["engine_s_per_call"]) == 1
    # the same tokens: 3L loss tokens per row, the same sequence length; sampled: 3(L-1) vs 3L-1 per row
    assert mu["loss_tokens"] == si["loss_tokens"] == 3 * L * rows
    assert mu["sequence_lengths"] == si["sequence_lengths"] and len(set(mu["sequence_lengths"])) == 1
    assert mu["sampled_tokens"] == 3 * (L - 1) * rows and si["sampled_tokens"] == (3 * L - 1) * rows
    n = res["settings"]["tool_message_ids"]
    assert n > 0 and mu["sequence_lengths"][0] > 3 * L + 2 * n
    # the trainer's logits cover every completion position: the tool messages' ids too on the multi-turn side
    assert mu["completion_positions"] == (3 * L + 2 * n) * rows and si["completion_positions"] == 3 * L * rows
    # figures and ratios from this run
    for side in (mu, si):
        assert side["s_per_step"] > 0 and side["phases_s"]["generation"] > 0 and side["phases_s"]["training"] > 0
        assert all(x > 0 for x in side["prefill_s_per_call"])
    assert res["ratio_step"] == round(mu["s_per_step"] / si["s_per_step"], 3)
    assert any(line.startswith("| step |") for line in lines)
    # keys / values kept between turns (the default): each prompt prefilled once for its group, then per row and
    # turn only the tool message and the 2 ids not fed back (the last sampled one, the forced end-of-turn id)
    assert res["settings"]["reuse_kv"] is True
    prompt_ids = mu["sequence_lengths"][0] - (3 * L + 2 * n)
    assert mu["prefill_tokens"] == prompts * prompt_ids + rows * 2 * (n + 2)
    assert mu["kv_reused_tokens"] == rows * ((prompt_ids + L - 2) + (prompt_ids + L + n + L - 2))
