"""Rule rewards (table-driven), the registry, TRL compatibility, weighting, and failure isolation."""

from __future__ import annotations

import math
import sys
import textwrap
import time

import pytest
import torch

from lorarl.config import RewardSpec
from lorarl.errors import LorarlError
from lorarl.rewards import (
    RewardScorer,
    RewardTimeout,
    call_with_timeout,
    extract_answer,
    format_reward,
    is_correct,
    length_penalty,
    load_reward_fn,
    numeric_match,
    partial_credit,
)
from lorarl.rewards.builtins import math_match


@pytest.mark.parametrize(
    "text, want",
    [
        ("68", "68"),
        ("23 + 45 = 68.", "68"),
        ("The answer is 1,234", "1234"),
        ("-7 degrees", "-7"),
        ("pi is 3.14", "3.14"),
        ("<answer>12</answer> or maybe 13", "12"),
        ("<think>5+7 is 12</think><answer> 12 </answer>", "12"),
        ("<answer>first 3</answer><answer>then 4</answer>", "4"),
        ("<answer>Paris</answer>", "Paris"),
        ("no idea", None),
        ("", None),
    ],
)
def test_extract_answer(text, want):
    assert extract_answer(text) == want


@pytest.mark.parametrize(
    "completion, answer, want",
    [
        ("68", "68", 1.0),
        ("So 23 + 45 = 68", "68", 1.0),
        ("68.0", "68", 1.0),
        ("68 is wrong, it is 69", "68", 0.0),  # the LAST number counts
        ("<answer>68</answer> 69", "68", 1.0),  # the tag wins over later numbers
        ("<answer>67</answer> 68", "68", 0.0),
        ("sixty-eight", "68", 0.0),
        ([{"role": "assistant", "content": "It is 68"}], "68", 1.0),  # TRL conversational completion
        ("1,234", "1234", 1.0),
        ("<answer>Paris</answer>", "Paris", 1.0),
    ],
)
def test_numeric_match_table(completion, answer, want):
    assert numeric_match(["p"], [completion], answer=[answer]) == [want]


def test_numeric_match_none_answer_and_missing_column():
    assert numeric_match(["p", "q"], ["1", "2"], answer=[None, "2"]) == [None, 1.0]
    with pytest.raises(ValueError, match="answer"):
        numeric_match(["p"], ["1"])


@pytest.mark.parametrize(
    "completion, want",
    [
        ("<think>add</think><answer>68</answer>", 1.0),
        ("  <think>add\nthe tens</think>\n<answer>68</answer>\n", 1.0),
        ("<answer>68</answer>", 0.0),  # no reasoning block
        ("<think></think><answer>68</answer>", 0.0),  # empty reasoning
        ("<think>add</think><answer>68</answer> trailing", 0.0),
        ("<think>add</think>68", 0.0),
    ],
)
def test_format_reward_table(completion, want):
    assert format_reward(["p"], [completion]) == [want]


@pytest.mark.parametrize(
    "completion, want",
    [
        ("<think>6+8=14, carry</think><answer>68</answer>", 1.0),  # correct final answer -> +1.0
        ("<think>6+8=14, carry</think><answer>67</answer>", 0.5),  # right reasoning, wrong number -> +0.5
        ("I think it is 12", 0.0),  # incorrect -> 0.0
        ("68", 1.0),  # correct without the format still counts as correct
    ],
)
def test_partial_credit_seed_example(completion, want):
    assert partial_credit(["p"], [completion], answer=["68"]) == [want]
    assert partial_credit(["p"], [completion], answer=["68"], partial=0.25) == [0.25 if want == 0.5 else want]


@pytest.mark.parametrize(
    "length, want",
    [(0, 0.0), (6, 0.0), (7, -0.25), (8, -0.5), (10, -1.0), (11, -1.0), (50, -1.0)],
)
def test_length_penalty_dapo_soft_overlong(length, want):
    # max_length 10, buffer 4: free up to 6 tokens, linear to -1 at 10, -1 beyond
    ids = [[1] * length]
    assert length_penalty(["p"], ["x"], completion_ids=ids, max_length=10, buffer=4) == [pytest.approx(want)]


def test_length_penalty_counts_characters_without_ids():
    assert length_penalty(["p"], ["abcdefgh"], max_length=10, buffer=4) == [pytest.approx(-0.5)]
    with pytest.raises(ValueError):
        length_penalty(["p"], ["a"], max_length=4, buffer=0)


def test_is_correct_ignores_none_answers():
    assert not is_correct("68", None)


# ---- registry ------------------------------------------------------------------------------------------------


