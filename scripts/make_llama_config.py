"""Write a Llama config folder (config.json only) for serving with `--load-format dummy`.

    python scripts/make_llama_config.py --preset llama-3.1-8b --out models/llama-3.1-8b-dummy

Use with SGLang's `--load-format dummy --skip-tokenizer-init` and `input_ids` requests.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

PRESETS = {
    # Llama-3.1-8B-Instruct's architecture (public config values)
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=131072,
                         rope_theta=500000.0, rms_norm_eps=1e-5,
                         rope_scaling={"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 8192, "rope_type": "llama3"}),
    # two layers of it: fast to start, same attention shapes
    "llama-3.1-8b-2layer": None,
}


def config(preset: str, layers: int | None = None) -> dict:
    base = dict(PRESETS["llama-3.1-8b"])
    if preset == "llama-3.1-8b-2layer":
        base["num_hidden_layers"] = 2
    if layers is not None:
        base["num_hidden_layers"] = layers
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
            "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
            "bos_token_id": 128000, "eos_token_id": 128009, **base}


QWEN_05B = {
    # Qwen2.5-Coder-0.5B-Instruct's architecture (public config values; ../shared/MODELS.md)
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu", "hidden_size": 896,
    "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
    "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "vocab_size": 151936,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 151643, "eos_token_id": 151645,
    "sliding_window": 32768, "use_sliding_window": False, "max_window_layers": 24,
}


def write_model_dir(path: str | Path, preset: str = "llama-3.1-8b", layers: int | None = None) -> Path:
    """A folder holding only config.json, for `--load-format dummy --skip-tokenizer-init`."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    cfg = dict(QWEN_05B, **({"num_hidden_layers": layers} if layers else {})) if preset == "qwen2.5-0.5b" \
        else config(preset, layers)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=sorted(PRESETS) + ["qwen2.5-0.5b"], default="llama-3.1-8b")
    ap.add_argument("--layers", type=int, default=None, help="override the layer count")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    print(write_model_dir(a.out, a.preset, a.layers) / "config.json")


if __name__ == "__main__":
    main()
