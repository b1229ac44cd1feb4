"""``lorarl env``: the report holds the real versions and facts of this machine, the text names them, the NF4
kernel check can fail, and ``--json`` prints the dict as the last line."""

from __future__ import annotations

import json
import platform
import re

import peft
import pytest
import torch
import transformers

from lorarl.cli import main as cli_main
from lorarl.env_report import collect, embedded_model, format_report, nf4_check


@pytest.fixture(scope="module")
def env() -> dict:
    return collect()


def test_the_report_holds_this_machines_facts(env):
    import lorarl
    from lorarl.model.registry import DEFAULT_MODEL, converted_path

    assert env["torch_build"]["version"] == torch.__version__
    assert env["packages"]["transformers"] == transformers.__version__
    assert env["packages"]["peft"] == peft.__version__
    assert env["python"]["version"] == platform.python_version()
    assert env["lorarl"]["version"] == lorarl.__version__
    git = env["lorarl"]["git"]
    assert git is None or re.fullmatch(r"[0-9a-f]{40}", git["commit"])
    dev = env["devices"]
    assert dev["cuda_available"] == torch.cuda.is_available()
    assert dev["device_count"] == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    assert len(dev["devices"]) == dev["device_count"]
    assert env["cpu"]["torch_threads"] == torch.get_num_threads()
    em = env["embedded_model"]
    assert em["name"] == DEFAULT_MODEL and em["path"] == str(converted_path(DEFAULT_MODEL))
    nf4 = env["bitsandbytes_nf4"]
    assert nf4["ok"] is True and nf4["error"] is None  # bitsandbytes >= 0.49 runs NF4 on the CPU too
    assert 0.01 < nf4["quantization_error"] < 0.3  # NF4's own rounding of a Gaussian weight: it did quantize


def test_the_text_names_the_facts(env):
    text = format_report(env)
    assert f"torch        {env['packages']['torch']}" in text
    assert f"transformers {transformers.__version__}" in text
    assert f"python       {platform.python_version()}" in text
    assert "NF4 kernels  ok on" in text and env["embedded_model"]["path"] in text
    assert ("CUDA         available" in text) == torch.cuda.is_available()


def test_a_broken_nf4_forward_is_reported(monkeypatch):
    import bitsandbytes as bnb

    monkeypatch.setattr(bnb.nn.Linear4bit, "forward", lambda self, x: torch.zeros(x.shape[0], 32, dtype=x.dtype))
    res = nf4_check("cpu")
    assert res["ok"] is False and res["relative_error"] == pytest.approx(1.0)
    assert "FAILED on cpu" in format_report({**collect_light(), "bitsandbytes_nf4": res})


def collect_light() -> dict:
    """A report without the slow parts, for formatting tests."""
    from lorarl.env_report import cpu_info, device_info, lorarl_info, package_versions

    return {
        "lorarl": lorarl_info(),
        "python": {"version": platform.python_version(), "executable": "python", "platform": platform.platform()},
        "packages": package_versions(),
        "torch_build": {"version": torch.__version__, "cuda": torch.version.cuda, "debug": False},
        "devices": device_info(),
        "embedded_model": embedded_model(),
        "cpu": cpu_info(),
    }


def test_lorarl_cache_is_followed(tmp_path, monkeypatch):
    monkeypatch.setenv("LORARL_CACHE", str(tmp_path))
    em = embedded_model()
    assert em["LORARL_CACHE"] == str(tmp_path) and em["cache_dir"] == str(tmp_path)
    assert em["converted"] is False and em["path"].startswith(str(tmp_path))  # nothing converted there yet


def test_cli_env_json_last_line(capsys):
    assert cli_main(["env", "--json"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    data = json.loads(lines[-1])
    assert data["torch_build"]["version"] == torch.__version__
    assert set(data) == {
        "lorarl",
        "python",
        "packages",
        "torch_build",
        "devices",
        "bitsandbytes_nf4",
        "embedded_model",
        "cpu",
    }
    assert any(line.startswith("torch ") for line in lines[:-1])  # the human report comes first