def test_registry_resolves_builtins_modules_and_files(tmp_path, monkeypatch):
    assert load_reward_fn("numeric_match") is numeric_match
    assert load_reward_fn("lorarl.rewards:format_reward") is format_reward
    f = tmp_path / "my_rewards.py"
    f.write_text("def brevity(prompts, completions, **kw):\n    return [-len(c) / 10 for c in completions]\n")
    fn = load_reward_fn(f"{f}:brevity")
    assert fn(["p"], ["abcde"]) == [-0.5]
    monkeypatch.syspath_prepend(str(tmp_path))
    assert load_reward_fn("my_rewards:brevity")(["p"], ["ab"]) == [-0.2]


@pytest.mark.parametrize(
    "name, message",
    [
        ("numeric_mach", "did you mean numeric_match"),
        ("no_such_module_xyz:f", "cannot import"),
        ("lorarl.rewards:nope", "no function 'nope'"),
        ("/nonexistent/file.py:f", "not found"),
    ],
)
def test_registry_errors_name_the_problem(name, message):
    with pytest.raises(LorarlError, match=message):
        load_reward_fn(name)


def test_scorer_rejects_unknown_kwargs():
    with pytest.raises(LorarlError, match=r"rewards\[0\].kwargs.*bogus"):
        RewardScorer([RewardSpec(name="format", kwargs={"bogus": 1})])
    with pytest.raises(LorarlError, match="takes no argument max_len"):
        RewardScorer([RewardSpec(name="length_penalty", kwargs={"max_len": 1})])
    scorer = RewardScorer([RewardSpec(name="length_penalty", kwargs={"max_length": 4, "buffer": 2})])
    assert scorer(["p"], ["x"], completion_ids=[[1, 2, 3]]).total.tolist() == [-0.5]


def test_trl_style_reward_function_drops_in(tmp_path):
    """A function written for TRL's GRPOTrainer (prompts, completions, **kwargs with dataset columns)."""
    f = tmp_path / "trl_style.py"
    f.write_text(
        textwrap.dedent(
            """
            def reward_len(completions, **kwargs):
                return [-abs(20 - len(c[0]["content"])) for c in completions]

            def uses_column(prompts, completions, ground_truth, **kwargs):
                return [float(c[0]["content"] == g) for c, g in zip(completions, ground_truth)]
            """
        )
    )
    scorer = RewardScorer([RewardSpec(name=f"{f}:reward_len"), RewardSpec(name=f"{f}:uses_column", weight=2.0)])
    comps = [[{"role": "assistant", "content": "x" * 18}], [{"role": "assistant", "content": "yes"}]]
    s = scorer([[{"role": "user", "content": "q"}]] * 2, comps, {"ground_truth": ["no", "yes"]})
    assert s.names == ["reward_len", "uses_column"]
    assert s.per_function.tolist() == [[-2.0, 0.0], [-17.0, 1.0]]
    assert s.total.tolist() == [-2.0, -17.0 + 2.0]
    assert not s.failures


# ---- weighting and isolation ---------------------------------------------------------------------------------


def _const(value):
    return lambda prompts, completions, **kw: [value] * len(completions)


def test_weighted_total_skips_none_values(monkeypatch):
    scorer = RewardScorer([RewardSpec(name="numeric_match", weight=1.0), RewardSpec(name="format", weight=0.5)])
    scorer.fns[1] = lambda prompts, completions, **kw: [1.0, None, 0.0]
    s = scorer(["p"] * 3, ["68", "68", "x"], {"answer": ["68", "1", "68"]})
    assert s.per_function[:, 0].tolist() == [1.0, 0.0, 0.0]
    assert math.isnan(s.per_function[1, 1])
    assert s.total.tolist() == [1.5, 0.0, 0.0]  # row 1: only numeric_match has a value
    assert s.means() == {"numeric_match": pytest.approx(1 / 3), "format": pytest.approx(0.5)}


def test_all_none_row_total_is_nan():
    scorer = RewardScorer([RewardSpec(name="numeric_match")])
    s = scorer(["p", "q"], ["1", "2"], {"answer": [None, "2"]})
    assert math.isnan(s.total[0]) and s.total[1] == 1.0


