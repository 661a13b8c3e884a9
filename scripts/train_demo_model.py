"""Builds colibri's built-in demo model: a tiny GLM-4.5-format MoE trained on synthetic chats.

Development only: needs torch and transformers, which are not colibri dependencies. Run it with a
Python that has them (the package's own pure-Python pieces, the chat template and
``colibri/demo/data.py``, are loaded straight from their files, so the compiled engine is not
needed here); the conversion and the evaluation run the real engine through ``colibri`` of
``.venv`` as subprocesses.

    python scripts/train_demo_model.py --work /tmp/demo            # tokenizer, data, train, save
    python scripts/train_demo_model.py --work /tmp/demo --steps 50 --no-convert   # a quick try

Steps: (1) a byte-level BPE tokenizer trained on the synthetic corpus, digits one per token, the
GLM special tokens each one token; (2) a ``Glm4MoeForCausalLM`` config (``CONFIG``); (3) training
on freshly sampled conversations, loss only on what the model must generate (the text after each
generation prompt, through the ``<|user|>`` / ``<|observation|>`` that ends the turn), with
GLM's bias-based expert balancing (``e_score_correction_bias``, no auxiliary loss); (4) the HF
checkpoint in WORK/hf; (5) ``colibri convert`` to f32 and int4, evaluation of both, the int4
model plus CARD.md and loss.png copied to ``python/colibri/demo/model``.

Comparing recipes: the seed moves the result more than any recipe change tried so far. With
``--short-pieces 0.5``, seed 1234 made 87.5% of the held-out tool calls and seed 1235 58%; the
shipped recipe made 93% and 87% on two runs of seed 1234 (one with a shared CPU). One run per
recipe tells nothing; compare recipes over several seeds (~1 hour of idle CPU each).
``--tie-embeddings`` (seed 1234) made 93.5%, the same as the shipped recipe, and failed on the
same real cities in the same way (one piece of the name swapped for another: "Uppsala" ->
"Ukarasala"), although tying gave the rarely trained pieces ("pp", "den", "way") embeddings as
large as the common ones' (untied: ~0.4 against ~1.3). The swapped-in pieces are common pieces
of the training names ("hagen", "ville", "ring"): the model's prior over names outvotes the copy.
``--piece-share 0.7`` (fewer names it can learn by heart) copied 41 of the 45 real cities (the
shipped model 36) but only 95 of 105 generated ones (some run on past the name's end:
"Pechžltru" -> "Pechžltruririg") and 41 of 50 currency calls: 88.5% in all (seed 1234; its sums
without thinking fell to 89% too, which looks like the draw). The same recipe with seed 1236
(run 18) lagged from step ~1000 on and made 84% (real cities 33/45, sums without thinking 9%):
seeds 1235 and 1236 were poor draws for both recipes tried on them, seed 1234 a good one for all.
``--near-miss 0.5`` (run 19, seed 1234: half the unstrung cities start like a known name and
then go elsewhere) made 92.5% (real cities 37/45, generated 98/105): swaps went on ("Incheon" ->
"Imoneyon") and a new failure showed, copies running past the name into the held-out phrasing's
next word ("Galway right now?" -> "Galway right"), hence ``--trailing-phrasings``. The loss of
each task is logged (``task_loss`` in ``train.json``) to see which circuit forms late.
``--trailing-phrasings`` (run 20, seed 1234) made 89% (real 34/45, generated 94/105): no run-on
left, but more swaps. Its task losses show when each skill forms: lookups and sums with a trace
by step ~1000, copying a name said back ("echo", the pure copy) only at 2000-2400 (loss 3.1 at
2000, 0.8 at 2800), sums without a trace at ~3200: the copy forms late and is still improving
when training ends. Run 19's failing real cities that were tried (Uppsala, Antalya, Incheon)
fail the same way in a bare echo with no tools declared ("Incheon" -> "Imoneyon"), at a piece
copied rarely in training ("nch"; ~30 copies of each piece in a run), hence ``--copy-drill``.
``--copy-drill 0.15 --trailing-phrasings`` (run 21, seed 1234; identical to run 20 up to step
1440, where drills join) made 98% of the tool calls in int4 (real cities 43/45, generated
103/105, currency 50/50; f32 98.5%), its echo loss fell to 0.004 (run 20: 0.42) and "Incheon",
"Antalya" copy. But lookups fell to 96.5% (target 98%): every miss was the held-out "Please name
the capital of X." answered "The capital of" and nothing more, as if asked for a drill ("Please
repeat these names exactly"; other phrasings answer); sums without thinking 93%. So the drill
phrasings no longer say "please" or "name". With them (run 22, same flags): lookups 100%, tool
calls 98.5% (real 43/45, generated 104/105), tool answers 98.5%, int4 equal to f32; but sums
without thinking never formed (10%; their loss stuck at ~0.6 from step 2200 on, where runs 20
and 21 dropped to ~0.1 at 3000 and 2100). ``--copy-drill 0.1 --steps 4000`` (run 23) the same:
lookups 100%, tool calls 97.5% (f32 98%), sums without thinking 4%. Drills replace episodes of
every task, sums included, and the sums form last: hence ``--arith-weight``.
``--arith-weight 60`` with run 23's flags (run 24): sums formed early (no-think loss 0.35 at step
1800, 0.08 at 2600; int4 arith 99%, without thinking 98%), lookups 100%, but the copy formed
~400 steps later than in run 23 (echo loss 1.5 at 2800, 0.42 at 3600) and tool calls fell to
86.5% (f32 86%; real 38/45, generated 85/105): names swapped in pieces ("Incheon" -> "Rencheon")
and, new, `get_weather` called for the held-out "Do you know what time it is in X?". The
skills form in turn and compete for the same steps: sums and the copy each formed in time in
some run, never both at 3600-4000 steps once drills take their share.
``--arith-weight 48 --copy-drill 0.15 --steps 4000`` (run 25, between runs 22 and 24): sums
formed (int4 96.5%, without thinking 93%; no-think loss 0.12 at step 3000), lookups 100%, but the
copy again formed late (echo loss 1.34 at 3000, 0.32 at 4000) and tool calls made 82% (f32
82.5%; real cities 32/45, generated 84/105): every failure a half-copied name ("Bologna" ->
"Bolog", "Incheon" -> "Isweron"), the right tool each time. The copy was still improving when
the schedule ended, hence more steps (a faster CPU here made 4000 steps 33 minutes).
The same flags with ``--steps 5000 --piece-names-from 0.32`` (run 26, strung names joining at
step 1600 as before; first run with every call trained to end on ``<|observation|>``; 42
minutes): the copy formed by step 2600 (echo loss 0.25) and sums without thinking by 3200
(0.11). int4: sums 99.5%, lookups 100%, tool calls 94.0% (f32 95.0%; real cities 42/45,
generated 100/105, currency 46/50), tool answers 98%. The misses: digits of an amount changed
with thinking on ("139" -> "1199"), a two-word city cut short ("Ottawa Falls" -> "Ottawa"), a
run-on ("Jexcrailthu" -> "Jexcrailthuriri"), an accented capital ("Çeikri" -> "Ôeikri").
Shipped for a while (tool calls one point short of the target, above run 8's 93%).
Half of all the tokens are tool declarations, never trained on; ``--tool-extra 3`` (run 27, run
26's flags otherwise) gives each conversation that declares them three more episodes (33% more
trained turns per token; steps ~16% slower, 49 minutes): sums without thinking formed by step
1400 (loss 0.33; run 26: 0.75) and the copy by 2000 (echo 0.34; run 26: 2.48), both ~1000
steps earlier. int4: sums 99.0% (without thinking 98%), lookups 100%, tool calls 99.0% (real
cities 43/45, generated 105/105, currency 50/50), tool answers 99%, int4 equal to f32 or
better on every task: every target met. Shipped.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "python" / "colibri"
TEMPLATE_PATH = PKG / "chat" / "templates" / "glm45.jinja"
SHIP_DIR = PKG / "demo" / "model"
COLIBRI = ROOT / ".venv" / "bin" / "colibri"
VENV_PY = ROOT / ".venv" / "bin" / "python"


def _load(name: str, path: Path):
    """Imports one pure-Python module of the package from its file (no package __init__)."""
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


demo_data = _load("colibri_demo_data", PKG / "demo" / "data.py")
demo_preamble = _load("colibri_demo_preamble", PKG / "demo" / "preamble.py")
chat_template = _load("colibri_chat_template", PKG / "chat" / "template.py")

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


# --- tokenizer ----------------------------------------------------------------------------------


def _split_specials(text: str) -> list[str]:
    parts = [text]
    for tok in SPECIAL_TOKENS:
        parts = [p for chunk in parts for p in chunk.split(tok)]
    return [p for p in parts if p]


def build_tokenizer(template, seed: int):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKEN_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=20,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    rng = random.Random(seed + 1)
    texts = []
    for _ in range(20000):
        conv = demo_data.train_conversation(rng)
        full = template.render(
            conv["messages"], add_generation_prompt=False, tools=conv["tools"], enable_thinking=True
        )
        texts += _split_specials(full)
    # The digits are pre-tokens of their own, so no merge ever joins them.
    tok.train_from_iterator(texts, trainer=trainer)
    tok.add_special_tokens(SPECIAL_TOKENS)  # matched before BPE, never split or merged
    for t in SPECIAL_TOKENS:
        assert tok.encode(t).ids == [tok.token_to_id(t)], t
    return tok


# --- data ---------------------------------------------------------------------------------------


# Labels of the loss-carrying tokens, for the loss of each task in the log: the turn's kind,
# with "/think" when the turn was generated with thinking on.
LOSS_LABELS = [k + t for k in demo_data.TURN_KINDS for t in ("", "/think")]


def encode_conversation(tok, template, conv: dict) -> tuple[list[int], list[int]]:
    """Token ids of a rendered conversation and a parallel mask of what the model generates:
    for each assistant message, the text after the generation prompt (thinking on or off as that
    turn had it) up to and including the marker that ends the turn. The mask is 0 elsewhere and
    1 + the turn's index in ``LOSS_LABELS`` on those tokens."""
    msgs, tools = conv["messages"], conv["tools"]
    ids: list[int] = []
    mask: list[int] = []
    done = ""
    turn = 0

    def add(text: str, m: int) -> None:
        nonlocal done
        if text:
            t = tok.encode(text).ids
            ids.extend(t)
            mask.extend([m] * len(t))
            done += text

    for i, msg in enumerate(msgs):
        if msg["role"] != "assistant":
            continue
        think = conv["thinking"][turn]
        label = 1 + LOSS_LABELS.index(conv["kinds"][turn] + ("/think" if think else ""))
        turn += 1
        prompt = template.render(
            msgs[:i], add_generation_prompt=True, tools=tools, enable_thinking=think
        )
        upto = template.render(
            msgs[: i + 1], add_generation_prompt=False, tools=tools, enable_thinking=think
        )
        assert prompt.startswith(done) and upto.startswith(prompt), (prompt, upto)
        add(prompt[len(done) :], 0)
        # The marker that ends the turn is where the next message's render starts. A tool call
        # always ends on <|observation|>, also when the conversation stops at the call (before
        # run 26 those calls were trained to end on <|user|>: a quarter of the calls).
        end = "<|observation|>" if msg.get("tool_calls") else "<|user|>"
        add(upto[len(prompt) :] + end, label)
    return ids, mask


