"""Build the shipped arithmetic preference set (offline, deterministic, no model needed).

    python scripts/make_preferences.py            # writes lorarl/data/prefs_arith_{train,eval}.jsonl
    python scripts/make_preferences.py --check    # rebuilds in memory and fails if the shipped files differ

The prompts are the arithmetic task's own (``lorarl.tasks.arithmetic.make_problems``, the defaults of
``recipes/ppo.yaml``: addition, 2 digits, seed 1234), so the reward model scores exactly the prompts PPO trains on;
the train pairs use training problems and the held-out pairs use the task's held-out problems (disjoint by
construction). Rows are in TRL's conversational preference format::

    {"prompt": [{"role": "user", "content": "What is 23 + 45?"}],
     "chosen": [{"role": "assistant", "content": "23 + 45 = 68"}],
     "rejected": [{"role": "assistant", "content": "23 + 45 = 58"}], "kind": "wrong_number"}

``chosen`` is always a correct, concise answer (one of a few phrasings). ``rejected`` is one of:

* ``wrong_number`` -- the same phrasing with a wrong result (off by one, off by ten, a wrong last digit, swapped
  digits, a digit dropped or added, or the difference instead of the sum): the pair differs only in correctness;
* ``ramble`` -- a long answer that wanders off (SmolLM-style filler), with a wrong result, no result, or the right
  result buried in filler;
* ``unfinished`` -- a rambling answer cut off mid-sentence before any result.

The ``kind`` column is informational (the loader ignores unknown columns).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from lorarl.tasks.arithmetic import make_problems  # noqa: E402

OUT_DIR = REPO / "lorarl" / "data"
SEED = 1234  # the arithmetic task's data.seed in recipes/ppo.yaml: the same train / held-out problem split
N_TRAIN = 2400
N_EVAL = 400
KINDS = (("wrong_number", 0.35), ("ramble", 0.40), ("unfinished", 0.25))

CONCISE = (
    "{a} {op} {b} = {c}",
    "{a} {op} {b} = {c}.",
    "The answer is {c}.",
    "{c}",
    "{a} {op} {b} equals {c}.",
)

OPENERS = (
    "To add {a} and {b}, we need to combine the numbers in a way that results in a single value.",
    "What a delightful question! Adding numbers is one of the oldest ideas in mathematics.",
    "The problem of adding {a} and {b} involves exploring the structure of arithmetic itself.",
    "To calculate {a} {op} {b}, here's a step-by-step explanation of the whole process.",
    "Here's a possible explanation of how we can think about {a} and {b} together.",
    "Great question! Let's think carefully about what the numbers {a} and {b} really mean.",
    "In mathematics, addition is a fundamental operation that has fascinated people for centuries.",
)
FILLER = (
    "First, we should consider the place value of each digit, because every digit carries its own weight.",
    "This is a classic example of how math can be used to solve problems in everyday life.",
    "Many students find it helpful to draw a number line and count forward one step at a time.",
    "It is also worth noting that addition is commutative, so the order of the numbers does not matter.",
    "Historically, merchants used counting boards and abacuses to perform sums like this one.",
    "We can also think of the numbers as groups of tens and ones, which makes the structure clearer.",
    "Of course, there are many other ways to approach this problem, each with its own advantages.",
    "In this context, we might also ask what happens when we carry a digit from one column to the next.",
    "Some people like to estimate first, rounding each number to the nearest ten before adding.",
)
CUT_OFF = (
    "To find the result we first line up the digits and then",
    "Let's start by breaking {a} into tens and ones, so we get",
    "The first step is to look at the ones column, where we have",
    "If we think of {b} as a group of tens, we can see that the",
)


def wrong_result(a: int, b: int, c: int, rng: random.Random) -> int:
    """A plausible wrong result for ``a + b = c`` (never ``c``, never negative)."""
    for _ in range(100):
        kind = rng.randrange(8)
        if kind == 0:
            w = c + rng.choice((-1, 1))
        elif kind == 1:
            w = c + rng.choice((-10, 10))
        elif kind == 2:  # a wrong last digit
            w = c - c % 10 + (c % 10 + rng.randint(1, 9)) % 10
        elif kind == 3:  # digits swapped
            s = str(c)
            w = int(s[::-1]) if len(s) > 1 else c + 1
        elif kind == 4:  # a digit dropped
            s = str(c)
            w = int(s[:-1] or "0") if len(s) > 1 else c + 2
        elif kind == 5:  # a digit added
            w = int(str(c) + str(rng.randint(0, 9)))
        elif kind == 6:  # the difference instead of the sum
            w = abs(a - b)
        else:  # a number of the same size
            w = rng.randint(max(0, c - 40), c + 40)
        if w != c and w >= 0:
            return w
    return c + 1


def ramble(a: int, op: str, b: int, rng: random.Random, result: int | None, n_filler: int) -> str:
    parts = [rng.choice(OPENERS)] + rng.sample(FILLER, n_filler)
    if result is not None:
        parts.insert(rng.randint(1, len(parts)), f"So, {a} {op} {b} = {result}.")
    return " ".join(parts).format(a=a, op=op, b=b)


def make_pairs(split: str, n: int, seed: int = SEED) -> list[dict]:
    rows = make_problems(split, n, seed=seed, operations=["+"], digits=2)
    rng = random.Random(f"prefs:{seed}:{split}")
    names, weights = zip(*KINDS)
    out = []
    for row in rows:
        a, op, b, c = row["a"], row["op"], row["b"], int(row["answer"])
        style = rng.choice(CONCISE)
        chosen = style.format(a=a, op=op, b=b, c=c)
        kind = rng.choices(names, weights)[0]
        if kind == "wrong_number":
            rejected = style.format(a=a, op=op, b=b, c=wrong_result(a, b, c, rng))
        elif kind == "ramble":
            result = rng.choice((c, wrong_result(a, b, c, rng), None))
            rejected = ramble(a, op, b, rng, result, rng.randint(2, 4))
        else:
            rejected = ramble(a, op, b, rng, None, rng.randint(0, 2)) + " " + rng.choice(CUT_OFF).format(a=a, b=b)
        out.append(
            {
                "prompt": row["prompt"],
                "chosen": [{"role": "assistant", "content": chosen}],
                "rejected": [{"role": "assistant", "content": rejected}],
                "kind": kind,
            }
        )
    return out


def render(pairs: list[dict]) -> str:
    return "".join(json.dumps(p, ensure_ascii=False) + "\n" for p in pairs)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out-dir", type=Path, default=OUT_DIR)
    p.add_argument("--check", action="store_true", help="fail if the files on disk differ from a fresh build")
    args = p.parse_args(argv)
    files = {
        "prefs_arith_train.jsonl": render(make_pairs("train", N_TRAIN)),
        "prefs_arith_eval.jsonl": render(make_pairs("eval", N_EVAL)),
    }
    status = 0
    for name, text in files.items():
        path = args.out_dir / name
        if args.check:
            same = path.is_file() and path.read_text(encoding="utf-8") == text
            print(f"{path}: {'up to date' if same else 'DIFFERS'}")
            status |= not same
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
            print(f"{path}: {text.count(chr(10))} pairs, {len(text.encode()) / 1e6:.2f} MB")
    return status


if __name__ == "__main__":
    sys.exit(main())
