"""The models colibri brings: the default one, used when no ``--model`` is given, and the tests'.

The default is the trained demo model shipped in ``model/`` (id ``colibri-demo``). The tests'
model (id ``colibri-builtin``, and the default when the package has no demo model) is a
deterministic tiny GLM-4.5-MoE-shaped checkpoint with random weights and a byte-level tokenizer,
built on first use (no network) and cached. It proves the whole path runs; its words are noise.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np


def builtin_name() -> str:
    """Cache directory name: a digest of the recipe (config, template, seed, code version) and the
    model-directory format it was built for, so a changed recipe or a colibri with a newer format
    builds its own copy instead of loading a stale one."""
    import hashlib

    from colibri._engine import FORMAT_VERSION

    recipe = json.dumps([RECIPE_VERSION, CONFIG, CHAT_TEMPLATE, SPECIAL_TOKENS, SEED])
    digest = hashlib.sha256(recipe.encode()).hexdigest()[:12]
    return f"builtin-random-glm4moe-{digest}-format{FORMAT_VERSION}"


# Bump when the weight or tokenizer recipe changes in code (the digest sees only the data).
RECIPE_VERSION = 3


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
]
# A GLM-4.5-style template (newline style; see docs/FORMATS.md "Chat families"): system, user,
# assistant turns with their think blocks and tool calls, tool results after <|observation|>, and
# thinking switched off by an empty think block in the generation prompt.
CHAT_TEMPLATE = (Path(__file__).parent.parent / "chat" / "templates" / "glm45.jinja").read_text(
    encoding="utf-8"
)
CONFIG = {
    "architectures": ["Glm4MoeForCausalLM"],
    "model_type": "glm4_moe",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
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
}
SEED = 20261130


def cache_dir() -> Path:
    """Where colibri keeps generated models: ``COLI_CACHE_DIR``, else the user cache dir."""
    env = os.environ.get("COLI_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "colibri"


def _tokenizer_json(path: Path) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: i for i, ch in enumerate(_alphabet())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    tok.save(str(path))
    return tok.get_vocab_size()


def _alphabet() -> list[str]:
    from tokenizers import pre_tokenizers

    return sorted(pre_tokenizers.ByteLevel.alphabet())


def _printable_token_ids() -> list[int]:
    """Ids of the byte tokens that print as plain ASCII: '!'..'~' map to themselves in the
    byte-level alphabet, space and newline to 'Ġ' and 'Ċ'."""
    keep = {chr(c) for c in range(0x21, 0x7F)} | {"\u0120", "\u010a"}
    return [i for i, ch in enumerate(_alphabet()) if ch in keep]


def _weights(cfg: dict) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(SEED)
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    hd, nh, nkv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    mi, di, ne = cfg["moe_intermediate_size"], cfg["intermediate_size"], cfg["n_routed_experts"]

    def mat(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    def _printable_head(head: np.ndarray) -> np.ndarray:
        # Only printable ASCII gets a nonzero output row, so the noise it generates is readable.
        out = np.zeros_like(head)
        rows = _printable_token_ids()
        out[rows] = head[rows] * 3.0
        return out

    def vec(n: int, mean: float = 0.0, std: float = 0.1) -> np.ndarray:
        return (mean + std * rng.standard_normal(n)).astype(np.float32)

    w = {
        "model.embed_tokens.weight": mat(v, h),
        "model.norm.weight": vec(h, 1.0),
        "lm_head.weight": _printable_head(mat(v, h)),
    }
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = vec(h, 1.0)
        w[p + "post_attention_layernorm.weight"] = vec(h, 1.0)
        for name, rows in (("q", nh * hd), ("k", nkv * hd), ("v", nkv * hd)):
            w[p + f"self_attn.{name}_proj.weight"] = mat(rows, h)
            w[p + f"self_attn.{name}_proj.bias"] = vec(rows)
        w[p + "self_attn.o_proj.weight"] = mat(h, nh * hd)
        if i < cfg["first_k_dense_replace"]:
            for name, (r, c) in (("gate", (di, h)), ("up", (di, h)), ("down", (h, di))):
                w[p + f"mlp.{name}_proj.weight"] = mat(r, c)
            continue
        w[p + "mlp.gate.weight"] = mat(ne, h)
        w[p + "mlp.gate.e_score_correction_bias"] = vec(ne, 0.0, 0.01)
        for e in range(ne):
            for name, (r, c) in (("gate", (mi, h)), ("up", (mi, h)), ("down", (h, mi))):
                w[p + f"mlp.experts.{e}.{name}_proj.weight"] = mat(r, c)
        for name, (r, c) in (("gate", (mi, h)), ("up", (mi, h)), ("down", (h, mi))):
            w[p + f"mlp.shared_experts.{name}_proj.weight"] = mat(r, c)
    return w


def write_checkpoint(out: Path, **config: Any) -> None:
    """Writes the built-in Hugging Face checkpoint (config, safetensors, tokenizer) to ``out``;
    ``config`` entries replace CONFIG's (another shape of the same recipe, e.g. a map of many
    layers and experts for the dashboard's tests)."""
    from safetensors.numpy import save_file

    out.mkdir(parents=True, exist_ok=True)
    vocab = _tokenizer_json(out / "tokenizer.json")
    cfg = dict(CONFIG, **config, vocab_size=vocab)
    eos = [
        vocab - len(SPECIAL_TOKENS) + SPECIAL_TOKENS.index(t)
        for t in ("<|endoftext|>", "<|user|>", "<|observation|>")
    ]
    cfg["eos_token_id"] = eos
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    (out / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<|endoftext|>", "chat_template": CHAT_TEMPLATE}, indent=2)
    )
    save_file(_weights(cfg), str(out / "model.safetensors"))


DEMO_MODEL_DIR = Path(__file__).parent / "model"


def demo_model_dir() -> Path | None:
    """The trained demo model shipped in the package (docs: model/CARD.md), if present."""
    return DEMO_MODEL_DIR if (DEMO_MODEL_DIR / "manifest.json").is_file() else None


def default_model_dir() -> Path:
    """What `colibri serve` runs without --model: the demo model, else the random one."""
    return demo_model_dir() or builtin_model_dir()


def model_id_for(model_dir: Path) -> str:
    """The public id of a served model: fixed names for the two models colibri brings,
    else the directory's name."""
    resolved = model_dir.resolve()
    if resolved == DEMO_MODEL_DIR.resolve():
        return "colibri-demo"
    if resolved == (cache_dir() / "models" / builtin_name()).resolve():
        return "colibri-builtin"
    return resolved.name


def builtin_model_dir() -> Path:
    """The converted random built-in model (the tests' model), built and cached on first use."""
    from colibri.runtime.engine import convert

    target = cache_dir() / "models" / builtin_name()
    if (target / "manifest.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".build-") as tmp:
        hf = Path(tmp) / "hf"
        write_checkpoint(hf)
        staged = Path(tmp) / "model"
        convert(hf, staged, "int4")
        try:
            staged.rename(target)
        except OSError:
            # Another process finished first; its copy is identical.
            if not (target / "manifest.json").is_file():
                shutil.rmtree(target, ignore_errors=True)
                staged.rename(target)
    return target