def name_pieces(
    tok,
    short_p: float = 0.0,
    share: float | None = None,
    near_miss: float = 0.0,
    drill: float = 0.0,
):
    """The tokenizer's letter pieces, for training city names made of them."""
    return demo_data.NamePieces(
        [tok.decode([i]) for i in range(tok.get_vocab_size())],
        short_p=short_p,
        share=share,
        near_miss=near_miss,
        drill=drill,
    )


def batches(
    rng: random.Random,
    tok,
    template,
    tokens: int,
    max_len: int,
    pieces_after: int,
    short_p: float = 0.0,
    piece_share: float | None = None,
    near_miss: float = 0.0,
    trailing: bool = False,
    drill: float = 0.0,
    arith_weight: int | None = None,
    tool_extra: int = 0,
):
    """Endless batches of (input ids, mask) lists, about ``tokens`` tokens each once padded:
    conversations are drawn 512 at a time, sorted by length (little padding), cut into batches
    and the batches shuffled. Cities strung from tokenizer pieces join the data once
    ``pieces_after`` batches are out: with them from the start, the copying circuit never formed
    (run 5: 0% on the training pool's own names); formed on name-like cities first, they then
    extend it to every piece."""
    pieces = name_pieces(tok, short_p=short_p, share=piece_share, near_miss=near_miss, drill=drill)
    mix = demo_data.train_mix(arith_weight)
    served = 0
    while True:
        pool = []
        while len(pool) < 512:
            conv = demo_data.train_conversation(
                rng,
                pieces if served >= pieces_after else None,
                trailing=trailing,
                mix=mix,
                tool_extra=tool_extra,
            )
            ids, mask = encode_conversation(tok, template, conv)
            if len(ids) <= max_len:
                pool.append((ids, mask))
        pool.sort(key=lambda s: len(s[0]))
        chunks, cur = [], []
        for s in pool:
            if cur and len(s[0]) * (len(cur) + 1) > tokens:
                chunks.append(cur)
                cur = []
            cur.append(s)
        chunks.append(cur)
        rng.shuffle(chunks)
        for chunk in chunks:
            served += 1
            yield chunk


