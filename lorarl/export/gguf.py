"""``--format gguf``: the merged full-precision model converted by llama.cpp's own converter into one GGUF file.

Steps (:func:`write_gguf`): the policy LoRA is merged into the base reloaded in fp32 (:mod:`.merged`; never into NF4
weights) and saved into a scratch folder inside the staging folder; llama.cpp's ``convert_hf_to_gguf.py`` turns it
into ``model-<quant>.gguf`` (``f16``, ``bf16``, ``q8_0`` directly; for ``q4_k_m`` an f16 GGUF first, then llama.cpp's
quantizer); the scratch folder is removed. The converter writes the tokenizer (``tokenizer.ggml.*``) and the chat
template (``tokenizer.chat_template``) into the file's metadata.

Why llama.cpp's converter and not a hand-written tensor mapping: it is the maintained reference for every
architecture llama.cpp runs (tensor names, RoPE layout permutations, tokenizer pre-processing hashes), and it ships
with the ``gguf-py`` it was written against. lorarl runs it as a subprocess from a pinned source tree:

1. ``$LORARL_LLAMA_CPP``: a llama.cpp checkout (``convert_hf_to_gguf.py``, ``conversion/``, ``gguf-py/``), if set;
2. else ``$LORARL_CACHE/llama.cpp/llama-cpp-python-<version>/``: the converter extracted once from the
   llama-cpp-python source package (``vendor/llama.cpp``), found in ``$LORARL_CACHE/sdist/`` or fetched there once
   with ``pip download --no-deps --no-binary :all: llama-cpp-python==<version>`` (offline: copy the ``.tar.gz`` there).

The converter imports the ``gguf-py`` beside it, not the ``gguf`` package lorarl depends on: the PyPI ``gguf`` and a
converter's tree can differ even at the same version number, and a converter only works with its own.

``q4_k_m`` needs llama.cpp's quantizer, which the Python tooling cannot do: ``llama-quantize`` on ``PATH`` (or
``$LORARL_LLAMA_QUANTIZE``), else ``llama_model_quantize`` from an installed ``llama-cpp-python`` (the same library
that runs the GGUF). Without either, the export stops before any work with a line saying what to install.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

from lorarl.errors import LorarlError
from lorarl.export.source import RunSource
from lorarl.export.writing import staging_folder

LLAMA_CPP_PYTHON_VERSION = (
    "0.3.36"  # the llama-cpp-python source package whose vendored llama.cpp converter lorarl runs
)
QUANTS = ("f16", "bf16", "q8_0", "q4_k_m")
CONVERTER_TYPES = ("f16", "bf16", "q8_0")  # what convert_hf_to_gguf.py writes itself
# Architectures lorarl's model list supports -> llama.cpp's architecture name in the GGUF (Mistral runs as llama).
ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}
# The files of the llama.cpp tree the converter needs (members under vendor/llama.cpp/ in the sdist).
CONVERTER_PARTS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/", "models/templates/", "LICENSE")
LLAMA_FTYPE_MOSTLY_Q4_K_M = 15  # llama.h's enum llama_ftype
INSTALL_HINT = (
    f"pip install llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION} (builds llama.cpp from source: needs cmake and a C++ "
    "compiler), or put llama.cpp's llama-quantize on PATH"
)


def gguf_name(quant: str) -> str:
    """The GGUF file's name inside the export folder."""
    return f"model-{quant}.gguf"


def model_name(src: RunSource) -> str:
    """``general.name`` of the GGUF: ``lorarl <algo> <run directory name>``."""
    algo = src.recipe.algo if src.recipe is not None else "policy"
    return f"lorarl {algo} {(src.run_dir or src.adapter_dir).name}"


def check_quant(quant: str) -> None:
    """An unknown ``--quant`` is a LorarlError; so is ``q4_k_m`` without a quantize tool (checked before any work)."""
    if quant not in QUANTS:
        raise LorarlError(f"--quant must be one of {', '.join(QUANTS)}, got {quant!r}")
    if quant not in CONVERTER_TYPES:
        quantize_tool()


