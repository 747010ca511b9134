"""Several processes on one model-cache folder at once (two servers, a server and a test, the
ranks of a tensor-parallel load, an engine core and its restart): the first conversion of a
.gguf, a lean folder's completion with the float weights it left out, a writer killed halfway.
Every process reads a whole checkpoint, each tensor once, and nothing is left behind."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from collections import Counter
from pathlib import Path

import pytest
from safetensors import safe_open

from inferengine.checkpoint.gguf import convert_gguf
from inferengine.model.loader.gguf_floats import DENSE_FILE, INDEX_FILE, ensure_float_weights
from inferengine.model.weights import safetensors_files
from tests.model.loader.test_gguf_quantized import _tiny_gguf

# (seconds before it starts, extra seconds its conversion takes) of each process: the first
# converts slowly; the others come while it converts, the last ones after another has finished.
TIMING = ((0.0, 2.0), (0.2, 0.2), (0.4, 0.2), (1.5, 0.2))
_CTX = mp.get_context("fork")  # no re-import per process on a small machine


def _names(folder: Path, pause: float = 0.0) -> Counter:
    """Each checkpoint name, counted over the files a load of `folder` reads (`pause` seconds
    after listing them: a real load takes its time)."""
    counts: Counter = Counter()
    files = safetensors_files(folder)
    time.sleep(pause)
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            counts.update(f.keys())
    return counts


def _slowed(module, name: str, seconds: float) -> None:
    """`module.name` takes `seconds` longer (half before, half after), as it does on a real
    model's weights."""
    fn = getattr(module, name)

    def slow(*args, **kwargs):
        time.sleep(seconds / 2)
        out = fn(*args, **kwargs)
        time.sleep(seconds / 2)
        return out

    setattr(module, name, slow)


def _logged(module, name: str, log: Path) -> None:
    """`module.name` (a writer) appends its name to `log` when called."""
    fn = getattr(module, name)

    def logged(*args, **kwargs):
        with open(log, "a") as f:
            f.write(name + "\n")
        return fn(*args, **kwargs)

    setattr(module, name, logged)


def _serve(gguf_path: str, cache: str, expected: set, timing: tuple, start, out) -> None:
    """A server's start, three times: resolve the .gguf (converted on first use), complete the
    folder as a load that reads floats does, read every tensor name. `timing`: seconds before
    it starts, and its conversion's extra seconds (a slower machine, a bigger model)."""
    os.environ["INFERENGINE_CACHE_DIR"] = cache
    from inferengine.checkpoint import gguf
    from inferengine.checkpoint.resolve import resolve_model
    from inferengine.model.loader import gguf_floats

    delay, convert_pause = timing
    _slowed(gguf, "_write_weights", convert_pause)
    _slowed(gguf_floats, "_write_weights", 0.6)
    _logged(gguf, "convert_gguf", Path(cache).parent / "writes.log")
    _logged(gguf_floats, "_write_dense", Path(cache).parent / "writes.log")
    errors = []
    start.wait(timeout=120)
    time.sleep(delay)  # the servers come up one after another
    for _ in range(3):
        try:
            folder = resolve_model(gguf_path).path
            ensure_float_weights(folder)
            names = _names(folder, pause=0.1)
            if set(names) != expected or max(names.values()) > 1:
                errors.append(f"read {len(names)} names, {sum(names.values())} tensors")
        except Exception as e:
            errors.append(f"{type(e).__name__}: {e}")
    out.put(errors)


def _read(folder: str, stop, out) -> None:
    """A reader that loops over the folder meanwhile (the quantized path: no completion)."""
    errors, reads = [], 0
    while not stop.is_set():
        if not (Path(folder) / "config.json").exists():
            time.sleep(0.01)  # not converted yet
            continue
        try:
            names = _names(Path(folder), pause=0.05)
            reads += 1
            if max(names.values()) > 1:
                errors.append("a tensor read twice")
        except Exception as e:
            errors.append(f"reader: {type(e).__name__}: {e}")
    out.put(errors if reads else ["the reader never found the folder"])


def _leftovers(cache: Path) -> list[str]:
    """Temporary files and folders anywhere under `cache`."""
    return sorted(
        str(p.relative_to(cache))
        for p in cache.rglob("*")
        if ".tmp" in p.name or ".old-" in p.name or ".download-" in p.name
    )


