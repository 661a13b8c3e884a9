#!/usr/bin/env python3
"""Write a random MoE Hugging Face checkpoint (bf16 safetensors) of one of two shapes:
OLMoE-1B-7B (``--arch olmoe``, the default) or a DeepSeek-V3-shaped model scaled to this
machine (``--arch deepseek_v3``: MLA with kv_lora_rank 512, a dense first layer, 64 routed
experts top-6 and one shared expert, sigmoid routing with a correction bias; ~6.6B params).

The weights are seeded random normals (std 0.02, norms 1.0, correction biases 0), written
tensor by tensor straight into sharded safetensors files with the per-expert names that the
family's checkpoints on the hub use, e.g. ``model.layers.3.mlp.experts.17.gate_proj.weight``.
At most one tensor (a few hundred MB) is held in memory at a time, so the ~14 GB checkpoint is
written on a small machine without a second copy in RAM.

Each tensor has its own RNG stream, seeded from (seed, tensor index), so the
output is bit-identical on every machine and independent of write order.

A small byte-level BPE tokenizer (trained with the ``tokenizers`` library on a
seeded synthetic corpus, vocab 8192 <= 50304) is written alongside, so the
directory is a complete checkpoint that transformers, llama.cpp's converter and
colibri can all load. Nothing is downloaded.

``--max-position-embeddings`` changes only config.json (and the tokenizer's
``model_max_length``), not a single weight: with ``--weights-from DIR``, a
complete checkpoint in DIR that differs from this one only there lends its
shards as hard links (no second 14 GB copy on disk, no regeneration).

Needs numpy and tokenizers. Usage:

    python benchmarks/make_random_moe.py OUT_DIR [--arch olmoe|deepseek_v3|qwen3_next] [--seed 0]
        [--layers 16] [--max-position-embeddings 4096] [--weights-from DIR ...]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import sys
import time
from pathlib import Path

import numpy as np

GENERATOR_VERSION = 1

# The allenai/OLMoE-1B-7B-0924 config (transformers' OlmoeConfig defaults, with
# the expert intermediate size of the released model: 1024). The token ids are
# those of the tokenizer written below.
BASE_CONFIG = {
    "architectures": ["OlmoeForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": None,
    "clip_qkv": None,
    "eos_token_id": 0,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 1024,
    "max_position_embeddings": 4096,
    "model_type": "olmoe",
    "norm_topk_prob": False,
    "num_attention_heads": 16,
    "num_experts": 64,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 16,
    "num_key_value_heads": 16,
    "output_router_logits": False,
    "pad_token_id": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "rope_theta": 10000.0,
    "router_aux_loss_coef": 0.01,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 50304,
}

# A DeepSeek-V3-shaped model at OLMoE-1B-7B's width and depth (transformers' DeepseekV3Config
# keys): V3's attention shape (16 heads, q_lora_rank 768, kv_lora_rank 512, qk_nope 128 /
# qk_rope 64 / v_head_dim 128), its dense first layer, 64 routed experts top-6 plus one shared
# expert, sigmoid scores + correction bias, x2.5. One expert group (n_group 1): llama.cpp and
# colibri then route alike whatever llama.cpp does with groups.
DEEPSEEK_V3_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 0,
    "eos_token_id": 0,
    "first_k_dense_replace": 1,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 6144,
    "kv_lora_rank": 512,
    "max_position_embeddings": 4096,
    "model_type": "deepseek_v3",
    "moe_intermediate_size": 1024,
    "moe_layer_freq": 1,
    "n_group": 1,
    "n_routed_experts": 64,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 16,
    "num_experts_per_tok": 6,
    "num_hidden_layers": 16,
    "num_key_value_heads": 16,
    "num_nextn_predict_layers": 0,
    "pad_token_id": 1,
    "q_lora_rank": 768,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 10000.0,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "tie_word_embeddings": False,
    "topk_group": 1,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "v_head_dim": 128,
    "vocab_size": 50304,
}

# A Qwen3-Next-shaped model at the same width and depth (transformers' Qwen3NextConfig keys):
# Qwen3-Next-80B-A3B's layer pattern (every 4th layer full attention: 16 heads / 2 kv heads of
# 256, partial rotary 0.25, the output gate; the others gated DeltaNet with 16 key heads and 32
# value heads of 128, a 4-tap convolution), 64 routed experts of 512 (of its 512) top-10 and the
# sigmoid-gated shared expert of 512.
QWEN3_NEXT_CONFIG = {
    "architectures": ["Qwen3NextForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 0,
    "decoder_sparse_step": 1,
    "eos_token_id": 0,
    "full_attention_interval": 4,
    "head_dim": 256,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 5120,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_value_head_dim": 128,
    "max_position_embeddings": 4096,
    "mlp_only_layers": [],
    "model_type": "qwen3_next",
    "moe_intermediate_size": 512,
    "norm_topk_prob": True,
    "num_attention_heads": 16,
    "num_experts": 64,
    "num_experts_per_tok": 10,
    "num_hidden_layers": 16,
    "num_key_value_heads": 2,
    "pad_token_id": 1,
    "partial_rotary_factor": 0.25,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 10000.0,
    "shared_expert_intermediate_size": 512,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 50304,
}

SHARD_BYTES = 5 * 1000**3  # like the hub's ~5 GB shards
WEIGHT_STD = 0.02
TOKENIZER_VOCAB = 8192


def tensor_specs(cfg: dict) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, kind) for every tensor, kind in {'normal', 'ones', 'zeros'}."""
    if cfg["model_type"] == "deepseek_v3":
        return deepseek_v3_specs(cfg)
    if cfg["model_type"] == "qwen3_next":
        return qwen3_next_specs(cfg)
    h = cfg["hidden_size"]
    inter = cfg["intermediate_size"]
    n_head = cfg["num_attention_heads"]
    n_kv = cfg["num_key_value_heads"]
    head_dim = h // n_head
    kv_dim = head_dim * n_kv
    vocab = cfg["vocab_size"]
    specs: list[tuple[str, tuple[int, ...], str]] = [
        ("model.embed_tokens.weight", (vocab, h), "normal")
    ]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        specs += [
            (f"{p}.input_layernorm.weight", (h,), "ones"),
            (f"{p}.self_attn.q_proj.weight", (h, h), "normal"),
            (f"{p}.self_attn.k_proj.weight", (kv_dim, h), "normal"),
            (f"{p}.self_attn.v_proj.weight", (kv_dim, h), "normal"),
            (f"{p}.self_attn.o_proj.weight", (h, h), "normal"),
            (f"{p}.self_attn.q_norm.weight", (h,), "ones"),
            (f"{p}.self_attn.k_norm.weight", (kv_dim,), "ones"),
            (f"{p}.post_attention_layernorm.weight", (h,), "ones"),
            (f"{p}.mlp.gate.weight", (cfg["num_experts"], h), "normal"),
        ]
        for j in range(cfg["num_experts"]):
            specs += expert_specs(f"{p}.mlp.experts.{j}", h, inter)
    specs += [("model.norm.weight", (h,), "ones"), ("lm_head.weight", (vocab, h), "normal")]
    return specs


