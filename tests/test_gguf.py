"""GGUF export (tiny model, CPU): read back by the `gguf` library and by transformers' GGUF loader (logits against the
merged export within each type's tolerance), the Ollama Modelfile, the converter's source, bad input; with
llama-cpp-python installed, q4_k_m and llama.cpp itself; a slow test on the real embedded model in llama.cpp."""

from __future__ import annotations

import io
import json
import os
import tarfile
from pathlib import Path

import pytest
import torch
from export_runs import make_run

from lorarl.errors import LorarlError
from lorarl.export import export
from lorarl.export.gguf import LLAMA_CPP_PYTHON_VERSION, check_architecture, converter_dir, gguf_name
from lorarl.export.ollama import PROBES, ChatFormat, detect_chat_format
from lorarl.export.runtimes import llama_cpp_available

needs_llama_cpp = pytest.mark.skipif(
    not llama_cpp_available(),
    reason=f"llama-cpp-python is not installed (pip install llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}: builds "
    "llama.cpp from source with cmake and a C++ compiler, 52 min on 2 busy cores)",
)
MESSAGES = [
    [{"role": "user", "content": "What is 23 + 45?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 7 + 8? Think first."}],
]
# max |logit difference| to the fp32 merged model, relative to the largest |logit|: f16 rounds each weight to 11
# significant bits (~5e-4 relative), q8_0 to 8-bit blocks with an f16 scale (~1e-2 relative); measured on this model
# f16 ~2e-3 and q8_0 ~3e-2 (errors add up over 2 layers), so these bounds hold with room and still fail for a wrong
# mapping (logits of an unrelated model differ by ~100% of their scale).
TOLERANCE = {"f16": 0.01, "q8_0": 0.08}


@pytest.fixture(scope="module", autouse=True)
def gguf_parsed_once():
    """Each GGUF file is parsed once in this module. gguf's reader walks the 49,152-token vocabulary and its merges
    value by value (seconds a parse), transformers' GGUF loader parses the file twice per load (config, then
    weights), and the gate and the checks below load each file several times. The reader only reads (a numpy memmap
    opened "r"), so one parse of an unchanged file serves every load; the file is known by its inode, size and
    modification time (an export's gate reads it in the export's temporary folder, which is then renamed)."""
    import gguf

    real, parsed = gguf.GGUFReader, {}

    def reader(path, mode="r"):
        st = os.stat(path)
        key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, mode)
        if key not in parsed:
            parsed[key] = real(path, mode)
        return parsed[key]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "GGUFReader", reader)
        yield parsed


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, tiny_model_dir) -> Path:
    return make_run(tmp_path_factory.mktemp("gguf-run") / "run", tiny_model_dir)


@pytest.fixture(scope="module")
def exports(run_dir, tmp_path_factory) -> dict[str, tuple[Path, dict]]:
    """The merged fp32 export and the f16 / q8_0 GGUF exports of the same run (gate on 4 prompts)."""
    root = tmp_path_factory.mktemp("gguf-exports")
    out = {"merged": (root / "merged", export(run_dir, root / "merged", fmt="merged", dtype="fp32", gate_n=0))}
    for quant in ("f16", "q8_0"):
        folder = root / quant
        out[quant] = (folder, export(run_dir, folder, fmt="gguf", quant=quant, gate_n=4))
    return out