def check_architecture(base_path: str) -> str:
    """The base's architecture (``config.json``'s ``architectures[0]``) if GGUF export supports it, else a
    LorarlError naming it and what is supported."""
    cfg_file = Path(base_path) / "config.json"
    if not cfg_file.is_file():
        from transformers import AutoConfig

        try:
            archs = AutoConfig.from_pretrained(base_path).architectures or []
        except OSError as e:
            raise LorarlError(f"base model {base_path}: cannot read its config ({e})") from None
    else:
        archs = json.loads(cfg_file.read_text()).get("architectures") or []
    arch = archs[0] if archs else "(none in config.json)"
    if arch not in ARCHITECTURES:
        raise LorarlError(
            f"base model {base_path}: architecture {arch} is not supported by --format gguf "
            f"(supported: {', '.join(sorted(ARCHITECTURES))}); export --format merged and convert it yourself"
        )
    return arch


def check_dependencies() -> None:
    """The converter's imports that lorarl does not install itself (the ``gguf`` extra)."""
    if importlib.util.find_spec("sentencepiece") is None:
        raise LorarlError(
            "--format gguf needs sentencepiece (llama.cpp's converter imports it): pip install sentencepiece"
        )


# ---- the converter ------------------------------------------------------------------------------------------------


def _cache() -> Path:
    from lorarl.model.registry import cache_dir

    return cache_dir()


def _is_converter_tree(folder: Path) -> bool:
    return (folder / "convert_hf_to_gguf.py").is_file() and (folder / "gguf-py" / "gguf").is_dir()


def _find_sdist(folder: Path) -> Path | None:
    name = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz"
    return folder / name if (folder / name).is_file() else None


def _download_sdist(folder: Path) -> Path:
    """``pip download`` the pinned llama-cpp-python source package into ``folder`` (once; needs the network)."""
    folder.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d", str(folder)]
    cmd.append(f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}")
    proc = subprocess.run(cmd, capture_output=True, text=True)
    sdist = _find_sdist(folder)
    if proc.returncode != 0 or sdist is None:
        raise LorarlError(
            f"--format gguf needs llama.cpp's converter from the llama-cpp-python {LLAMA_CPP_PYTHON_VERSION} source "
            f"package, and `pip download` could not fetch it (offline?): copy "
            f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz into {folder}/ or set LORARL_LLAMA_CPP to a llama.cpp "
            "checkout"
        )
    return sdist


def _extract_converter(sdist: Path, dest: Path) -> None:
    """Extract the converter's parts of ``vendor/llama.cpp`` from the sdist into ``dest`` (atomically)."""
    root = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}/vendor/llama.cpp/"
    with staging_folder(dest, force=True) as tmp, tarfile.open(sdist) as tar:
        members = []
        for m in tar.getmembers():
            rel = m.name[len(root) :] if m.name.startswith(root) else None
            if rel and (m.isfile() or m.isdir()) and any(rel == p or rel.startswith(p) for p in CONVERTER_PARTS):
                m.name = rel
                members.append(m)
        safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}  # Python >= 3.10.12 / 3.11.4
        tar.extractall(tmp, members=members, **safe)
        if not _is_converter_tree(tmp):
            raise LorarlError(f"{sdist}: holds no vendor/llama.cpp/convert_hf_to_gguf.py and gguf-py")


def converter_dir(fetch: bool = True) -> Path:
    """The llama.cpp tree holding ``convert_hf_to_gguf.py`` (see the module docstring for where it comes from)."""
    env = os.environ.get("LORARL_LLAMA_CPP")
    if env:
        folder = Path(env).expanduser()
        if not _is_converter_tree(folder):
            raise LorarlError(f"LORARL_LLAMA_CPP={env}: not a llama.cpp tree (no convert_hf_to_gguf.py and gguf-py/)")
        return folder
    dest = _cache() / "llama.cpp" / f"llama-cpp-python-{LLAMA_CPP_PYTHON_VERSION}"
    if _is_converter_tree(dest):
        return dest
    sdists = _cache() / "sdist"
    sdist = _find_sdist(sdists)
    if sdist is None:
        if not fetch:
            raise LorarlError(f"llama.cpp's converter is not cached in {dest}")
        sdist = _download_sdist(sdists)
    _extract_converter(sdist, dest)
    return dest


def _run(cmd: list[str], what: str, env: dict | None = None) -> None:
    """Run a tool; a failure is a LorarlError quoting the last line of its output."""
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        lines = [ln for ln in (proc.stderr + proc.stdout).splitlines() if ln.strip()]
        raise LorarlError(f"{what} failed (exit {proc.returncode}): {lines[-1] if lines else 'no output'}")