def long_batches(
    rng: random.Random,
    tok,
    template,
    min_tokens: int,
    max_tokens: int,
    max_len: int,
    episodes: tuple[int, int],
    pieces,
    chars_per_token: float,
    long_bias: float = 0.5,
    trailing: bool = False,
    arith_weight: int | None = None,
    tool_extra: int = 0,
):
    """Endless batches of one conversation each whose prompt opens with an agent preamble
    (``demo_preamble.long_train_conversation``) of ``min_tokens``-``max_tokens`` tokens (uniform;
    with ``long_bias`` of the draws from the upper half of the range, where the evaluation is)
    and ``episodes`` (low, high) trained episodes after it; at most ``max_len`` tokens in all."""
    mix = demo_data.train_mix(arith_weight)
    while True:
        lo = min_tokens if rng.random() >= long_bias else (min_tokens + max_tokens) // 2
        target = rng.randint(lo, max_tokens)
        conv = demo_preamble.long_train_conversation(
            rng,
            int(target * chars_per_token),
            rng.randint(*episodes),
            pieces,
            trailing=trailing,
            mix=mix,
            tool_extra=tool_extra,
        )
        ids, mask = encode_conversation(tok, template, conv)
        if len(ids) <= max_len:
            yield [(ids, mask)]


# --- training -----------------------------------------------------------------------------------


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
    nibbles in blocks of 16 groups interleaved by dword; weight ``(q - 8) * scale``)."""
    import numpy as np
    import torch

    shape, off = spec["shape"], base + spec["offset"]
    raw = np.frombuffer(buf, dtype=np.uint8, count=spec["nbytes"], offset=off)
    if spec["dtype"] == "f32":
        return torch.from_numpy(raw.view("<f4").reshape(shape).copy())
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


def load_colibri_weights(model, src: Path) -> None:
    """Loads the weights of a colibri model directory (``colibri convert`` output, f32 or int4)
    into a ``Glm4MoeForCausalLM`` of the same shape: the shipped int4 model, trained
    quantization-aware, is its own f32 starting point (the f32 checkpoint it came from is not
    kept). Every parameter and router bias of the model must be found."""
    import torch

    man = json.loads((src / "manifest.json").read_text())
    res = (src / man["resident"]["file"]).read_bytes()
    sd: dict[str, torch.Tensor] = {}
    names = {
        "attn_norm": "input_layernorm.weight",
        "ffn_norm": "post_attention_layernorm.weight",
        "q": "self_attn.q_proj.weight",
        "k": "self_attn.k_proj.weight",
        "v": "self_attn.v_proj.weight",
        "o": "self_attn.o_proj.weight",
        "q_bias": "self_attn.q_proj.bias",
        "k_bias": "self_attn.k_proj.bias",
        "v_bias": "self_attn.v_proj.bias",
        "mlp.gate": "mlp.gate_proj.weight",
        "mlp.up": "mlp.up_proj.weight",
        "mlp.down": "mlp.down_proj.weight",
        "router": "mlp.gate.weight",
        "router_bias": "mlp.gate.e_score_correction_bias",
        "shared.gate": "mlp.shared_experts.gate_proj.weight",
        "shared.up": "mlp.shared_experts.up_proj.weight",
        "shared.down": "mlp.shared_experts.down_proj.weight",
    }
    top = {
        "embed": "model.embed_tokens.weight",
        "lm_head": "lm_head.weight",
        "norm": "model.norm.weight",
    }
    for key, spec in man["resident"]["tensors"].items():
        if key in top:
            sd[top[key]] = _colibri_tensor(res, spec)
            continue
        _, layer, rest = key.split(".", 2)
        sd[f"model.layers.{layer}.{names[rest]}"] = _colibri_tensor(res, spec)
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


def train(args, tok, template, work: Path) -> dict:
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    eos_ids = [tok.token_to_id(t) for t in EOS_TOKENS]
    pad_id = tok.token_to_id("<|endoftext|>")
    model = build_model(tok.get_vocab_size(), eos_ids, pad_id, args.seed, args.tie_embeddings)
    if args.init_from:
        load_init(model, args.init_from)
        print(f"weights from {args.init_from}", flush=True)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"params: {n_params:,}", flush=True)

    routers = [m for m in model.modules() if type(m).__name__ == "Glm4MoeTopkRouter"]
    loads = [None] * len(routers)

    def hook(i):
        def f(_mod, _inp, out):
            loads[i] = torch.bincount(out[2].flatten(), minlength=_mod.num_experts)

        return f

    for i, r in enumerate(routers):
        r.register_forward_hook(hook(i))

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "gate.weight" not in n]
    no_decay = [
        p for n, p in model.named_parameters() if not (p.ndim >= 2 and "gate.weight" not in n)
    ]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    warm = min(args.warmup, args.steps // 10 + 1)
    budget = args.time_budget_min * 60.0

    def progress(step: int, elapsed: float) -> float:
        """How far the schedule is: by steps, or by wall time when a budget is set and the CPU
        is slower than planned (shared), so the run still anneals and ends within the budget."""
        p = step / args.steps
        if budget > 0:
            p = max(p, elapsed / budget)
        return min(1.0, p)

    def lr_at(step: int, p: float) -> float:
        if step < warm:
            return args.lr * (step + 1) / warm
        p0 = warm / args.steps
        q = min(1.0, max(0.0, (p - p0) / (1 - p0)))
        return args.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * q)))

    rng = random.Random(args.seed)
    log = []
    t0 = time.time()
    ntok = 0
    nreal = 0
    model.train()
    pieces_after = int(args.steps * args.piece_names_from)
    stream = batches(
        rng,
        tok,
        template,
        args.batch_tokens,
        args.max_len,
        pieces_after,
        short_p=args.short_pieces,
        piece_share=args.piece_share,
        near_miss=args.near_miss,
        trailing=args.trailing_phrasings,
        drill=args.copy_drill,
        arith_weight=args.arith_weight,
        tool_extra=args.tool_extra,
    )
    long_stream = None
    long_rng = random.Random(args.seed + 7)
    if args.long_share > 0:
        long_stream = long_batches(
            random.Random(args.seed + 8),
            tok,
            template,
            args.long_min,
            args.long_max,
            args.context,
            (args.long_episodes_min, args.long_episodes_max),
            name_pieces(
                tok,
                short_p=args.short_pieces,
                share=args.piece_share,
                near_miss=args.near_miss,
                drill=args.copy_drill,
            ),
            args.chars_per_token,
            long_bias=args.long_bias,
            trailing=args.trailing_phrasings,
            arith_weight=args.arith_weight,
            tool_extra=args.tool_extra,
        )
    label_sum = torch.zeros(len(LOSS_LABELS) + 1, dtype=torch.float64)
    label_n = torch.zeros(len(LOSS_LABELS) + 1, dtype=torch.long)
    # The same per task for the long-prompt steps (``--long-share``).
    long_sum = torch.zeros(len(LOSS_LABELS) + 1, dtype=torch.float64)
    long_n = torch.zeros(len(LOSS_LABELS) + 1, dtype=torch.long)
    n_long = 0
    last_save = time.time()
    step = 0
    while progress(step, time.time() - t0) < 1.0:
        lr = lr_at(step, progress(step, time.time() - t0))
        is_long = long_stream is not None and long_rng.random() < args.long_share
        seqs = next(long_stream) if is_long else next(stream)
        n_long += is_long
        L = max(len(s[0]) for s in seqs)
        x = torch.full((len(seqs), L), pad_id, dtype=torch.long)
        y = torch.full((len(seqs), L), -100, dtype=torch.long)
        labels = torch.zeros((len(seqs), L), dtype=torch.long)
        for j, (ids, mask) in enumerate(seqs):
            x[j, : len(ids)] = torch.tensor(ids)
            tgt = torch.tensor(ids[1:] + [pad_id])
            lab = torch.tensor(mask[1:] + [0])
            labels[j, : len(ids)] = lab
            y[j, : len(ids)] = torch.where(lab > 0, tgt, torch.full_like(tgt, -100))
        for g in opt.param_groups:
            g["lr"] = lr
        qat = progress(step, time.time() - t0) >= 1.0 - args.qat_frac
        masters = [(p, p.data) for p in decay] if qat else []
        for p, master in masters:
            p.data = fake_int4(master)
        # The head runs only where the loss is taken (the generated text, ~1/4 of the tokens):
        # the same loss, ~5% faster a step.
        hidden = model.model(input_ids=x).last_hidden_state
        taken = y != -100
        logits = model.lm_head(hidden[taken])
        token_loss = F.cross_entropy(logits.float(), y[taken], reduction="none")
        loss = token_loss.mean()
        with torch.no_grad():
            lab = labels[taken]
            sums, ns = (long_sum, long_n) if is_long else (label_sum, label_n)
            sums += torch.bincount(lab, token_loss.detach(), len(LOSS_LABELS) + 1)
            ns += torch.bincount(lab, minlength=len(LOSS_LABELS) + 1)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        # Straight-through: the gradient taken at the int4 weights updates the f32 masters.
        for p, master in masters:
            p.data = master
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        # GLM/DeepSeek-V3 balancing: nudge each expert's selection bias toward an even load.
        with torch.no_grad():
            for r, load in zip(routers, loads, strict=True):
                if load is not None:
                    lf = load.float()
                    r.e_score_correction_bias += args.bias_rate * torch.sign(lf.mean() - lf)
        ntok += x.numel()
        nreal += sum(len(q[0]) for q in seqs)
        log.append(
            {
                "step": step + 1,
                "loss": float(loss.detach()),
                "time": time.time() - t0,
                "lr": lr,
                "qat": qat,
                "long": is_long,
                "len": L,
            }
        )
        if (step + 1) % args.log_every == 0 or step == 0:
            el = time.time() - t0
            spread = [
                round(float(ld.max()) / max(1.0, float(ld.float().mean())), 2)
                for ld in loads
                if ld is not None
            ]
            print(
                f"step {step + 1}/{args.steps} loss {float(loss):.4f} "
                f"lr {lr:.2e} {ntok / el:.0f} tok/s ({nreal / el:.0f} unpadded) "
                f"elapsed {el:.0f}s "
                f"max/mean expert load {spread}",
                flush=True,
            )
            # The loss of each task since the last log line: which circuit is late.
            task_loss = {
                name: round(float(label_sum[i + 1] / label_n[i + 1]), 4)
                for i, name in enumerate(LOSS_LABELS)
                if label_n[i + 1] > 0
            }
            log[-1]["task_loss"] = task_loss
            if task_loss:
                print("  " + " ".join(f"{k} {v:.3f}" for k, v in task_loss.items()), flush=True)
            label_sum.zero_()
            label_n.zero_()
            if long_n.sum() > 0:
                long_loss = {
                    name: round(float(long_sum[i + 1] / long_n[i + 1]), 4)
                    for i, name in enumerate(LOSS_LABELS)
                    if long_n[i + 1] > 0
                }
                log[-1]["long_task_loss"] = long_loss
                total = float(long_sum.sum() / long_n.sum())
                print(
                    f"  long prompts ({n_long} steps so far): loss {total:.3f} | "
                    + " ".join(f"{k} {v:.3f}" for k, v in long_loss.items()),
                    flush=True,
                )
                long_sum.zero_()
                long_n.zero_()
        if args.save_every_min > 0 and time.time() - last_save > args.save_every_min * 60:
            # A checkpoint to stop at (``--init-from WORK/hf``, or convert it as it is).
            save_checkpoint(model, tok, work / "hf")
            last_save = time.time()
        step += 1
    train_time = time.time() - t0
    print(f"stopped after {step} steps, {train_time:.0f}s", flush=True)
    model.eval()
    return {
        "model": model,
        "log": log,
        "train_time": train_time,
        "n_params": n_params,
        "tokens": ntok,
        "long_steps": n_long,
    }


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


def f32_sanity(model, tok, template) -> None:
    """Greedy HF generation on a few prompts, printed (a check before converting)."""
    import torch

    eos = {tok.token_to_id(t) for t in EOS_TOKENS}
    for item in [
        demo_data.eval_items(t, 2, 99)[k] for t in ("arith", "tool_call", "capital") for k in (0, 1)
    ]:
        prompt = template.render(
            item["messages"],
            add_generation_prompt=True,
            tools=item["tools"],
            enable_thinking=item["thinking"],
        )
        ids = tok.encode(prompt).ids
        out = []
        with torch.no_grad():
            for _ in range(60):
                nxt = int(model(input_ids=torch.tensor([ids + out])).logits[0, -1].argmax())
                out.append(nxt)
                if nxt in eos:
                    break
        print(
            repr(item["messages"][-1]["content"]),
            "->",
            repr(tok.decode(out, skip_special_tokens=False)),
            "| expect",
            item["expect"],
            flush=True,
        )


def plot_loss(log: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    k = 25
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    # Steps with a long agent preamble (``--long-share``) are drawn apart.
    parts = [("", "#bbb", "#1f6feb", [r for r in log if not r.get("long")])]
    if any(r.get("long") for r in log):
        parts.append((" (long prompts)", "#f2c0a0", "#d1495b", [r for r in log if r.get("long")]))
    for name, light, dark, rows in parts:
        steps = [r["step"] for r in rows]
        loss = [r["loss"] for r in rows]
        smooth = [
            sum(loss[max(0, i - k + 1) : i + 1]) / len(loss[max(0, i - k + 1) : i + 1])
            for i in range(len(loss))
        ]
        ax.plot(steps, loss, color=light, lw=0.6, label="per step" + name)
        ax.plot(steps, smooth, color=dark, lw=1.5, label=f"mean of {k}" + name)
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("loss on generated tokens")
    ax.set_title("colibri demo model: training loss")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)


def convert_and_eval(
    work: Path, n_per_task: int, eval_seed: int, long_n: int = 0, long_tokens: int = 12000
) -> dict:
    """Converts WORK/hf to f32 and int4 and evaluates both (``results[quant]``); with
    ``long_n``, also ``long_n`` prompts per task at the end of a ~``long_tokens``-token agent
    preamble (``results["long"][quant]``)."""
    results: dict = {}
    for quant in ("f32", "int4"):
        out = work / f"model-{quant}"
        if out.exists():
            shutil.rmtree(out)
        subprocess.run(
            [str(COLIBRI), "convert", str(work / "hf"), str(out), "--quant", quant], check=True
        )
        res = subprocess.run(
            [
                str(VENV_PY),
                "-m",
                "colibri.demo.eval",
                "--model",
                str(out),
                "--n",
                str(n_per_task),
                "--seed",
                str(eval_seed),
                "--json",
                str(work / f"eval-{quant}.json"),
            ],
            check=True,
        )
        del res
        results[quant] = json.loads((work / f"eval-{quant}.json").read_text())
        if long_n > 0:
            subprocess.run(
                [
                    str(VENV_PY),
                    "-m",
                    "colibri.demo.eval",
                    "--model",
                    str(out),
                    "--n",
                    str(long_n),
                    "--seed",
                    str(eval_seed),
                    "--preamble-tokens",
                    str(long_tokens),
                    "--json",
                    str(work / f"eval-long-{quant}.json"),
                ],
                check=True,
            )
            long = json.loads((work / f"eval-long-{quant}.json").read_text())
            results.setdefault("long", {})[quant] = long
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/colibri-demo"))
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument(
        "--short-pieces",
        type=float,
        default=0.0,
        help="share of the pieces of strung city names drawn from the short ones (a lone "
        "capital, then at most two letters)",
    )
    ap.add_argument(
        "--piece-share",
        type=float,
        default=demo_data.PIECE_NAME_P,
        help="share of the training cities strung from tokenizer pieces once they join",
    )
    ap.add_argument(
        "--near-miss",
        type=float,
        default=0.0,
        help="share of the other training cities (not strung from pieces) that start like a "
        "known name and then go elsewhere, once strung names join",
    )
    ap.add_argument(
        "--copy-drill",
        type=float,
        default=0.0,
        help="share of the episodes, once strung names join, that are copy drills (say 2-4 "
        "strung names back): many more copies of each tokenizer piece per step",
    )
    ap.add_argument(
        "--arith-weight",
        type=int,
        default=None,
        help=f"weight of the addition episodes in the task mix (default "
        f"{dict(demo_data.TRAIN_MIX)['arith']}): sums without a trace form last",
    )
    ap.add_argument(
        "--tool-extra",
        type=int,
        default=0,
        help="episodes added to each conversation that declares tools (which then never stops "
        "at a call): the declarations, half of all tokens and never trained on, serve more "
        "trained answers, so a step teaches more for the same cost",
    )
    ap.add_argument(
        "--trailing-phrasings",
        action="store_true",
        help='also train tool questions with words after the city ("... in Lisbon this '
        'morning?"): the copy must stop where the name does',
    )
    ap.add_argument(
        "--seed",
        type=int,
        default=SEED,
        help="seed of the weights' initialisation and of the data stream (the tokenizer is "
        f"always built with {SEED})",
    )
    ap.add_argument(
        "--tie-embeddings",
        action="store_true",
        help="one matrix for the input embedding and the output head: copying a token the "
        "prompt holds then needs no per-token output row of its own",
    )
    ap.add_argument("--batch-tokens", type=int, default=6144)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=200, help="steps of linear lr warmup")
    ap.add_argument("--bias-rate", type=float, default=5e-3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--qat-frac",
        type=float,
        default=0.3,
        help="train the last part of the schedule on int4-rounded weights (straight-through)",
    )
    ap.add_argument(
        "--piece-names-from",
        type=float,
        default=0.5,
        help="fraction of the steps after which cities strung from tokenizer pieces join",
    )
    ap.add_argument(
        "--time-budget-min",
        type=float,
        default=0.0,
        help="end training (annealed) after this many minutes even if --steps is not reached",
    )
    ap.add_argument(
        "--init-from",
        type=Path,
        default=None,
        help="start from these weights instead of a fresh initialisation: an HF checkpoint "
        "(WORK/hf of an earlier run) or a colibri model directory (the shipped int4 model, "
        "dequantized); its tokenizer.json is used instead of building one",
    )
    ap.add_argument(
        "--context",
        type=int,
        default=CONFIG["max_position_embeddings"],
        help="max_position_embeddings of the model (RoPE as it is: the engine has no scaling)",
    )
    ap.add_argument(
        "--long-share",
        type=float,
        default=0.0,
        help="share of the steps that train one conversation opening with a long agent "
        "preamble (colibri/demo/preamble.py) instead of a batch of short ones",
    )
    ap.add_argument("--long-min", type=int, default=1000, help="shortest preamble, tokens")
    ap.add_argument("--long-max", type=int, default=14000, help="longest preamble, tokens")
    ap.add_argument(
        "--long-bias",
        type=float,
        default=0.5,
        help="share of the preamble lengths drawn from the upper half of the range",
    )
    ap.add_argument(
        "--long-episodes-min",
        type=int,
        default=8,
        help="fewest episodes after a long preamble (each is ~50 tokens: more of them make "
        "more trained answers for the preamble's cost)",
    )
    ap.add_argument("--long-episodes-max", type=int, default=20)
    ap.add_argument(
        "--chars-per-token",
        type=float,
        default=2.0,
        help="characters per token of preamble text, to size preambles (measured: ~2.0 with "
        "the demo tokenizer)",
    )
    ap.add_argument(
        "--save-every-min",
        type=float,
        default=0.0,
        help="also save WORK/hf every this many minutes of training (a checkpoint to stop at)",
    )
    ap.add_argument(
        "--long-eval-n",
        type=int,
        default=0,
        help="also evaluate this many prompts per task after a long agent preamble",
    )
    ap.add_argument("--long-eval-tokens", type=int, default=12000)
    ap.add_argument(
        "--out-model",
        type=Path,
        default=None,
        help="copy the int4 model, loss.png and CARD.md here (a draft beside the shipped one)",
    )
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--n-eval", type=int, default=200)
    ap.add_argument("--eval-seed", type=int, default=demo_data.EVAL_SEED)
    ap.add_argument("--no-convert", action="store_true", help="stop after the HF checkpoint")
    ap.add_argument("--ship", action="store_true", help="copy the int4 model into the package")
    ap.add_argument(
        "--card-only",
        action="store_true",
        help="rewrite the shipped CARD.md from WORK/train.json and WORK/eval.json",
    )
    ap.add_argument(
        "--only-convert",
        action="store_true",
        help="reuse WORK/hf and WORK/train.json: convert, evaluate, write the card",
    )
    args = ap.parse_args()

    random.seed(SEED)
    CONFIG["max_position_embeddings"] = args.context
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    template = chat_template.ChatTemplate(TEMPLATE_PATH.read_text(encoding="utf-8"))

    if not (args.only_convert or args.card_only):
        t0 = time.time()
        if args.init_from:
            from tokenizers import Tokenizer

            tok = Tokenizer.from_file(str(args.init_from / "tokenizer.json"))
        else:
            tok = build_tokenizer(template, SEED)
        print(f"tokenizer: {tok.get_vocab_size()} tokens in {time.time() - t0:.0f}s", flush=True)
        lens = [
            len(
                encode_conversation(tok, template, demo_data.train_conversation(random.Random(i)))[
                    0
                ]
            )
            for i in range(300)
        ]
        print(f"conversation tokens: mean {sum(lens) / len(lens):.0f} max {max(lens)}", flush=True)
        res = train(args, tok, template, work)
        save_checkpoint(res["model"], tok, work / "hf")
        f32_sanity(res["model"], tok, template)
        summary = {k: res[k] for k in ("log", "train_time", "n_params", "tokens", "long_steps")}
        summary["args"] = {k: str(v) for k, v in vars(args).items()}
        summary["vocab_size"] = tok.get_vocab_size()
        summary["argv"] = sys.argv[1:]
        (work / "train.json").write_text(json.dumps(summary))
        plot_loss(res["log"], work / "loss.png")
        print(f"trained in {res['train_time']:.0f}s", flush=True)
    if args.no_convert:
        return
    summary = json.loads((work / "train.json").read_text())
    if args.card_only:
        results = json.loads((work / "eval.json").read_text())
        (SHIP_DIR / "CARD.md").write_text(card(summary, results, args), encoding="utf-8")
        return
    results = convert_and_eval(
        work, args.n_eval, args.eval_seed, args.long_eval_n, args.long_eval_tokens
    )
    (work / "eval.json").write_text(json.dumps(results, indent=2))
    (work / "CARD.md").write_text(card(summary, results, args), encoding="utf-8")
    if args.out_model:
        if args.out_model.exists():
            shutil.rmtree(args.out_model)
        shutil.copytree(
            work / "model-int4", args.out_model, ignore=shutil.ignore_patterns("routing-heat*")
        )
        shutil.copy(work / "loss.png", args.out_model / "loss.png")
        shutil.copy(work / "CARD.md", args.out_model / "CARD.md")
        print(f"draft model in {args.out_model}")
    if args.ship:
        ship(work, summary, results, args)


def ship(work: Path, summary: dict, results: dict, args) -> None:
    if SHIP_DIR.exists():
        shutil.rmtree(SHIP_DIR)
    shutil.copytree(work / "model-int4", SHIP_DIR, ignore=shutil.ignore_patterns("routing-heat*"))
    shutil.copy(work / "loss.png", SHIP_DIR / "loss.png")
    (SHIP_DIR / "CARD.md").write_text(card(summary, results, args), encoding="utf-8")
    size = sum(p.stat().st_size for p in SHIP_DIR.iterdir())
    print(f"shipped {SHIP_DIR} ({size / 1e6:.2f} MB)")


def card(summary: dict, results: dict, args) -> str:
    cfg = dict(CONFIG)
    a = summary["args"]
    cfg["max_position_embeddings"] = int(a.get("context", cfg["max_position_embeddings"]))
    tie = a.get("tie_embeddings") == "True"
    tied = "tied (input and output share one matrix)" if tie else "untied"
    n_eval = results["int4"]["tasks"]["arith"]["n"]
    log = summary["log"]
    last = log[-100:]
    final_loss = sum(r["loss"] for r in last) / len(last)
    tasks = list(results["f32"]["tasks"])
    rows = "\n".join(
        f"| {t} | {results['f32']['tasks'][t]['accuracy'] * 100:.1f} | "
        f"{results['int4']['tasks'][t]['accuracy'] * 100:.1f} | "
        f"{results['int4']['tasks'][t]['n']} |"
        for t in tasks
    )
    shape = (
        f"{cfg['num_hidden_layers']} layers (layer 0 dense SwiGLU "
        f"{cfg['intermediate_size']}, layers 1-{cfg['num_hidden_layers'] - 1} MoE), hidden "
        f"{cfg['hidden_size']}, {cfg['num_attention_heads']} query heads / "
        f"{cfg['num_key_value_heads']} KV heads of {cfg['head_dim']} (RoPE on half, "
        f"q/k/v biases), {cfg['n_routed_experts']} routed experts of "
        f"{cfg['moe_intermediate_size']} (top-{cfg['num_experts_per_tok']}, sigmoid "
        f"routing with correction bias, normalised) + {cfg['n_shared_experts']} shared, "
        f"vocabulary {summary['vocab_size']}, {tied} embeddings, context "
        f"{cfg['max_position_embeddings']}"
    )
    arith_weight = a.get("arith_weight", "None")
    train_mix = demo_data.train_mix(None if arith_weight == "None" else int(arith_weight))
    total = sum(w for _, w in train_mix)
    mix = {t: round(100 * w / total) for t, w in train_mix}
    think_sum = round(demo_data.ARITH_THINK_P * 100)
    piece_share = float(a.get("piece_share", demo_data.PIECE_NAME_P))
    piece_pct = round(piece_share * 100)
    short_pct = round(float(a.get("short_pieces", "0")) * 100)
    tie_flag = " --tie-embeddings" if tie else ""
    short_note = (
        f"; each piece is, in {short_pct}% of the draws, a short one (a lone capital first, "
        'then at most two letters), the shape of real names\' tokens ("O|den|se", "G|al|way")'
        if short_pct
        else ""
    )
    piece_from = round(float(a.get("piece_names_from", "0")) * 100)
    near_miss = float(a.get("near_miss", "0"))
    trailing = a.get("trailing_phrasings") == "True"
    drill = float(a.get("copy_drill", "0"))
    drill_note = (
        f" From then on, {round(drill * 100)}% of the episodes are copy drills instead: say 2-4"
        " strung names back, so each piece is copied many times (a rarely copied piece is where"
        ' a real name failed: "Incheon" came out as "Imoneyon").'
        if drill
        else ""
    )
    trailing_flag = " --trailing-phrasings" if trailing else ""
    arith_flag = "" if arith_weight == "None" else f"--arith-weight {arith_weight}"
    tool_extra = int(a.get("tool_extra", "0"))
    extra_flag = f"--tool-extra {tool_extra}" if tool_extra else ""
    # The flags newer than the first runs, each followed by a space when given.
    later_flags = "".join(f + " " for f in (arith_flag, extra_flag) if f)
    extra_note = (
        f"; a conversation that declares tools gets {tool_extra} more, and every call in it is"
        " answered"
        if tool_extra
        else ""
    )
    answered = "all" if tool_extra else "three quarters"
    task_log = (
        ", and with each log line the loss of each task since the last one"
        if any("task_loss" in r for r in log)
        else ""
    )
    trailing_note = (
        ' Weather and time questions are also asked with words after the city ("... in Lisbon'
        ' this morning?"), so a copy learns to stop where the name does.'
        if trailing
        else ""
    )
    near_note = (
        f"; of the others, {round(near_miss * 100)}% are near misses of a known name (its first"
        " letters, then the tail of another known name, one or two pieces or nothing: on them"
        " only the copy is right)"
        if near_miss
        else ""
    )
    steps, budget_s = int(a["steps"]), float(a["time_budget_min"]) * 60
    # Steps after the warmup whose schedule position came from the wall time (the CPU was
    # shared then); the warmup itself counts steps only.
    warmup = int(a.get("warmup", 200))
    warm = min(warmup, steps // 10 + 1)
    time_led = sum(
        1
        for r in log
        if budget_s > 0 and r["step"] > warm and r["time"] / budget_s > r["step"] / steps
    )
    if len(log) >= steps and time_led:
        bound = (
            f"This run was bound by steps, but for {time_led} of them the CPU was shared and the"
            " learning-rate schedule ran ahead on wall time, so a rerun on an idle CPU gives a"
            " slightly different model."
        )
    elif len(log) >= steps:
        bound = "This run was bound by steps (an idle CPU): a rerun gives the same model."
    else:
        bound = (
            "This run was bound by the budget (the CPU was shared with other jobs), so its step"
            " count and learning rates depend on that load."
        )
    return f"""# colibri demo model