@pytest.mark.parametrize(
    "bad, error",
    [
        (lambda prompts, completions, **kw: 1 / 0, "ZeroDivisionError"),
        (lambda prompts, completions, **kw: [1.0], "returned 1 values for 2"),
        (lambda prompts, completions, **kw: "nope", "expected a list"),
        (lambda prompts, completions, **kw: ["x", 1.0], "non-number"),
    ],
)
def test_failing_reward_is_isolated_and_counted(bad, error):
    scorer = RewardScorer([RewardSpec(name="numeric_match"), RewardSpec(name="format")])
    scorer.fns[1] = bad
    s = scorer(["p", "q"], ["68", "5"], {"answer": ["68", "6"]})
    assert s.per_function[:, 0].tolist() == [1.0, 0.0]  # the healthy reward still scores
    assert torch.isnan(s.per_function[:, 1]).all()
    assert s.total.tolist() == [1.0, 0.0]
    assert error in s.failures["format"]
    assert (scorer.calls, scorer.failures) == (2, 1)
    assert scorer.failure_fraction == 0.5


@pytest.mark.parametrize(
    "value, weight, why",
    [
        (float("inf"), 1.0, "returned inf, not a finite float32"),
        (-float("inf"), 1.0, "returned -inf, not a finite float32"),
        (1e300, 1.0, "returned 1e+300, not a finite float32"),  # finite in Python, inf in float32
        (10**400, 1.0, "returned inf, not a finite float32"),  # an int past float64
        (3e38, 2.0, "returned 3e+38, x weight 2 past float32"),  # finite alone, its weighted value is not
    ],
)
def test_a_non_finite_value_is_a_failed_value_named_as_the_rewards(value, weight, why):
    """A value that is not a finite float32 (or whose weighted value is not) is a failed value of its function:
    NaN (left out, never inf in the total, so the group's advantages stay finite), counted, its failure named."""
    scorer = RewardScorer([RewardSpec(name="numeric_match"), RewardSpec(name="format", weight=weight)])
    scorer.fns[1] = lambda prompts, completions, **kw: [value, 0.5]
    s = scorer(["p", "q"], ["68", "5"], {"answer": ["68", "6"]})
    assert math.isnan(s.per_function[0, 1]) and s.per_function[1, 1] == 0.5
    assert s.total.tolist() == [1.0, 0.5 * weight]  # row 0: numeric_match alone
    assert s.failures == {"format": f"1 of 2 values failed ({why})"}
    assert (scorer.failures, scorer.failed_values, scorer.values) == (0, [0, 1], [2, 2])
    assert s.usable() == [2, 1]


def test_a_weighted_total_past_float32_is_left_out_and_named():
    """Two finite weighted values whose sum is past float32 (3e38 + 3e38): the row's total is NaN, not inf, and the
    function with the largest weighted value is named."""
    scorer = RewardScorer([RewardSpec(name="numeric_match"), RewardSpec(name="format")])
    scorer.fns[0] = lambda prompts, completions, **kw: [3e38, 1.0]
    scorer.fns[1] = lambda prompts, completions, **kw: [2e38, 1.0]
    s = scorer(["p", "q"], ["a", "b"])
    assert math.isnan(s.total[0]) and s.total[1] == 2.0
    assert s.failures == {"numeric_match": "a weighted total of 5e+38 past float32 (row 0)"}


def test_timeout_interrupts_a_hanging_reward():
    scorer = RewardScorer([RewardSpec(name="numeric_match")], timeout_s=0.2)

    def hang(prompts, completions, **kw):
        while True:  # pure-Python busy loop: SIGALRM interrupts it
            pass

    scorer.fns[0] = hang
    t0 = time.monotonic()
    s = scorer(["p"], ["1"], {"answer": ["1"]})
    assert time.monotonic() - t0 < 5
    assert "RewardTimeout" in s.failures["numeric_match"]
    assert torch.isnan(s.total).all()


def test_call_with_timeout_in_a_thread_and_restores_outer_timer():
    import signal
    import threading

    box = {}

    def worker():
        try:
            call_with_timeout(lambda: time.sleep(2), 0.1)
        except RewardTimeout as e:
            box["err"] = e

    th = threading.Thread(target=worker)
    th.start()
    th.join(5)
    assert isinstance(box.get("err"), RewardTimeout)
    assert call_with_timeout(lambda: 7, 1.0) == 7
    if sys.platform != "win32":
        fired = []
        old = signal.signal(signal.SIGALRM, lambda *a: fired.append(1))
        try:
            signal.setitimer(signal.ITIMER_REAL, 30.0)
            assert call_with_timeout(lambda: 3, 1.0) == 3
            remaining, _ = signal.getitimer(signal.ITIMER_REAL)
            assert 25.0 < remaining <= 30.0  # the outer timer is back, minus the time spent
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)
        assert not fired


# ---- math-verify: the math reward and the task verifiers ----------------------------------------------------------

