"""The released verl and OpenRLHF packages the hand-off tests check against, fetched once into a cache.

``engine_site(pins)`` runs ``pip download --no-deps`` for the pinned releases (and the small pure-Python packages
their config code imports: Hydra, OmegaConf and its ANTLR runtime, codetiming, pylatexenc) into
``$LORARL_CACHE/engine-wheels/downloads`` and unpacks them into one folder for a subprocess's ``PYTHONPATH``
(``engine-wheels/site-<hash of the pins>``, reused while the pins are the same). Nothing is installed into the
environment running the tests. A failed download raises ``EngineFetchError`` with pip's message.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

# what verl's / OpenRLHF's config and CLI modules import beyond lorarl's own dependencies (versions a fresh
# `pip install verl` resolves to: hydra-core pins omegaconf < 2.4, which pins antlr4 4.9.*)
CONFIG_DEPS = (
    "hydra-core==1.3.8",
    "omegaconf==2.3.1",
    "antlr4-python3-runtime==4.9.3",
    "codetiming==1.4.0",
    "pylatexenc==2.11",
)


class EngineFetchError(RuntimeError):
    pass


def cache_root() -> Path:
    return Path(os.environ.get("LORARL_CACHE", Path.home() / ".cache" / "lorarl")).expanduser() / "engine-wheels"


def _download(pins: list[str], dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-d", str(dest)]
    proc = subprocess.run([*cmd, *pins], capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise EngineFetchError(
            f"pip download --no-deps {' '.join(pins)} failed (is the package registry reachable?): {' | '.join(tail)}"
        )


def _unpack(archive: Path, site: Path) -> None:
    """A wheel (``*.data/purelib`` moved to the top, as pip installs it) or an sdist's ``src/<package>``."""
    if archive.suffix == ".whl":
        with zipfile.ZipFile(archive) as z:
            z.extractall(site)
        for data in site.glob("*.data"):
            for lib in ("purelib", "platlib"):
                for item in (data / lib).glob("*") if (data / lib).is_dir() else []:
                    shutil.move(str(item), site / item.name)
            shutil.rmtree(data)
        return
    with tempfile.TemporaryDirectory() as tmp, tarfile.open(archive) as t:
        t.extractall(tmp, filter="data")
        src = next(Path(tmp).glob("*/src"))
        for item in src.iterdir():
            if item.is_dir() and not item.name.endswith(".egg-info"):
                shutil.copytree(item, site / item.name)


def _archive(downloads: Path, pin: str) -> Path:
    name, version = pin.split("==")
    stem = name.replace("-", "_").lower()
    for f in downloads.iterdir():
        low = f.name.lower().replace("-", "_")
        if low.startswith(f"{stem}_{version}") and (f.suffix == ".whl" or f.name.endswith(".tar.gz")):
            return f
    raise EngineFetchError(f"{pin}: no archive in {downloads} after pip download")


def engine_site(pins: list[str]) -> Path:
    """The unpacked packages of ``pins`` (plus CONFIG_DEPS), downloading what the cache lacks."""
    pins = sorted([*pins, *CONFIG_DEPS])
    root = cache_root()
    site = root / ("site-" + hashlib.sha256("\n".join(pins).encode()).hexdigest()[:16])
    if (site / ".complete").is_file():
        return site
    downloads = root / "downloads"
    missing = []
    for pin in pins:
        try:
            _archive(downloads, pin)
        except (EngineFetchError, FileNotFoundError):
            missing.append(pin)
    if missing:
        _download(missing, downloads)
    tmp = Path(tempfile.mkdtemp(prefix=".site-", dir=root))
    try:
        for pin in pins:
            _unpack(_archive(downloads, pin), tmp)
        (tmp / ".complete").write_text("\n".join(pins) + "\n")
        if site.exists():  # another session finished first
            shutil.rmtree(tmp)
        else:
            try:
                os.replace(tmp, site)
            except OSError:  # another process (a parallel test worker) finished between the check and here
                if not site.exists():
                    raise
                shutil.rmtree(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return site
