"""Precision decisions on a GPU, as pure functions of the facts (no GPU needed): the auto dtype, NF4's compute dtype,
what is refused or warned at load (bitsandbytes version, bf16 on GPUs without it, fp16 where bf16 exists), and
dynamic loss scaling for fp16 (GradScaler semantics, on the CPU)."""

from __future__ import annotations

import torch

from lorarl.model.precision import (
    base_compute_dtype,
    cuda_advice,
    cuda_auto_dtype,
    native_bf16,
    needs_loss_scaling,
    nf4_compute_dtype,
    version_tuple,
)

A100, H100, T4, V100 = (8, 0), (9, 0), (7, 5), (7, 0)


def test_version_tuple():
    assert version_tuple("0.50.2") == (0, 50, 2)
    assert version_tuple("0.45.0.dev0") == (0, 45, 0)
    assert version_tuple("1.0rc1") == (1, 0)
    assert version_tuple("0.49.9") < (0, 50) <= version_tuple("0.50.0")


def test_bf16_only_where_native_and_auto_dtype():
    assert native_bf16(A100) and native_bf16(H100) and native_bf16((8, 6))
    assert not native_bf16(T4) and not native_bf16(V100) and not native_bf16(None)
    assert cuda_auto_dtype(H100) == torch.bfloat16
    assert cuda_auto_dtype(T4) == torch.float16


def test_nf4_compute_dtype():
    assert nf4_compute_dtype(torch.float32, "cuda", H100) == torch.bfloat16
    assert nf4_compute_dtype(torch.float32, "cuda", T4) == torch.float16  # was bf16 (emulated) on a T4
    assert nf4_compute_dtype(torch.float16, "cuda", H100) == torch.float16
    assert nf4_compute_dtype(torch.float32, "cpu", None) == torch.float32


def _lines(*args, **kw) -> list[tuple[str, str]]:
    return [(a.level, a.message) for a in cuda_advice(*args, **kw)]


def test_nothing_to_say_on_a_bf16_gpu_with_current_bitsandbytes():
    assert _lines("nf4", "auto", H100, "0.50.2") == []
    assert _lines("nf4", "bfloat16", A100, "0.51.0") == []
    assert _lines("nf4", "float32", H100, "0.50.0") == []  # computes in bf16 (nf4_compute_dtype)
    assert _lines("none", "auto", H100, None) == []  # no NF4: bitsandbytes not needed


def test_nf4_without_bitsandbytes_is_refused_in_one_line():
    [(level, msg)] = _lines("nf4", "auto", H100, None)
    assert level == "refuse"
    assert msg == (
        "model.quantization nf4 needs bitsandbytes on CUDA: pip install 'bitsandbytes>=0.50' "
        "(or set model.quantization: none)"
    )


def test_old_bitsandbytes_is_a_warning_naming_the_fix():
    [(level, msg)] = _lines("nf4", "auto", H100, "0.45.5")
    assert level == "warn" and "bitsandbytes 0.45.5 is older than 0.50" in msg
    assert "pip install -U 'bitsandbytes>=0.50'" in msg
    assert _lines("none", "auto", H100, "0.45.5") == []  # only NF4 uses it


def test_bf16_on_a_gpu_without_it_is_refused():
    [(level, msg)] = _lines("nf4", "bfloat16", T4, "0.50.2", gpu="Tesla T4")
    assert level == "refuse"
    assert msg.startswith("model.dtype bfloat16: Tesla T4 (compute capability 7.5) has no native bfloat16")
    assert "set model.dtype: auto" in msg
    assert _lines("none", "bfloat16", T4, None)[0][0] == "refuse"  # unquantized too


def test_fp16_warnings():
    [(level, msg)] = _lines("nf4", "float16", H100, "0.50.2", gpu="H100")
    assert level == "warn" and msg.startswith("model.dtype float16 on H100, which has bfloat16")
    [(level, msg)] = _lines("nf4", "auto", T4, "0.50.2", gpu="Tesla T4")
    assert level == "warn" and "computes in float16 and training uses dynamic loss scaling" in msg
    both = _lines("nf4", "auto", T4, "0.44.0")
    assert [lvl for lvl, _ in both] == ["warn", "warn"]  # each fact its own line


def test_loss_scaling_only_for_fp16():
    assert needs_loss_scaling(torch.float16)
    assert not needs_loss_scaling(torch.bfloat16) and not needs_loss_scaling(torch.float32)


def test_base_compute_dtype_of_plain_and_nf4_models(tiny_model_dir):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float16)
    assert base_compute_dtype(plain) == torch.float16
    q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float16)
    nf4 = AutoModelForCausalLM.from_pretrained(
        tiny_model_dir, dtype=torch.float32, quantization_config=q, device_map={"": "cpu"}
    )
    assert base_compute_dtype(nf4) == torch.float16  # the embeddings are fp32; the 4-bit layers compute in fp16
