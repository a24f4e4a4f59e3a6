"""Build ``.whl/``: what the GPU check carries to a GPU box that cannot download (``make gpu-wheels``).

The box (the device tool's ``nvidia-h200`` kind) has Python 3.12, torch with CUDA, transformers, peft, accelerate,
nvidia-ml-py, psutil, safetensors, tokenizers and rich, but not textual or tomli-w. This writes, into ``.whl/``
(ignored by git; about 46 MiB with bitsandbytes, under the 64 MiB a device call may carry):

- pure-Python wheels of textual, tomli-w and what textual needs, at the versions installed in this venv (the ones the
  tests ran with), so the box imports exactly what was tested here: :data:`WHEELS`;
- bitsandbytes' manylinux x86_64 wheel (its CUDA kernels inside; about 41 MiB, the QLoRA cell needs it), at the
  version installed here, unless ``--no-bitsandbytes``: :data:`PLATFORM_WHEELS`;
- ``smollm2/``: the embedded SmolLM2-135M's config and tokenizer files (no weights: the check builds random weights of
  the right shapes there), taken from the converted embedded model (``core.models.ensure_embedded_cache``).

Usage: ``python benchmarks/gpu_wheels.py [--dest .whl]``. Raises ``SystemExit`` naming the package pip could not fetch.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

#: textual and its requirements (textual 8.2: markdown-it-py[linkify], mdit-py-plugins, platformdirs, pygments, rich,
#: typing-extensions; the box's typing-extensions is new enough), tomli-w (core.record.build writes TOML with it). All pure
#: Python: one wheel serves any CPython 3.
WHEELS = ("textual", "rich", "markdown-it-py", "mdurl", "mdit-py-plugins", "linkify-it-py", "platformdirs", "pygments",
          "tomli-w")
#: platform wheels (``py3-none-manylinux``): one wheel serves any CPython 3 on x86_64 Linux
PLATFORM_WHEELS = ("bitsandbytes",)
PLATFORM = "manylinux_2_24_x86_64"
#: the embedded model's files that travel (config, tokenizer); the weights never do
MODEL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "chat_template.jinja")


def pinned() -> list[str]:
    """``name==version`` of each of :data:`WHEELS` as installed here (a missing one fails loudly)."""
    return [f"{name}=={importlib.metadata.version(name)}" for name in WHEELS]


def download(dest: Path, platform_wheels: bool = True) -> list[Path]:
    dest.mkdir(parents=True, exist_ok=True)
    for old in dest.glob("*.whl"):
        old.unlink()
    base = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
            "--python-version", "3.12", "-d", str(dest)]
    commands = [[*base, "--implementation", "py", *pinned()]]
    if platform_wheels:
        commands.append([*base, "--platform", PLATFORM,
                         *(f"{name}=={importlib.metadata.version(name)}" for name in PLATFORM_WHEELS)])
    for cmd in commands:
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"gpu-wheels: pip download failed:\n{done.stderr.strip()}")
    return sorted(dest.glob("*.whl"))


def model_files(dest: Path) -> Path:
    from core.models import ensure_embedded_cache

    src, out = ensure_embedded_cache(), dest / "smollm2"
    out.mkdir(parents=True, exist_ok=True)
    for name in MODEL_FILES:
        if (src / name).exists():
            shutil.copy2(src / name, out / name)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dest", default=str(ROOT / ".whl"))
    parser.add_argument("--no-bitsandbytes", action="store_true",
                        help="pure-Python wheels only (the QLoRA cell then reports bitsandbytes missing)")
    args = parser.parse_args(argv)
    dest = Path(args.dest)
    wheels = download(dest, platform_wheels=not args.no_bitsandbytes)
    files = model_files(dest)
    size = sum(p.stat().st_size for p in dest.rglob("*") if p.is_file())
    print(f"{len(wheels)} wheels and {files.name}/ in {dest}: {size / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