def expert_specs(prefix: str, h: int, inter: int) -> list[tuple[str, tuple[int, ...], str]]:
    return [
        (f"{prefix}.gate_proj.weight", (inter, h), "normal"),
        (f"{prefix}.up_proj.weight", (inter, h), "normal"),
        (f"{prefix}.down_proj.weight", (h, inter), "normal"),
    ]


def deepseek_v3_specs(cfg: dict) -> list[tuple[str, tuple[int, ...], str]]:
    h, heads, vocab = cfg["hidden_size"], cfg["num_attention_heads"], cfg["vocab_size"]
    nope, rope, v = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    q_lora, kv_lora = cfg["q_lora_rank"], cfg["kv_lora_rank"]
    n_experts, moe_inter = cfg["n_routed_experts"], cfg["moe_intermediate_size"]
    specs: list[tuple[str, tuple[int, ...], str]] = [
        ("model.embed_tokens.weight", (vocab, h), "normal")
    ]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        a = f"{p}.self_attn"
        specs += [
            (f"{p}.input_layernorm.weight", (h,), "ones"),
            (f"{a}.q_a_proj.weight", (q_lora, h), "normal"),
            (f"{a}.q_a_layernorm.weight", (q_lora,), "ones"),
            (f"{a}.q_b_proj.weight", (heads * (nope + rope), q_lora), "normal"),
            (f"{a}.kv_a_proj_with_mqa.weight", (kv_lora + rope, h), "normal"),
            (f"{a}.kv_a_layernorm.weight", (kv_lora,), "ones"),
            (f"{a}.kv_b_proj.weight", (heads * (nope + v), kv_lora), "normal"),
            (f"{a}.o_proj.weight", (h, heads * v), "normal"),
            (f"{p}.post_attention_layernorm.weight", (h,), "ones"),
        ]
        if i < cfg["first_k_dense_replace"]:
            specs += expert_specs(f"{p}.mlp", h, cfg["intermediate_size"])
            continue
        specs += [
            (f"{p}.mlp.gate.weight", (n_experts, h), "normal"),
            (f"{p}.mlp.gate.e_score_correction_bias", (n_experts,), "zeros"),
        ]
        for j in range(n_experts):
            specs += expert_specs(f"{p}.mlp.experts.{j}", h, moe_inter)
        specs += expert_specs(f"{p}.mlp.shared_experts", h, moe_inter * cfg["n_shared_experts"])
    specs += [("model.norm.weight", (h,), "ones"), ("lm_head.weight", (vocab, h), "normal")]
    return specs


