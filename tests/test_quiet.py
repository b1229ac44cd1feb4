"""No warnings on the installed releases (issue 22): a GRPO run on the tiny model with every Python warning turned
into an error and no warning line from a library logger (transformers' ``logger.warning_once``, bitsandbytes, peft).

A release that deprecates something lorarl calls (as transformers 5.x did with ``past_key_values``) fails these
tests instead of printing to every user's terminal."""

from __future__ import annotations

import logging
import re
import textwrap
import warnings

import pytest

from lorarl import ignore_library_warnings
from lorarl.algos.loop import train
from lorarl.config import recipe_from_dict
from lorarl.model.kvcache import cache_arg, cache_name, output_cache
from lorarl.runs import read_metrics

# a reward with a spread in every group (the parity of the first completion token), so every step trains
REWARD = textwrap.dedent(
    """
    def parity(prompts, completions, completion_ids, **kwargs):
        return [float(ids[0] % 2) if ids else 0.0 for ids in completion_ids]
    """
)

WARNING_LINE = re.compile(r"(?i)\bwarn(ing)?\b|deprecat|FutureWarning")


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture()
def library_log_warnings():
    """WARNING records of the libraries' own loggers (transformers does not propagate to the root logger)."""
    handler = _Collect()
    names = ["", "transformers", "peft", "bitsandbytes", "accelerate", "torch", "datasets", "trl"]
    for name in names:
        logging.getLogger(name).addHandler(handler)
    yield handler.records
    for name in names:
        logging.getLogger(name).removeHandler(handler)


def _recipe(model_dir, reward_file, engine: str, **extra):
    data = {
        "model": {"name": str(model_dir), "quantization": "none", "dtype": "float32", "gradient_checkpointing": False},
        "lora": {"r": 8, "alpha": 16},
        "data": {"train_size": 32, "eval_size": 4},
        "reward": {"functions": [{"name": f"{reward_file}:parity"}]},
        "generation": {"max_new_tokens": 4, "temperature": 1.0, "engine": engine},
        "train": {"steps": 2, "prompts_per_step": 2, "micro_batch_size": 8, "learning_rate": 1e-2, "seed": 0},
        "grpo": {"group_size": 4, "kl": {"coef": 0.04}},
        "eval": {"every": 2, "n": 4, "batch_size": 4},
    }
    for section, values in extra.items():
        data.setdefault(section, {}).update(values)
    return recipe_from_dict(data)


@pytest.mark.parametrize(
    "engine, model",
    [
        ("hf", {}),  # generate() continuing from the shared prompt's cache; the prefix-shared training forward
        ("fast", {}),  # the static-cache engine's prefill and decode step
        ("hf", {"gradient_checkpointing": True}),  # packed completions under activation checkpointing
    ],
    ids=["hf", "fast", "checkpointing"],
)
def test_grpo_steps_raise_no_warning(engine, model, tiny_model_dir, tmp_path, library_log_warnings, capfd):
    """Two GRPO steps (rollout, reference, training forward / backward, a held-out evaluation) with warnings as
    errors: a deprecated call anywhere on the path raises here."""
    reward_file = tmp_path / "parity_reward.py"
    reward_file.write_text(REWARD)
    recipe = _recipe(tiny_model_dir, reward_file, engine, model=model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ignore_library_warnings()  # the few third-party ones lorarl cannot avoid (listed in lorarl/__init__.py)
        train(recipe, tmp_path / "run")
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2]
    assert any(r["loss"] is not None and r["loss"] != 0 for r in rows)  # the update ran (not a skipped step)
    assert rows[-1]["kl"] is not None  # the reference ran
    assert not library_log_warnings, [f"{r.name}: {r.getMessage()}" for r in library_log_warnings]
    err = capfd.readouterr().err
    assert not [line for line in err.splitlines() if WARNING_LINE.search(line)], err


def test_cache_is_passed_and_read_under_the_installed_transformers_name(tiny_shared):
    """The name transformers declares for the KV cache is the one lorarl uses, for the argument and the output."""
    import torch
    from transformers import DynamicCache
    from transformers.modeling_outputs import BaseModelOutputWithPast

    assert cache_name() in BaseModelOutputWithPast.__dataclass_fields__
    ids = torch.tensor([[5, 6, 7]])
    with tiny_shared.role("base"), warnings.catch_warnings():
        warnings.simplefilter("error")
        cache = DynamicCache()
        out = tiny_shared.decoder()(input_ids=ids, **cache_arg(cache), use_cache=True)
    assert output_cache(out) is cache and cache.get_seq_length() == 3