def test_processes_converting_and_completing_one_gguf_at_once(tiny_llama, tmp_path):
    gguf_path = _tiny_gguf(tiny_llama, tmp_path, "untied")
    expected = set(_names(convert_gguf(gguf_path, tmp_path / "full")))
    cache = tmp_path / "cache"
    out_dir = _cache_folder(gguf_path, cache)
    start, stop, out = _CTX.Barrier(len(TIMING)), _CTX.Event(), _CTX.Queue()
    reader = _CTX.Process(target=_read, args=(str(out_dir), stop, out))
    servers = [
        _CTX.Process(target=_serve, args=(str(gguf_path), str(cache), expected, t, start, out))
        for t in TIMING
    ]
    reader.start()
    for p in servers:
        p.start()
    errors = [out.get(timeout=300) for _ in servers]
    stop.set()
    errors.append(out.get(timeout=60))
    for p in [*servers, reader]:
        p.join(timeout=60)
    failed = [e for each in errors for e in each]
    assert not failed, "\n".join(failed)
    assert all(p.exitcode == 0 for p in servers)
    names = _names(out_dir)
    assert set(names) == expected and max(names.values()) == 1
    assert (out_dir / INDEX_FILE).exists()
    assert _leftovers(cache) == []
    writes = (tmp_path / "writes.log").read_text().split()
    assert sorted(writes) == ["_write_dense", "convert_gguf"]  # each once


def _cache_folder(gguf_path: Path, cache: Path) -> Path:
    """Where the model cache `cache` converts `gguf_path` (resolve.py's key)."""
    import hashlib

    stat = gguf_path.stat()
    key = f"{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return cache / "gguf" / f"{gguf_path.stem}-{digest}"


def _die_writing(folder: str) -> None:
    """Complete `folder`, killed (SIGKILL: no cleanup runs) halfway through the float file."""
    from inferengine.model.loader import gguf_floats

    def write_half(path, *args, **kwargs):
        Path(path).write_bytes(b"\0" * 4096)
        os.kill(os.getpid(), signal.SIGKILL)

    gguf_floats._write_weights = write_half
    ensure_float_weights(Path(folder))


def _complete(folder: str) -> None:
    ensure_float_weights(Path(folder))


def test_a_writer_killed_halfway_blocks_no_one_and_leaves_nothing(tiny_llama, tmp_path):
    gguf_path = _tiny_gguf(tiny_llama, tmp_path, "untied")
    expected = set(_names(convert_gguf(gguf_path, tmp_path / "full")))
    lean = convert_gguf(gguf_path, tmp_path / "cache" / "lean", lean=True)
    killed = _CTX.Process(target=_die_writing, args=(str(lean),))
    killed.start()
    killed.join(timeout=120)
    assert killed.exitcode == -signal.SIGKILL
    assert not (lean / DENSE_FILE).exists()
    after = _CTX.Process(target=_complete, args=(str(lean),))  # in a process: a hang fails
    after.start()
    after.join(timeout=120)
    if after.exitcode is None:
        after.kill()
        pytest.fail("the completion after a killed writer hangs")
    assert after.exitcode == 0
    names = _names(lean)
    assert set(names) == expected and max(names.values()) == 1
    assert _leftovers(tmp_path / "cache") == []


def test_a_full_folder_with_a_stray_dense_copy_reads_each_tensor_once(tiny_llama, tmp_path):
    """What a failed completion left in a folder converted whole (model.safetensors, before the
    lean conversion): model-dense.safetensors with the same tensors, and no index."""
    gguf_path = _tiny_gguf(tiny_llama, tmp_path, "untied")
    full = convert_gguf(gguf_path, tmp_path / "cache" / "full")
    expected = set(_names(full))
    (full / DENSE_FILE).write_bytes((full / "model.safetensors").read_bytes())
    ensure_float_weights(full)
    names = _names(full)
    assert set(names) == expected and max(names.values()) == 1
    assert not (full / DENSE_FILE).exists()
    ensure_float_weights(full)  # settled: nothing more to do
    assert _names(full) == names


def _die_converting(gguf_path: str, cache: str) -> None:
    """Convert `gguf_path` into the model cache, killed halfway through."""
    os.environ["INFERENGINE_CACHE_DIR"] = cache
    from inferengine.checkpoint import gguf
    from inferengine.checkpoint.resolve import resolve_model

    def die(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGKILL)

    gguf._write_tokenizer = die
    resolve_model(gguf_path)


def test_a_conversion_killed_halfway_is_done_again_and_its_folder_deleted(
    tiny_llama, tmp_path, monkeypatch
):
    from inferengine.checkpoint.resolve import resolve_model

    gguf_path = _tiny_gguf(tiny_llama, tmp_path, "untied")
    cache = tmp_path / "cache"
    killed = _CTX.Process(target=_die_converting, args=(str(gguf_path), str(cache)))
    killed.start()
    killed.join(timeout=120)
    assert killed.exitcode == -signal.SIGKILL
    assert _leftovers(cache) != []  # its temporary folder
    monkeypatch.setenv("INFERENGINE_CACHE_DIR", str(cache))
    folder = resolve_model(str(gguf_path)).path
    assert folder == _cache_folder(gguf_path, cache) and (folder / "config.json").exists()
    assert _leftovers(cache) == []