MATH_EQUIVALENT = [
    (r"so the answer is \boxed{\frac{1}{2}}", "0.5"),
    ("1/2", r"\frac{1}{2}"),
    ("The answer is $0.75$.", r"\frac{3}{4}"),
    ("<think>48/2 = 24, 48 + 24 = 72</think><answer>72</answer>", "72"),
    ("She sold 1,000 apples.", "1000"),
    (r"\boxed{5\text{ cm}}", "5"),
    (r"<answer>$2\sqrt{2}$</answer>", r"\sqrt{8}"),
    ("It costs $18.00", "18"),
    ([{"role": "assistant", "content": r"Final: \boxed{-4}"}], "-4"),
]
MATH_NOT_EQUIVALENT = [
    (r"\boxed{\frac{1}{3}}", r"\frac{1}{2}"),
    ("The answer is 71", "72"),
    ("<think>it is 72</think><answer>70</answer>", "72"),  # the <answer> counts, not the reasoning
    ("I do not know", "3"),
    (r"\boxed{x + 1}", "x + 2"),
    ("", "5"),
]


@pytest.mark.parametrize("completion, answer", MATH_EQUIVALENT)
def test_math_match_accepts_equivalent_answers(completion, answer):
    assert math_match(["p"], [completion], answer=[answer]) == [1.0]


@pytest.mark.parametrize("completion, answer", MATH_NOT_EQUIVALENT)
def test_math_match_rejects_different_answers(completion, answer):
    assert math_match(["p"], [completion], answer=[answer]) == [0.0]


def test_math_match_none_for_unreadable_gold_and_the_plain_numeric_check_differs():
    assert math_match(["p"] * 3, ["12", "12", "12"], answer=[None, "", "12"]) == [None, None, 1.0]
    with pytest.raises(ValueError, match="needs a dataset column 'answer'"):
        math_match(["p"], ["1"])
    # what the last-number check cannot see, math-verify can (and the other way round nothing is lost)
    assert numeric_match(["p"], [r"\boxed{\frac{1}{2}}"], answer=["0.5"]) == [0.0]
    assert math_match(["p"], [r"\boxed{\frac{1}{2}}"], answer=["0.5"]) == [1.0]
    assert load_reward_fn("math_match") is math_match


def test_math_match_keeps_the_reward_timer_running():
    """math-verify's own alarms would cancel the reward's SIGALRM timer; lorarl puts it back after each answer."""
    assert math_match(["p"], ["1/2"], answer=["0.5"]) == [1.0]  # math-verify imported: the timer below meets it
    t0 = time.monotonic()
    with pytest.raises(RewardTimeout):
        call_with_timeout(lambda: (math_match(["p"], ["1/2"], answer=["0.5"]), time.sleep(3)), 0.5)
    assert time.monotonic() - t0 < 2.0


def test_math_match_times_out_one_answer_as_wrong(monkeypatch):
    import math_verify.grader

    real_eq = math_verify.grader.sympy_expr_eq

    def slow_eq(gold, target, *a, **kw):
        if float(target) == 7.0:
            while True:  # pure Python: math-verify's SIGALRM timer interrupts it
                pass
        return real_eq(gold, target, *a, **kw)

    monkeypatch.setattr(math_verify.grader, "sympy_expr_eq", slow_eq)
    t0 = time.monotonic()
    # inside a reward's 20 s limit: the slow answer is wrong after ~1 s, the other is checked, the outer timer survives
    out = call_with_timeout(lambda: math_match(["p"] * 2, ["7.0", "8"], answer=["7", "8"], item_timeout_s=1), 20)
    assert out == [0.0, 1.0] and time.monotonic() - t0 < 5.0
    with pytest.raises(RewardTimeout):
        call_with_timeout(lambda: (math_match(["p"], ["7.0"], answer=["7"], item_timeout_s=1), time.sleep(5)), 2)


def test_accuracy_comes_from_the_recipes_verifier():
    from lorarl.config import DataConfig, Recipe
    from lorarl.tasks import VERIFIERS, accuracy

    completions = [r"\boxed{\frac{1}{2}}", "0.5", "no idea", "x"]
    columns = {"answer": ["0.5", "0.5", "0.5", None]}  # the None row is left out of the accuracy
    numeric, math_ = Recipe(data=DataConfig()), Recipe(data=DataConfig(verifier="math"))
    assert accuracy(numeric, completions, columns) == pytest.approx(1 / 3)  # the last number of "\frac{1}{2}" is 2
    assert accuracy(math_, completions, columns) == pytest.approx(2 / 3)
    assert accuracy(numeric, completions, {}) is None
    assert accuracy(numeric, ["1"], {"answer": [None]}) is None
    assert set(VERIFIERS) == {"numeric", "math"}
