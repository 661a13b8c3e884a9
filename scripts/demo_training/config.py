"""The demo model's fixed recipe: the seed, the tokenizer's size, special tokens and
pre-tokenization, and the ``Glm4MoeForCausalLM`` config (``max_position_embeddings`` is set
from ``--context`` at start, ``rope_parameters`` from ``--rope-yarn``)."""

from __future__ import annotations

SEED = 1234
SPECIAL_TOKENS = [
    "<|endoftext|>",
    "[gMASK]",
    "<sop>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|observation|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<arg_key>",
    "</arg_key>",
    "<arg_value>",
    "</arg_value>",
    "<tool_response>",
    "</tool_response>",
]
EOS_TOKENS = ["<|endoftext|>", "<|user|>", "<|observation|>"]
VOCAB_SIZE = 1536
# Letter runs, single digits and runs of anything else (spaces, punctuation) are separate
# pre-tokens, so a word is the same tokens after a space as after a '>' (a city copied into
# <arg_value> keeps its tokens) and every number is spelled one digit per token.
PRETOKEN_PATTERN = r"\p{L}+|\p{N}|[^\p{L}\p{N}]+"

CONFIG = {
    "architectures": ["Glm4MoeForCausalLM"],
    "model_type": "glm4_moe",
    "hidden_size": 192,
    "num_hidden_layers": 4,
    "num_attention_heads": 6,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "routed_scaling_factor": 1.0,
    "norm_topk_prob": True,
    "attention_bias": True,
    "use_qk_norm": False,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 2048,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.5,
    },
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "initializer_range": 0.02,
    "num_mtp_layers": 0,
}


def rope_yarn(factor: float, original: int, attention_factor: float | None = None) -> dict:
    """The config's ``rope_parameters`` for YaRN scaling by ``factor`` over ``original``
    positions (the recipe's theta and partial rotary factor kept)."""
    out = {
        **CONFIG["rope_parameters"],
        "rope_type": "yarn",
        "factor": float(factor),
        "original_max_position_embeddings": int(original),
    }
    if attention_factor is not None:
        out["attention_factor"] = float(attention_factor)
    return out