def _merged_logits(folder: Path, model=None) -> torch.Tensor:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    model = model or AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    rows = []
    for m in MESSAGES:
        ids = tok.apply_chat_template(m, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        with torch.no_grad():
            rows.append(model.eval()(**ids).logits[0])
    return torch.cat(rows)


@pytest.mark.parametrize("quant", ["f16", "q8_0"])
def test_gguf_read_back_by_gguf_library(exports, quant):
    from gguf import GGUFReader
    from safetensors import safe_open
    from transformers import AutoTokenizer

    folder, result = exports[quant]
    merged = exports["merged"][0]
    assert result["quant"] == quant and result["files"] == ["Modelfile", "README.md", "gate.json", gguf_name(quant)]
    reader = GGUFReader(str(folder / gguf_name(quant)))
    meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    tok = AutoTokenizer.from_pretrained(merged)
    cfg = json.loads((merged / "config.json").read_text())
    assert meta["general.architecture"] == "llama" and meta["llama.block_count"] == cfg["num_hidden_layers"]
    assert meta["llama.embedding_length"] == cfg["hidden_size"] and meta["llama.attention.head_count_kv"] == 2
    assert meta["tokenizer.chat_template"] == tok.chat_template
    assert meta["tokenizer.ggml.eos_token_id"] == tok.eos_token_id and len(meta["tokenizer.ggml.tokens"]) == len(tok)
    assert meta["tokenizer.ggml.tokens"][tok.eos_token_id] == tok.eos_token
    assert meta["general.name"] == "lorarl grpo run"

    tensors = {t.name: t for t in reader.tensors}
    want = {"token_embd.weight", "output_norm.weight"}  # tied embeddings: no output.weight
    for i in range(cfg["num_hidden_layers"]):
        want |= {f"blk.{i}.{n}.weight" for n in ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm")}
        want |= {f"blk.{i}.{n}.weight" for n in ("ffn_gate", "ffn_up", "ffn_down")}
    assert set(tensors) == want
    with safe_open(str(merged / "model.safetensors"), "pt") as f:
        hf = {k: f.get_slice(k).get_shape() for k in f.keys()}
    assert list(tensors["blk.1.ffn_down.weight"].shape) == hf["model.layers.1.mlp.down_proj.weight"][::-1]
    assert list(tensors["token_embd.weight"].shape) == hf["model.embed_tokens.weight"][::-1]
    matrix_type = {"f16": "F16", "q8_0": "Q8_0"}[quant]
    assert tensors["blk.0.attn_q.weight"].tensor_type.name == matrix_type
    assert tensors["blk.0.attn_norm.weight"].tensor_type.name == "F32"  # norms stay fp32 in every type


@pytest.mark.parametrize("quant", ["f16", "q8_0"])
def test_transformers_gguf_loader_logits_match_merged(exports, quant):
    from transformers import AutoModelForCausalLM

    folder, _ = exports[quant]
    merged = exports["merged"][0]
    want = _merged_logits(merged)
    model = AutoModelForCausalLM.from_pretrained(str(folder), gguf_file=gguf_name(quant), dtype=torch.float32)
    got = _merged_logits(merged, model)  # the export's tokenizer, the GGUF's weights
    rel = ((got - want).abs().max() / want.abs().max()).item()
    print(f"{quant}: max |logit diff| / max |logit| = {rel:.2e}")
    assert 0.0 < rel < TOLERANCE[quant]
    assert (got.argmax(-1) == want.argmax(-1)).float().mean().item() >= 0.95


def test_gate_and_modelfile_of_gguf_export(exports, run_dir):
    folder, result = exports["q8_0"]
    gate = json.loads((folder / "gate.json").read_text())
    assert gate["format"] == "gguf" and gate["quant"] == "q8_0" and gate["prompts"] == 4
    assert gate["logprob_max_abs_delta"] < 0.05 and result["gate"]["greedy_agreement"] == gate["greedy_agreement"]
    modelfile = (folder / "Modelfile").read_text()
    lines = modelfile.splitlines()
    assert f"FROM ./{gguf_name('q8_0')}" in lines and 'PARAMETER stop "<|im_end|>"' in lines
    assert "PARAMETER temperature 0.7" in lines and "PARAMETER num_predict 8" in lines
    assert "PARAMETER repeat_penalty 1" in lines  # Ollama's default (1.1) would change what the model samples
    assert 'SYSTEM """You are a helpful AI assistant named SmolLM, trained by Hugging Face"""' in lines
    assert modelfile.count('TEMPLATE """') == 1 and "<|im_start|>assistant\n{{ end }}" in modelfile
    card = (folder / "README.md").read_text()
    assert f"ollama create lorarl-run -f {folder.resolve() / 'Modelfile'}" in card
    assert "## Fidelity gate" in card and "llama-cli -m" in card


def test_chat_format_detection(default_model_dir):
    """The Modelfile's template is the one format that reproduces the tokenizer's rendering on every probe."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_dir)
    fmt = detect_chat_format(tok)
    assert fmt is not None and fmt.name == "chatml"
    assert fmt.default_system == "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    for msgs, gen in PROBES:
        assert fmt.render(msgs, gen) == tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)

    tok.chat_template = (  # Llama-3's template (no default system prompt)
        "{{ bos_token }}{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n' "
        "+ m['content'] | trim + '<|eot_id|>' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
    )
    fmt = detect_chat_format(tok)
    assert fmt is not None and fmt.name == "llama-3" and fmt.default_system is None
    assert fmt.go_template().startswith(tok.bos_token)

    tok.chat_template = "{% for m in messages %}### {{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    assert detect_chat_format(tok) is None


def test_go_template_is_chatml_in_go_syntax():
    fmt = ChatFormat(
        "x",
        {"user": "<u>", "system": "<s>", "assistant": "<a>"},
        dict.fromkeys(["user", "system", "assistant"], "</>"),
        generation="<a>",
    )
    go = fmt.go_template()
    assert go.count("{{ range $i, $_ := .Messages }}") == 1 and "{{-" not in go and go.endswith("{{ end }}{{ end }}")
    assert '{{ else if eq .Role "assistant" }}<a>{{ .Content }}{{ if not $last }}</>{{ end }}' in go
    assert '{{ if and $last (ne .Role "assistant") }}<a>{{ end }}' in go


def _fake_sdist(path: Path) -> Path:
    root = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}/vendor/llama.cpp/"
    files = {
        "convert_hf_to_gguf.py": "print('converter')\n",
        "conversion/__init__.py": "",
        "gguf-py/gguf/__init__.py": "",
        "models/templates/x.jinja": "t",
        "models/ggml-vocab-big.gguf": "not needed",
        "src/llama.cpp": "not needed",
    }
    with tarfile.open(path, "w:gz") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(root + name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def test_converter_extracted_once_from_the_cached_sdist(tmp_path, monkeypatch):
    monkeypatch.setenv("LORARL_CACHE", str(tmp_path))
    monkeypatch.delenv("LORARL_LLAMA_CPP", raising=False)
    (tmp_path / "sdist").mkdir()
    _fake_sdist(tmp_path / "sdist" / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz")
    tree = converter_dir(fetch=False)
    assert tree == tmp_path / "llama.cpp" / f"llama-cpp-python-{LLAMA_CPP_PYTHON_VERSION}"
    got = sorted(str(p.relative_to(tree)) for p in tree.rglob("*") if p.is_file())
    assert got == [
        "conversion/__init__.py",
        "convert_hf_to_gguf.py",
        "gguf-py/gguf/__init__.py",
        "models/templates/x.jinja",
    ]
    (tmp_path / "sdist" / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz").unlink()
    assert converter_dir(fetch=False) == tree  # extracted once; the sdist is no longer needed

    monkeypatch.setenv("LORARL_LLAMA_CPP", str(tmp_path / "nowhere"))
    with pytest.raises(LorarlError, match="LORARL_LLAMA_CPP=.*not a llama.cpp tree"):
        converter_dir()


def test_bad_input_gets_one_line(run_dir, tmp_path, tiny_model_dir, monkeypatch, capsys):
    from lorarl.cli import main

    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(LorarlError, match="architecture GPT2LMHeadModel is not supported by --format gguf"):
        check_architecture(str(gpt2))

    out = tmp_path / "out"
    assert main(["export", str(run_dir), "--out", str(out), "--format", "gguf", "--quant", "q3"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "lorarl: error: --quant must be one of f16, bf16, q8_0, q4_k_m, got 'q3'"
    ]

    bare = tmp_path / "bare"
    bare.mkdir()
    assert main(["export", str(bare), "--out", str(out), "--format", "gguf"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{bare}: no policy adapter" in err[0]

    monkeypatch.setenv("PATH", str(tmp_path))  # no llama-quantize
    monkeypatch.delenv("LORARL_LLAMA_QUANTIZE", raising=False)
    monkeypatch.setattr("lorarl.export.gguf.importlib.util.find_spec", lambda name: None)  # no llama_cpp either
    assert main(["export", str(run_dir), "--out", str(out), "--format", "gguf", "--quant", "q4_k_m"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--quant q4_k_m needs llama.cpp's quantize tool" in err[0] and "pip install" in err[0]

    assert main(["export", str(run_dir), "--out", str(out), "--gate", "1.5"]) == 2
    assert "--gate is a minimum greedy agreement between 0 and 1" in capsys.readouterr().err
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


@needs_llama_cpp
def test_llama_cpp_runs_the_gguf_like_the_training_model(exports, run_dir):
    """The gate of a GGUF export ran in llama.cpp itself; its tokenizer gives the training prompt ids."""
    gate = json.loads((exports["f16"][0] / "gate.json").read_text())
    assert gate["export_runtime"].startswith("llama.cpp (llama-cpp-python")
    assert gate["tokenizer_agreement"] == 1.0
    assert gate["greedy_agreement"] == 1.0 and gate["logprob_max_abs_delta"] < 0.01


@needs_llama_cpp
def test_q4_k_m_quantized_by_llama_cpp(tmp_path, default_model_dir):
    from conftest import make_tiny_model
    from gguf import GGUFReader

    model = make_tiny_model(tmp_path / "tiny256", hidden=256)  # Q4_K needs rows of 256
    run = make_run(tmp_path / "run", model, scale=0.02)
    result = export(run, tmp_path / "q4", fmt="gguf", quant="q4_k_m", gate_n=4)
    reader = GGUFReader(str(tmp_path / "q4" / gguf_name("q4_k_m")))
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["blk.0.attn_q.weight"] == "Q4_K" and "Q6_K" in types.values()  # q4_k_m keeps some tensors at Q6_K
    assert result["gate"]["prompts"] == 4 and "llama-cpp-python" in json.dumps(result)


@pytest.mark.slow
@needs_llama_cpp
def test_real_model_f16_and_q8_0_in_llama_cpp_match_merged(tmp_path, default_model_dir):
    """The embedded SmolLM2-135M with a LoRA adapter: the f16 and q8_0 GGUF in llama.cpp against the merged export in
    transformers, greedy. With a trained run (LORARL_GGUF_RUN: the quickstart run, 200 held-out problems) the greedy
    answers must agree (f16 >= 98%, q8_0 >= 95%; measured 100% / 97.5%). Without one (CI) the adapter is random and
    small: the model is unsure of most tokens, so one q8_0 rounding flips a near-tie and the rest of the greedy answer
    with it (measured 62.5% agreement on 200 problems with mean |delta log-prob| 0.028), and the checks there are the
    per-token log-prob gap on the same tokens, which does not depend on near-ties, plus f16's agreement."""
    from lorarl.export import locate, run_gate

    run = Path(os.environ["LORARL_GGUF_RUN"]) if os.environ.get("LORARL_GGUF_RUN") else None
    trained = run is not None
    n = 200 if trained else 64
    if run is None:
        run = make_run(tmp_path / "run", default_model_dir, scale=0.01, max_new_tokens=16)
    merged = tmp_path / "merged"
    export(run, merged, fmt="merged", dtype="fp32", gate_n=0)
    figures = {}
    for quant, minimum in (("f16", 0.98), ("q8_0", 0.95)):
        export(run, tmp_path / quant, fmt="gguf", quant=quant, gate_n=0)
        report = run_gate(
            locate(run),
            "gguf",
            tmp_path / quant / gguf_name(quant),
            n=n,
            quant=quant,
            reference=merged,
            runtime="llama.cpp",
        )
        figures[quant] = {
            k: report[k]
            for k in (
                "greedy_agreement",
                "accuracy_trained",
                "accuracy_export",
                "logprob_mean_abs_delta",
                "logprob_max_abs_delta",
                "prompts",
            )
        }
        print(quant, json.dumps(figures[quant]))
        assert report["prompts"] == n
        if trained or quant == "f16":
            assert report["greedy_agreement"] >= minimum
            assert abs(report["accuracy_delta"]) <= 0.02
        else:
            assert report["logprob_mean_abs_delta"] <= 0.05 and report["greedy_agreement"] >= 0.4