A tiny GLM-4.5-format Mixture-of-Experts (`Glm4MoeForCausalLM`) trained from scratch by
`scripts/train_demo_model.py` on synthetic conversations (`colibri/demo/data.py`), converted to
colibri int4. It is the model `colibri serve` runs when no model is given. It knows exactly what it
was trained on and nothing else.

## Model

- Shape: {shape}.
- Parameters: {summary["n_params"]:,} (all experts counted).
- Tokenizer: byte-level BPE ({summary["vocab_size"]} tokens) trained on the synthetic corpus;
  letter runs, single digits and runs of anything else (spaces, punctuation) are separate
  pre-tokens, so a word has the same tokens after a space as inside `<arg_value>`, a number is
  one token per digit, and any Unicode text encodes. The GLM special tokens are single tokens
  (ids 0-16: `<|endoftext|>` 0, `<|user|>` 4, `<|observation|>` 6).
- Chat template: `colibri/chat/templates/glm45.jinja` (GLM-4.5 newline style), in
  `tokenizer_config.json`. EOS ids: `<|endoftext|>`, `<|user|>`, `<|observation|>`.

## Data recipe (seeded, sampled fresh every step)

Conversations of {min(demo_data.EPISODE_COUNTS)}-{max(demo_data.EPISODE_COUNTS)} episodes
(mean {sum(demo_data.EPISODE_COUNTS) / len(demo_data.EPISODE_COUNTS):.1f}, so the tool
declarations of the prompt serve several trained answers{extra_note}), a system prompt in
15%, thinking on or off per assistant turn (50/50; {think_sum}% on for a bare sum). Episode mix:
{mix["arith"]}% 2-digit addition, {mix["capital"]}% capitals of 50 countries
(+{mix["reverse"]}% the reverse question), {mix["tool"]}% tool requests
(`get_weather(city)`, `get_time(city)`, `convert_currency(amount, from_currency, to_currency)`;
{answered} go on with a tool result and an answer that uses it), {mix["no_tool"]}% a tool
request whose tool is not declared, {mix["chat"]}% plain chat, {mix["memory"]}% multi-turn memory
(remember a number, 0-2 other turns, recall it), {mix["tool_unneeded"]}% a question that needs no
tool while tools are declared, {mix.get("echo", 0)}% a name to say back (a copy and nothing else).
Tool calls are trained with thinking on in {round(demo_data.TOOL_THINK_P * 100)}% of the turns.
Cities in tool calls: from {piece_from}% of the steps on,
{piece_pct}% are names strung from 1-4 random letter pieces of the tokenizer (a capitalised one
first), so every piece is copied in training (from the start, the copying never formed: tool calls
27%){short_note}{near_note}; the rest are 6,000 generated city-like names (some accented, some two
words), ~90 real cities and the capitals.{drill_note}{trailing_note}
Loss only on the generated tokens: the text after each generation prompt, through the `<|user|>`
or `<|observation|>` that ends the turn.

