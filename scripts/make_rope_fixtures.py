#!/usr/bin/env python3
"""Reference RoPE frequencies and rotations for the scaled RoPE types colibri reads.

For each case, a config (as a checkpoint's config.json holds it) goes through transformers'
own config class and ``ROPE_INIT_FUNCTIONS`` (modeling_rope_utils); the inverse frequencies,
the attention factor, and cos/sin at a few positions (f32, as the models' rotary embedding
computes them) are written to tests/fixtures/rope/cases.json. The engine's unit tests compare
against them (crates/engine/src/ops.rs).

Then whole models: the committed qwen3_moe and glm4_moe reference checkpoints with a scaled
RoPE in their config, run by transformers on a 120-token prompt; the logits go to
tests/fixtures/rope/<case>.npz with the RoPE parameters used (tests/test_rope_models.py).

Needs torch and transformers (a throwaway venv outside the repository):

    python scripts/make_rope_fixtures.py
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers
from transformers import Glm4MoeConfig, Qwen3MoeConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "rope" / "cases.json"
POSITIONS = [0, 1, 7, 100, 4095, 5000, 40000, 131071]

QWEN = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "hidden_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "vocab_size": 100,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "rope_theta": 1000000.0,
    "max_position_embeddings": 131072,
}
GLM = {
    "architectures": ["Glm4MoeForCausalLM"],
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 96,
    "vocab_size": 100,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "partial_rotary_factor": 0.5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 65536,
}

CASES = {
    # Qwen3's model cards: YaRN x4 over a 32k pretraining context.
    "qwen_yarn_old_style": {
        **QWEN,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 32768,
        },
    },
    "qwen_yarn_parameters": {
        **{k: v for k, v in QWEN.items() if k != "rope_theta"},
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 1000000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 32768,
            "beta_fast": 16,
            "beta_slow": 2,
            "truncate": False,
        },
    },
    # DeepSeek-V3 style: no factor (max / original), mscale terms for the attention factor.
    "qwen_yarn_mscale_no_factor": {
        **QWEN,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": None,
            "original_max_position_embeddings": 4096,
            "mscale": 1.0,
            "mscale_all_dim": 0.707,
        },
    },
    "qwen_yarn_attention_factor": {
        **QWEN,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 8.0,
            "original_max_position_embeddings": 16384,
            "attention_factor": 1.25,
        },
    },
    "glm_partial_linear": {**GLM, "rope_scaling": {"rope_type": "linear", "factor": 2.0}},
    "glm_partial_yarn": {
        **GLM,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 2.0,
            "original_max_position_embeddings": 32768,
        },
    },
}


def reference(config: dict) -> dict:
    cls = Qwen3MoeConfig if config["architectures"][0].startswith("Qwen3") else Glm4MoeConfig
    fields = {k: v for k, v in config.items() if k != "architectures"}
    cfg = cls(**fields)
    kind = cfg.rope_parameters["rope_type"]
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[kind](cfg, torch.device("cpu"))
    pos = torch.tensor(POSITIONS, dtype=torch.float32)
    freqs = pos[:, None] @ inv_freq.float()[None, :]  # as the rotary embedding's f32 matmul
    return {
        "rope_type": kind,
        "inv_freq": inv_freq.float().tolist(),
        "attention_factor": float(attention_factor),
        "positions": POSITIONS,
        "cos": (freqs.cos() * attention_factor).tolist(),
        "sin": (freqs.sin() * attention_factor).tolist(),
    }


FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "fixtures"
MODEL_CASES = {
    # Positions past the (pretend) pretraining length of 32, where YaRN's ramp matters.
    "qwen3_moe_yarn": (
        "qwen3_moe",
        {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    ),
    "glm4_moe_linear": (
        "glm4_moe",
        {
            "rope_type": "linear",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5,
            "factor": 3.0,
        },
    ),
}


def model_case(arch: str, rope: dict) -> dict:
    import numpy as np
    from transformers import AutoConfig, AutoModelForCausalLM

    hf = FIXTURES / arch / "hf"
    config = AutoConfig.from_pretrained(hf)
    config.rope_parameters = dict(rope)
    model = AutoModelForCausalLM.from_pretrained(hf, config=config, dtype=torch.float32)
    model.eval()
    vocab = config.vocab_size
    prompt = [(i * 37 + 11) % vocab for i in range(120)]
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0].float().numpy()
    return {"prompt": np.array(prompt, dtype=np.int64), "logits": logits.astype(np.float32)}


def main() -> None:
    out = {
        "generator": f"scripts/make_rope_fixtures.py, transformers {transformers.__version__}, "
        f"torch {torch.__version__}",
        "cases": {name: {"config": cfg, **reference(cfg)} for name, cfg in CASES.items()},
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {OUT} ({len(CASES)} cases)")
    import numpy as np

    for name, (arch, rope) in MODEL_CASES.items():
        data = model_case(arch, rope)
        path = OUT.parent / f"{name}.npz"
        np.savez_compressed(path, rope=json.dumps(rope), arch=arch, **data)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