def qwen3_next_specs(cfg: dict) -> list[tuple[str, tuple[int, ...], str]]:
    """Qwen3-Next's tensors; its RMSNorms are zero-centred (1 + w): their weights are zeros,
    the DeltaNet's gated norm ones; A_log zeros (decay exp(-softplus(a + 1)))."""
    h, vocab = cfg["hidden_size"], cfg["vocab_size"]
    heads, kv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    kd, vd = nk * cfg["linear_key_head_dim"], nv * cfg["linear_value_head_dim"]
    n_experts, moe_inter = cfg["num_experts"], cfg["moe_intermediate_size"]
    every = cfg["full_attention_interval"]
    specs: list[tuple[str, tuple[int, ...], str]] = [
        ("model.embed_tokens.weight", (vocab, h), "normal")
    ]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        specs.append((f"{p}.input_layernorm.weight", (h,), "zeros"))
        if (i + 1) % every == 0:
            a = f"{p}.self_attn"
            specs += [
                (f"{a}.q_proj.weight", (heads * hd * 2, h), "normal"),
                (f"{a}.k_proj.weight", (kv * hd, h), "normal"),
                (f"{a}.v_proj.weight", (kv * hd, h), "normal"),
                (f"{a}.o_proj.weight", (h, heads * hd), "normal"),
                (f"{a}.q_norm.weight", (hd,), "zeros"),
                (f"{a}.k_norm.weight", (hd,), "zeros"),
            ]
        else:
            a = f"{p}.linear_attn"
            specs += [
                (f"{a}.in_proj_qkvz.weight", (2 * kd + 2 * vd, h), "normal"),
                (f"{a}.in_proj_ba.weight", (2 * nv, h), "normal"),
                (f"{a}.conv1d.weight", (2 * kd + vd, 1, cfg["linear_conv_kernel_dim"]), "normal"),
                (f"{a}.dt_bias", (nv,), "ones"),
                (f"{a}.A_log", (nv,), "zeros"),
                (f"{a}.norm.weight", (cfg["linear_value_head_dim"],), "ones"),
                (f"{a}.out_proj.weight", (h, vd), "normal"),
            ]
        specs += [
            (f"{p}.post_attention_layernorm.weight", (h,), "zeros"),
            (f"{p}.mlp.gate.weight", (n_experts, h), "normal"),
        ]
        for j in range(n_experts):
            specs += expert_specs(f"{p}.mlp.experts.{j}", h, moe_inter)
        specs += expert_specs(f"{p}.mlp.shared_expert", h, cfg["shared_expert_intermediate_size"])
        specs.append((f"{p}.mlp.shared_expert_gate.weight", (1, h), "normal"))
    specs += [("model.norm.weight", (h,), "zeros"), ("lm_head.weight", (vocab, h), "normal")]
    return specs


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even float32 -> bfloat16, returned as uint16 bits (in place on x)."""
    u = x.view(np.uint32)
    lsb = (u >> 16) & 1
    u += 0x7FFF
    u += lsb
    return (u >> 16).astype(np.uint16)


def make_tensor(seed: int, index: int, shape: tuple[int, ...], kind: str) -> np.ndarray:
    if kind == "ones":
        return np.full(shape, 0x3F80, dtype=np.uint16)  # bf16 1.0
    if kind == "zeros":
        return np.zeros(shape, dtype=np.uint16)
    rng = np.random.Generator(np.random.PCG64([seed, index]))
    x = rng.standard_normal(size=shape, dtype=np.float32)
    x *= np.float32(WEIGHT_STD)
    return f32_to_bf16_bits(x)


def write_shards(out: Path, cfg: dict, seed: int) -> int:
    specs = tensor_specs(cfg)
    # assign tensors to shards greedily, in order
    shards: list[list[int]] = [[]]
    size = 0
    for idx, (_, shape, _) in enumerate(specs):
        nbytes = 2 * int(np.prod(shape))
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(idx)
        size += nbytes
    n_shards = len(shards)
    weight_map: dict[str, str] = {}
    total = 0
    t0 = time.time()
    done_params = 0
    all_params = sum(int(np.prod(s)) for _, s, _ in specs)
    for si, members in enumerate(shards):
        fname = f"model-{si + 1:05d}-of-{n_shards:05d}.safetensors"
        header: dict = {"__metadata__": {"format": "pt"}}
        off = 0
        for idx in members:
            name, shape, _ = specs[idx]
            nbytes = 2 * int(np.prod(shape))
            header[name] = {
                "dtype": "BF16",
                "shape": list(shape),
                "data_offsets": [off, off + nbytes],
            }
            off += nbytes
            weight_map[name] = fname
        hjson = json.dumps(header, separators=(",", ":")).encode()
        hjson += b" " * (-len(hjson) % 8)
        with open(out / fname, "wb") as f:
            f.write(struct.pack("<Q", len(hjson)))
            f.write(hjson)
            for idx in members:
                _, shape, kind = specs[idx]
                f.write(make_tensor(seed, idx, shape, kind).tobytes())
                done_params += int(np.prod(shape))
            total += off
        el = time.time() - t0
        print(
            f"  wrote {fname} ({off / 1e9:.2f} GB; {done_params / all_params:.0%} done, {el:.0f}s)",
            flush=True,
        )
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return all_params


def synthetic_corpus(seed: int, n_lines: int = 20000):
    """Seeded pseudo-text (syllable words, Zipf-distributed, with digits/punctuation)."""
    rng = np.random.Generator(np.random.PCG64([seed, 0xC0]))
    onsets = [
        "",
        "b",
        "c",
        "d",
        "f",
        "g",
        "h",
        "j",
        "k",
        "l",
        "m",
        "n",
        "p",
        "r",
        "s",
        "t",
        "v",
        "w",
        "st",
        "tr",
        "pl",
        "ch",
        "sh",
        "th",
        "br",
        "gr",
    ]
    vowels = ["a", "e", "i", "o", "u", "ai", "ea", "ou", "io"]
    codas = ["", "", "n", "r", "s", "t", "l", "nd", "ng", "st", "rk"]
    words = []
    for _ in range(6000):
        n_syl = 1 + int(rng.integers(0, 3))
        words.append(
            "".join(
                onsets[rng.integers(len(onsets))]
                + vowels[rng.integers(len(vowels))]
                + codas[rng.integers(len(codas))]
                for _ in range(n_syl)
            )
        )
    ranks = np.arange(1, len(words) + 1, dtype=np.float64)
    p = 1.0 / ranks
    p /= p.sum()
    punct = [".", ",", "!", "?", ":", ";", " -", " (x)", "'s", "\n"]
    for _ in range(n_lines):
        n = int(rng.integers(4, 24))
        ws = [words[k] for k in rng.choice(len(words), size=n, p=p)]
        if rng.random() < 0.3:
            ws[0] = ws[0].capitalize()
        if rng.random() < 0.2:
            ws.append(str(int(rng.integers(0, 100000))))
        yield " ".join(ws) + punct[int(rng.integers(len(punct)))]


def write_tokenizer(out: Path, seed: int, max_len: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB,
        special_tokens=["<|endoftext|>", "<|padding|>"],  # ids 0 and 1, as in GPT-NeoX
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(synthetic_corpus(seed), trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "add_bos_token": False,
                "add_eos_token": False,
                "bos_token": None,
                "eos_token": "<|endoftext|>",
                "pad_token": "<|padding|>",
                "unk_token": "<|endoftext|>",
                "model_max_length": max_len,
                "clean_up_tokenization_spaces": False,
            },
            indent=2,
        )
        + "\n"
    )
    (out / "special_tokens_map.json").write_text(
        json.dumps(
            {
                "eos_token": "<|endoftext|>",
                "pad_token": "<|padding|>",
                "unk_token": "<|endoftext|>",
            },
            indent=2,
        )
        + "\n"
    )


def weights_stamp(stamp: dict) -> dict:
    """What the weights depend on: the stamp without the context length."""
    return dict(stamp, config=dict(stamp["config"], max_position_embeddings=None))


def link_shards(src: Path, dst: Path, stamp: dict) -> int | None:
    """Hard-link src's shards and index into dst when src is a complete checkpoint with the
    same weights (same stamp up to the context length); its parameter count, else None."""
    try:
        done = json.loads((src / "colibri_bench_complete.json").read_text())
        index = json.loads((src / "model.safetensors.index.json").read_text())
    except (OSError, ValueError):
        return None
    if weights_stamp(done.get("stamp", {"config": {}})) != weights_stamp(stamp):
        return None
    names = sorted(set(index["weight_map"].values())) + ["model.safetensors.index.json"]
    for name in names:
        try:
            os.link(src / name, dst / name)
        except OSError:  # another filesystem: a copy
            shutil.copy2(src / name, dst / name)
    print(f"  shards linked from {src}", flush=True)
    return int(done["n_params"])


ARCH_CONFIGS = {
    "olmoe": BASE_CONFIG,
    "deepseek_v3": DEEPSEEK_V3_CONFIG,
    "qwen3_next": QWEN3_NEXT_CONFIG,
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--arch", choices=sorted(ARCH_CONFIGS), default="olmoe")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--layers",
        type=int,
        default=BASE_CONFIG["num_hidden_layers"],
        help="number of layers (default 16; fewer for a quick smoke test)",
    )
    ap.add_argument(
        "--max-position-embeddings",
        type=int,
        default=BASE_CONFIG["max_position_embeddings"],
        help="the config's context length (default 4096; the weights do not depend on it)",
    )
    ap.add_argument(
        "--weights-from",
        type=Path,
        action="append",
        default=[],
        help="a checkpoint whose shards to hard-link if its weights are the same (repeatable)",
    )
    ap.add_argument(
        "--heads",
        type=int,
        help="attention heads (deepseek_v3 only; its kv heads follow): e.g. 128, a released "
        "DeepSeek-V3's count, for the MLA prefill forms' measurement",
    )
    ap.add_argument("--force", action="store_true", help="regenerate even if OUT is complete")
    args = ap.parse_args(argv)

    cfg = dict(
        ARCH_CONFIGS[args.arch],
        num_hidden_layers=args.layers,
        max_position_embeddings=args.max_position_embeddings,
    )
    if args.heads is not None:
        if args.arch != "deepseek_v3":
            ap.error("--heads applies to --arch deepseek_v3")
        cfg.update(num_attention_heads=args.heads, num_key_value_heads=args.heads)
    stamp = {"generator_version": GENERATOR_VERSION, "seed": args.seed, "config": cfg}
    done_file = args.out / "colibri_bench_complete.json"
    if (
        not args.force
        and done_file.exists()
        and json.loads(done_file.read_text()).get("stamp") == stamp
    ):
        print(f"model already present: {args.out}")
        return 0

    tmp = args.out.with_name(args.out.name + ".partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    print(f"writing a random {args.arch} checkpoint to {args.out} (seed {args.seed})", flush=True)
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (tmp / "generation_config.json").write_text(
        json.dumps(
            {"eos_token_id": cfg["eos_token_id"], "pad_token_id": cfg["pad_token_id"]}, indent=2
        )
        + "\n"
    )
    write_tokenizer(tmp, args.seed, args.max_position_embeddings)
    n_params = next(
        (n for src in args.weights_from if (n := link_shards(src, tmp, stamp)) is not None), None
    )
    if n_params is None:
        n_params = write_shards(tmp, cfg, args.seed)
    (tmp / "colibri_bench_complete.json").write_text(
        json.dumps({"stamp": stamp, "n_params": n_params}, indent=2) + "\n"
    )
    if args.out.exists():
        shutil.rmtree(args.out)
    os.replace(tmp, args.out)
    print(f"done: {n_params / 1e9:.3f}B params", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
