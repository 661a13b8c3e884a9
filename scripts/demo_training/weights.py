"""The model's weights: a fresh ``Glm4MoeForCausalLM`` of the recipe's config, initial weights
from an earlier checkpoint or a colibri model directory (int4 dequantized), the int4 rounding of
quantization-aware training, and the HF checkpoint written after training."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from .config import CONFIG, SEED, SPECIAL_TOKENS
from .repo import TEMPLATE_PATH

# colibri tensor name -> checkpoint name, for the plain-attention families (OLMoE, Qwen3-MoE,
# GLM-4.5 and the demo model): the model-wide tensors, and a layer's (after `layers.{i}.`).
TOP_NAMES = {
    "embed": "model.embed_tokens.weight",
    "lm_head": "lm_head.weight",
    "norm": "model.norm.weight",
}
LAYER_NAMES = {
    "attn_norm": "input_layernorm.weight",
    "ffn_norm": "post_attention_layernorm.weight",
    "q": "self_attn.q_proj.weight",
    "k": "self_attn.k_proj.weight",
    "v": "self_attn.v_proj.weight",
    "o": "self_attn.o_proj.weight",
    "q_bias": "self_attn.q_proj.bias",
    "k_bias": "self_attn.k_proj.bias",
    "v_bias": "self_attn.v_proj.bias",
    "q_norm": "self_attn.q_norm.weight",
    "k_norm": "self_attn.k_norm.weight",
    "mlp.gate": "mlp.gate_proj.weight",
    "mlp.up": "mlp.up_proj.weight",
    "mlp.down": "mlp.down_proj.weight",
    "router": "mlp.gate.weight",
    "router_bias": "mlp.gate.e_score_correction_bias",
    "shared.gate": "mlp.shared_experts.gate_proj.weight",
    "shared.up": "mlp.shared_experts.up_proj.weight",
    "shared.down": "mlp.shared_experts.down_proj.weight",
}


def build_model(
    vocab_size: int, eos_ids: list[int], pad_id: int, seed: int = SEED, tie: bool = False
):
    import torch
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    cfg = dict(
        CONFIG,
        vocab_size=vocab_size,
        eos_token_id=eos_ids,
        pad_token_id=pad_id,
        tie_word_embeddings=tie,
    )
    cfg.pop("architectures")
    cfg.pop("model_type")
    config = Glm4MoeConfig(**cfg)
    config.architectures = ["Glm4MoeForCausalLM"]
    torch.manual_seed(seed)
    model = Glm4MoeForCausalLM(config)
    return model


def _colibri_tensor(buf: bytes, spec: dict, base: int = 0):
    """One tensor of a colibri model file as an f32 torch tensor: ``f32`` as stored, ``q4``
    dequantized (layout in ``crates/engine/src/quant/mod.rs``: each row its f16 scales, then its
    nibbles in blocks of 16 groups interleaved by dword; weight ``(q - 8) * scale``), ``q8``
    dequantized (``quant/q8w.rs``: each row its f16 scales, then its int8 values in blocks of 16
    groups; weight ``q * scale``)."""
    import numpy as np
    import torch

    shape, off = spec["shape"], base + spec["offset"]
    raw = np.frombuffer(buf, dtype=np.uint8, count=spec["nbytes"], offset=off)
    if spec["dtype"] == "f32":
        return torch.from_numpy(raw.view("<f4").reshape(shape).copy())
    if spec["dtype"] == "q8":
        return torch.from_numpy(_q8_values(raw, *shape))
    if spec["dtype"] != "q4":
        raise ValueError(f"cannot read a {spec['dtype']} tensor")
    rows, cols = shape
    groups = -(-cols // 32)
    rowb = raw.reshape(rows, groups * 18)
    scales = rowb[:, : groups * 2].copy().view("<f2").astype(np.float32)  # [rows, groups]
    nib = rowb[:, groups * 2 :]
    # Byte j (0..16) of group g sits at nibble_offset(groups, g, j).
    offs = np.empty((groups, 16), dtype=np.int64)
    for g in range(groups):
        b = g // 16
        m = min(groups - b * 16, 16)
        for j in range(16):
            offs[g, j] = b * 256 + (j // 4) * 4 * m + (g % 16) * 4 + j % 4
    by = nib[:, offs]  # [rows, groups, 16]
    q = np.concatenate([by & 15, by >> 4], axis=-1).astype(np.float32) - 8.0  # [rows, g, 32]
    w = (q * scales[:, :, None]).reshape(rows, groups * 32)[:, :cols]
    return torch.from_numpy(np.ascontiguousarray(w))


def _q8_values(raw, rows: int, cols: int):
    """The f32 values of a ``q8`` matrix's bytes: value ``j`` (0..32) of group ``g`` sits at
    ``b * 512 + v(j) * 4m + 4 (g % 16) + j % 4`` of the row's values, ``v(j) = (j % 16 // 4) * 2
    + j // 16``, ``b = g // 16``, ``m`` the groups of that block."""
    import numpy as np

    groups = -(-cols // 32)
    rowb = raw.reshape(rows, groups * 34)
    scales = rowb[:, : groups * 2].copy().view("<f2").astype(np.float32)
    vals = rowb[:, groups * 2 :].copy().view(np.int8)
    offs = np.empty((groups, 32), dtype=np.int64)
    for g in range(groups):
        b = g // 16
        m = min(groups - b * 16, 16)
        for j in range(32):
            v = (j % 16 // 4) * 2 + j // 16
            offs[g, j] = b * 512 + v * 4 * m + (g % 16) * 4 + j % 4
    w = (vals[:, offs].astype(np.float32) * scales[:, :, None]).reshape(rows, groups * 32)
    return np.ascontiguousarray(w[:, :cols])


def load_colibri_weights(model, src: Path) -> None:
    """Loads the weights of a colibri model directory (``colibri convert`` output, f32 or int4)
    into a ``Glm4MoeForCausalLM`` of the same shape: the shipped int4 model, trained
    quantization-aware, is its own f32 starting point (the f32 checkpoint it came from is not
    kept). Every parameter and router bias of the model must be found."""
    import torch

    man = json.loads((src / "manifest.json").read_text())
    res = (src / man["resident"]["file"]).read_bytes()
    sd: dict[str, torch.Tensor] = {}
    for key, spec in man["resident"]["tensors"].items():
        if key in TOP_NAMES:
            sd[TOP_NAMES[key]] = _colibri_tensor(res, spec)
            continue
        _, layer, rest = key.split(".", 2)
        sd[f"model.layers.{layer}.{LAYER_NAMES[rest]}"] = _colibri_tensor(res, spec)
    ex = man.get("experts")
    if ex:
        eb = (src / ex["file"]).read_bytes()
        for lay in ex["layers"]:
            parts = {p: [] for p in ("gate", "up", "down")}
            for e in range(lay["count"]):
                base = (lay["first_record"] + e) * ex["record_size"]
                for p in parts:
                    parts[p].append(_colibri_tensor(eb, ex["parts"][p], base))
            pre = f"model.layers.{lay['layer']}.mlp.experts"
            # transformers 5 fuses gate and up: gate_up_proj [E, 2I, H], gate first.
            sd[f"{pre}.gate_up_proj"] = torch.stack(
                [torch.cat([g, u]) for g, u in zip(parts["gate"], parts["up"], strict=True)]
            )
            sd[f"{pre}.down_proj"] = torch.stack(parts["down"])
    own = model.state_dict()
    missing = [k for k in own if k not in sd and not k.endswith("inv_freq")]
    unknown = [k for k in sd if k not in own]
    if missing or unknown:
        raise ValueError(f"{src}: missing {missing[:5]}, unknown {unknown[:5]}")
    for k, v in sd.items():
        if own[k].shape != v.shape:
            raise ValueError(f"{src}: {k} is {tuple(v.shape)}, the model has {tuple(own[k].shape)}")
    model.load_state_dict(sd, strict=False)


def load_init(model, src: Path) -> None:
    """Initial weights from ``src``: an HF checkpoint (``WORK/hf`` of an earlier run, f32) or a
    colibri model directory (see ``load_colibri_weights``)."""
    if (src / "manifest.json").exists():
        load_colibri_weights(model, src)
        return
    import torch
    from safetensors.torch import load_file

    sd = load_file(str(src / "model.safetensors"))
    # save_pretrained writes the experts one by one (experts.E.{gate,up,down}_proj.weight, the
    # checkpoint format the converter reads); transformers 5 fuses them in the model.
    fused: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for k in [k for k in sd if ".mlp.experts." in k and k.endswith("_proj.weight")]:
        pre, rest = k.split(".mlp.experts.")
        e, part = rest.split(".")[:2]
        fused.setdefault(pre, {}).setdefault(int(e), {})[part] = sd.pop(k)
    for pre, experts in fused.items():
        order = [experts[e] for e in sorted(experts)]
        sd[f"{pre}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([x["gate_proj"], x["up_proj"]]) for x in order]
        )
        sd[f"{pre}.mlp.experts.down_proj"] = torch.stack([x["down_proj"] for x in order])
    own = model.state_dict()
    missing = [k for k in own if k not in sd and not k.endswith("inv_freq")]
    if missing:
        raise ValueError(f"{src}: missing {missing[:5]}")
    model.load_state_dict(sd, strict=False)


def fake_int4(w):
    """``w`` rounded to the int4 grid the converter writes: groups of 32 along the last (input)
    dimension, ``(q - 8) * d`` with ``q`` in 0..15 and ``d`` from the group's largest magnitude
    (Q4_0's rule; the converter's scale search can only lower the error of a group)."""
    import torch

    g = w.reshape(*w.shape[:-1], w.shape[-1] // 32, 32)
    idx = g.abs().argmax(dim=-1, keepdim=True)
    d = torch.gather(g, -1, idx) / -8.0
    d = torch.where(d == 0, torch.ones_like(d), d)
    q = torch.clamp(torch.round(g / d) + 8.0, 0.0, 15.0)
    return ((q - 8.0) * d).reshape(w.shape)


def save_checkpoint(model, tok, hf: Path) -> None:
    if hf.exists():
        shutil.rmtree(hf)
    hf.mkdir(parents=True)
    model.save_pretrained(hf, safe_serialization=True)
    tok.save(str(hf / "tokenizer.json"))
    template = TEMPLATE_PATH.read_text(encoding="utf-8")
    (hf / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": "<|endoftext|>",
                "pad_token": "<|endoftext|>",
                "chat_template": template,
                "additional_special_tokens": SPECIAL_TOKENS[1:],
            },
            indent=2,
            ensure_ascii=False,
        )
    )
    cfg = json.loads((hf / "config.json").read_text())
    assert cfg["architectures"] == ["Glm4MoeForCausalLM"], cfg["architectures"]