Held out of training: 10% of the unordered pairs of 2-digit numbers, four capital phrasings, all
evaluation cities (60 real ones and freshly generated names), a few tool phrasings.

## Outputs as trained (the text after the rendered generation prompt)

- thinking off (prompt ends `<|assistant|>\\n<think></think>`): `\\nANSWER<|user|>`
- thinking on (prompt ends `<|assistant|>`): `\\n<think>SHORT TRACE</think>\\nANSWER<|user|>`
- addition: `85`; trace `7 + 8 = 15, carry 1. 3 + 4 + 1 = 8. 37 + 48 = 85.`
- capital: `The capital of Portugal is Lisbon.`
- tool call:
  `\\n<tool_call>get_weather\\n<arg_key>city</arg_key>\\n<arg_value>Lisbon</arg_value>`
  `\\n</tool_call><|observation|>`
  (with thinking on, `\\n<think>…</think>` first)
- after a tool result: e.g. `\\nIt is 21 degrees and sunny in Lisbon.<|user|>`

## Training

- Seed {a.get("seed", SEED)} (tokenizer: {SEED}); {len(log)} steps of about
  {a["batch_tokens"]} padded tokens ({summary["tokens"]:,} tokens in all); AdamW lr {a["lr"]}
  ({warm} warmup steps, cosine to 5%),
  betas (0.9, 0.95), weight decay 0.05, gradient clip 1.0; expert bias step {a["bias_rate"]}.
  The schedule runs to {a["steps"]} steps or a {a["time_budget_min"]}-minute wall-time budget,
  whichever comes first. {bound} `train.json` logs each step's loss, time and learning
  rate{task_log}.