def convert(model_dir: Path, out_file: Path, outtype: str, name: str | None = None) -> None:
    """``convert_hf_to_gguf.py model_dir --outfile out_file --outtype outtype [--model-name name]`` with the
    converter's own gguf-py."""
    tree = converter_dir()
    env = dict(os.environ)
    env.pop("NO_LOCAL_GGUF", None)  # the converter must import the gguf-py beside it
    cmd = [sys.executable, str(tree / "convert_hf_to_gguf.py"), str(model_dir), "--outfile", str(out_file)]
    cmd += ["--outtype", outtype] + (["--model-name", name] if name else [])
    _run(cmd, f"llama.cpp's converter ({tree / 'convert_hf_to_gguf.py'})", env)


# ---- the quantizer ------------------------------------------------------------------------------------------------

_QUANTIZE_WITH_BINDING = """
import ctypes, sys
import llama_cpp
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = int(sys.argv[3])
params.nthread = int(sys.argv[4])
rc = llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), ctypes.byref(params))
sys.exit(1 if rc else 0)
"""


def quantize_tool() -> tuple[str, str]:
    """``("binary", path)`` for llama.cpp's ``llama-quantize``, else ``("llama-cpp-python", version)``; a
    LorarlError saying what to install when there is neither."""
    path = os.environ.get("LORARL_LLAMA_QUANTIZE") or shutil.which("llama-quantize")
    if path:
        return "binary", path
    if importlib.util.find_spec("llama_cpp") is not None:
        from importlib.metadata import PackageNotFoundError, version

        try:
            return "llama-cpp-python", version("llama_cpp_python")
        except PackageNotFoundError:
            return "llama-cpp-python", "unknown"
    raise LorarlError(f"--quant q4_k_m needs llama.cpp's quantize tool, and none is installed: {INSTALL_HINT}")


def quantize(src: Path, dst: Path, quant: str) -> str:
    """Quantize a 16-bit GGUF to ``quant`` (``q4_k_m``) with llama.cpp; returns which tool did it."""
    kind, where = quantize_tool()
    threads = str(max(1, min(os.cpu_count() or 1, 16)))
    if kind == "binary":
        _run([where, str(src), str(dst), quant.upper(), threads], f"llama-quantize ({where})")
        return f"llama-quantize ({where})"
    cmd = [sys.executable, "-c", _QUANTIZE_WITH_BINDING, str(src), str(dst), str(LLAMA_FTYPE_MOSTLY_Q4_K_M), threads]
    _run(cmd, "llama_model_quantize (llama-cpp-python)")
    return f"llama_model_quantize (llama-cpp-python {where})"


# ---- the export ---------------------------------------------------------------------------------------------------


def write_gguf(src: RunSource, folder: Path, quant: str, dtype: str | None = None) -> dict:
    """The merged model as ``folder/model-<quant>.gguf`` (and the Ollama Modelfile beside it).

    The merge is saved in ``dtype`` (default fp32) into a scratch folder inside ``folder``, converted, and removed.
    Returns ``{"gguf": path, "quant", "converter", "quantizer", "notes", ...}`` for the card and the gate.
    """
    from lorarl.export.merged import write_merged
    from lorarl.export.ollama import write_modelfile

    check_quant(quant)
    check_dependencies()
    arch = check_architecture(src.base_path)
    tree = converter_dir()
    scratch = folder / ".merged"
    out = folder / gguf_name(quant)
    info: dict = {"quant": quant, "architecture": arch, "converter": str(tree / "convert_hf_to_gguf.py")}
    try:
        info["notes"] = write_merged(src, scratch, dtype or "fp32")["notes"]
        if quant in CONVERTER_TYPES:
            convert(scratch, out, quant, model_name(src))
            info["quantizer"] = None
        else:
            f16 = folder / ".model-f16.gguf"
            convert(scratch, f16, "f16", model_name(src))
            info["quantizer"] = quantize(f16, out, quant)
            f16.unlink()
        info["modelfile"] = write_modelfile(folder, out.name, scratch, src)
        info["notes"] += info["modelfile"]["notes"]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    info.update(gguf=str(out), merged_dtype=dtype or "fp32")
    return info


def main(argv: list[str] | None = None) -> int:
    """``python -m lorarl.export.gguf fetch``: fetch and extract llama.cpp's converter now; prints its folder."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args != ["fetch"]:
        print("usage: python -m lorarl.export.gguf fetch", file=sys.stderr)
        return 2
    try:
        print(converter_dir())
    except LorarlError as e:
        print(f"lorarl: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