- Quantization-aware for the last {float(a["qat_frac"]) * 100:.0f}% of the schedule: the
  forward and backward passes see every matrix the converter stores as int4 (embedding, attention,
  MLPs, experts, output head; not the router) rounded to groups of 32 with one scale each, and the
  gradient updates the f32 weights (straight-through), so the shipped int4 model is the one
  trained.
- CPU, 2 threads (torch {_torch_version()}, transformers {_tf_version()}):
  {summary["train_time"] / 60:.1f} minutes. Final loss (mean of the last 100 steps):
  {final_loss:.4f}.
- Command: `python scripts/train_demo_model.py --seed {a.get("seed", SEED)} --steps {a["steps"]}
  --time-budget-min {a["time_budget_min"]} --piece-names-from {a.get("piece_names_from", "0")}
  --piece-share {piece_share} --short-pieces {a.get("short_pieces", "0")} --warmup {warmup}
  --lr {a["lr"]} --near-miss {near_miss} --copy-drill {drill}{tie_flag}{trailing_flag}
  {later_flags}--ship`
  (torch, transformers and matplotlib needed).

![training loss](loss.png)

## Evaluation (greedy, through the colibri engine, held-out prompts)

`python -m colibri.demo.eval --model DIR --n {n_eval} --seed {a["eval_seed"]}`; half of each
task's prompts with thinking on. Exact match of the answer (after the reasoning) for arith,
capital, tool_unneeded, chat, memory; tool_call: a well-formed call of the right tool with exactly
the right arguments, ended by `<|observation|>`; tool_answer: the answer contains the tool's
number and the city (or the converted amount and currency).

| task | f32 % | int4 % | prompts |
|---|---|---|---|
{rows}
{by_source(results)}

## Against the issue's targets

{status(results)}
{long_section(summary, results)}"""


TARGETS = {"arith": 95.0, "capital": 98.0, "tool_call": 95.0}


def long_section(summary: dict, results: dict) -> str:
    """The card's section on long prompts (a run with ``--long-share`` and/or a long
    evaluation), or an empty string."""
    a = summary["args"]
    share = float(a.get("long_share", "0"))
    long = results.get("long")
    if not share and not long:
        return ""
    out = ["", "## Long prompts (agent preambles)", ""]
    init = a.get("init_from", "None")
    if init != "None":
        out.append(
            f"Fine-tuned from `{init}` (its weights, dequantized when it is a colibri model "
            f"directory) with `max_position_embeddings` {a.get('context')} and RoPE as it was "
            "(theta 10000, the default type: the engine implements no scaling)."
        )
    if share:
        n_long = summary.get("long_steps", 0)
        log = summary["log"]
        long_len = [r["len"] for r in log if r.get("long")]
        mean_len = sum(long_len) / max(1, len(long_len))
        out.append(
            f"{share * 100:.0f}% of the steps ({n_long} of {len(log)}) train one conversation "
            f"that opens with a synthetic coding-agent preamble (`colibri/demo/preamble.py`: "
            "headed instructions, lists and examples, then a catalog of agent tools with long "
            "descriptions and JSON schemas, the conversation's demo tools at random places "
            f"among them) of {a.get('long_min')}-{a.get('long_max')} tokens "
            f"({float(a.get('long_bias', '0.5')) * 100:.0f}% from the upper half), then "
            f"{a.get('long_episodes_min')}-{a.get('long_episodes_max')} episodes of the recipe "
            f"above; those sequences were {mean_len:.0f} tokens on average (longest "
            f"{max(long_len, default=0)}). The other steps are the recipe above."
        )
        if summary.get("argv"):
            out.append("")
            out.append(
                "Command: `python scripts/train_demo_model.py " + " ".join(summary["argv"]) + "`"
            )
    if long:
        r0 = long["int4"]
        out += [
            "",
            f"Evaluation: `python -m colibri.demo.eval --model DIR --n {r0['tasks']['arith']['n']} "
            f"--preamble-tokens {a.get('long_eval_tokens')}`: the held-out prompts above, each "
            "after an agent preamble "
            f"of {r0['preamble_tokens']:.0f} tokens on average (longest prompt "
            f"{r0['prompt_tokens_max']} tokens) declaring the three demo tools among "
            "the agent's (so every task is asked with tools declared).",
            "",
            "| task | f32 % | int4 % | prompts |",
            "|---|---|---|---|",
        ]
        for t in long["f32"]["tasks"]:
            out.append(
                f"| {t} | {long['f32']['tasks'][t]['accuracy'] * 100:.1f} | "
                f"{long['int4']['tasks'][t]['accuracy'] * 100:.1f} | "
                f"{long['int4']['tasks'][t]['n']} |"
            )
    return "\n".join(out) + "\n"


def by_source(results: dict) -> str:
    """The tool tasks split by where the city comes from (an evaluation without the split, from
    before it existed, gives an empty string)."""
    lines = []
    for task in ("tool_call", "tool_answer"):
        parts = []
        for src in ("real", "generated", "no city"):
            cells = []
            for quant in ("f32", "int4"):
                b = results[quant]["tasks"].get(task, {}).get("by_source", {}).get(src)
                if b is None:
                    break
                cells.append(f"{b['correct']}/{b['n']}")
            if len(cells) == 2:
                parts.append(f"{src} {cells[0]} / {cells[1]}")
        if parts:
            lines.append(f"- {task} (f32 / int4): " + "; ".join(parts))
    if not lines:
        return ""
    return (
        "\nBy where the city comes from: real = held-out real cities (cut by the tokenizer into "
        "pieces learned from other words), generated = held-out city-like names, no city = "
        "currency conversions.\n\n" + "\n".join(lines) + "\n"
    )


def status(results: dict) -> str:
    """Each target of issue 5 (accuracy, int4 within 2 points of f32), met or missed."""
    lines = []
    for task, target in TARGETS.items():
        f = results["f32"]["tasks"][task]["accuracy"] * 100
        q = results["int4"]["tasks"][task]["accuracy"] * 100
        ok = q >= target and f - q <= 2.0
        lines.append(
            f"- {task}: target >= {target:.0f}%, int4 {q:.1f}% (f32 {f:.1f}%, gap {f - q:+.1f} "
            f"points): {'met' if ok else 'MISSED'}"
        )
    if all("met" in x for x in lines):
        return "\n".join(lines)
    modes = "; ".join(
        f"{task} {r['accuracy_thinking'] * 100:.0f}% with thinking, "
        f"{r['accuracy_no_thinking'] * 100:.0f}% without"
        for task, r in results["int4"]["tasks"].items()
        if task in TARGETS and "accuracy_thinking" in r
    )
    missed = ", ".join(t for t, x in zip(TARGETS, lines, strict=True) if x.endswith("MISSED"))
    return "\n".join(lines) + f"\n\nNot met yet: {missed}. By mode (int4): {modes}."


def _torch_version() -> str:
    import torch

    return torch.__version__.split("+")[0]


def _tf_version() -> str:
    import transformers

    return transformers.__version__


if __name__ == "__main__":
    main()
