#!/usr/bin/env python3
"""Generate Hugging Face reference fixtures for colibri's correctness tests.

Run by hand, never by CI (it needs torch + transformers, which are NOT project
dependencies):

    python -m venv /root/refvenv
    /root/refvenv/bin/pip install torch transformers safetensors numpy tokenizers
    /root/refvenv/bin/python scripts/make_reference_fixtures.py

It writes, for each architecture in {olmoe, qwen3_moe, glm4_moe, deepseek_v3,
deepseek_v3_noqlora, glm_moe_dsa, glm_moe_dsa_yarn, glm_moe_dsa_shared, deepseek_v32,
deepseek_v4, qwen3_next, qwen3_next_ratios, kimi_linear, kimi_linear_lora}:

    tests/fixtures/<arch>/hf/            HF checkpoint (config.json, *.safetensors,
                                         tokenizer.json, tokenizer_config.json, ...)
    tests/fixtures/<arch>/reference.npz  logits / greedy tokens / Q4_0 error
    tests/fixtures/<arch>/tokenizer_cases.json  text -> ids and chat-template cases

Everything is seeded and deterministic.  The reference numbers are computed by
transformers from the checkpoint *as stored on disk* (reloaded with
from_pretrained, upcast to float32, eager attention, eager experts), so the
rounding to bf16 / f16 is part of the fixture.

See tests/fixtures/README.md for what every file contains.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path

import numpy as np
import tokenizers
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    DeepseekV4Config,
    DeepseekV4ForCausalLM,
    DeepseekV32Config,
    DeepseekV32ForCausalLM,
    Glm4MoeConfig,
    Glm4MoeForCausalLM,
    GlmMoeDsaConfig,
    GlmMoeDsaForCausalLM,
    KimiLinearConfig,
    KimiLinearForCausalLM,
    OlmoeConfig,
    OlmoeForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
)

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures"

# Seed-search acceptance thresholds: greedy decoding and expert routing must not
# hinge on near ties, otherwise an f32 engine that differs from torch in the last
# ulp could legitimately disagree.
MIN_GREEDY_MARGIN = 0.05  # min top1 - top2 logit gap over all greedy steps
MIN_ROUTER_GAP = 0.002  # min gap at the routing decision boundary (see router_gaps)
MIN_INDEX_GAP = 1e-4  # min gap at the DSA indexer's top-k cut (see IndexerProbe)
N_GREEDY = 12
MIN_DISTINCT = 4  # greedy continuations must not collapse into one repeated token
PROMPT_LENS = (1, 9, 33)

SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|system|>", "<|user|>", "<|assistant|>"]
PAD, BOS, EOS = 0, 1, 2

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' }}{{ message['content'] }}{{ eos_token }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)

CORPUS = """\
The quick brown fox jumps over the lazy dog while the cat sleeps in the warm sun.
A mixture of experts routes every token to a small number of feed forward networks.
Each expert is a gated linear unit; the router picks the top experts for each token.
Rotary position embeddings rotate pairs of query and key features by an angle.
The attention scores are scaled by the inverse square root of the head dimension.
RMS normalisation divides by the root mean square and multiplies by a learned weight.
In the beginning the engine reads the configuration, then the tokenizer, then the weights.
Quantisation stores blocks of thirty two weights with one half precision scale each.
def forward(self, hidden_states): return self.down_proj(self.act(self.gate(x)) * self.up(x))
for (i, x) in values.iter().enumerate() { total += x * weights[i]; }
Numbers like 3.14159, 2.71828, 1024, 65536 and 1e-6 appear in configuration files.
She sells sea shells by the sea shore, and the shells she sells are surely sea shells.
How much wood would a woodchuck chuck if a woodchuck could chuck wood?
Colibri is a small bird that hovers; it is also a small inference engine written in Rust.
The weather today is cloudy with a chance of rain in the afternoon and clear skies at night.
Tokens are generated one at a time by taking the most likely next token, which is greedy decoding.
Hello, world! Hello again, world. Goodbye, world; see you tomorrow, world?
Über café naïve résumé façade coöperate — unicode text must round trip through bytes.
Key value caches store the keys and values of previous positions so they are not recomputed.
Shared experts are always active, while routed experts are chosen by a sigmoid gate with a bias.
Group limited routing first picks the best groups of experts and then the best experts inside them.
The correction bias changes which experts are selected but not the weights that multiply them.
"""

PROMPT_TEXT = (
    "The router picks the top experts for each token, and the engine must reproduce the "
    "reference logits exactly, one token at a time, in the beginning and at the end."
)


# --------------------------------------------------------------------------------------
# Model specs
# --------------------------------------------------------------------------------------

SPECS = {
    # OLMoE: 6 query heads / 2 kv heads, head_dim = 72/6 = 12 (OLMoE has no head_dim key),
    # q/k RMSNorm over the whole projection (72 and 24 wide), softmax-then-topk routing,
    # norm_topk_prob False, 8 experts top-5, float32 single file.
    "olmoe": dict(
        cls=OlmoeForCausalLM,
        cfg_cls=OlmoeConfig,
        tok_vocab=397,
        storage=torch.float32,
        shards=1,
        seed=1000,
        cfg=dict(
            vocab_size=397,
            hidden_size=72,
            intermediate_size=40,
            num_hidden_layers=3,
            num_attention_heads=6,
            num_key_value_heads=2,
            num_experts=8,
            num_experts_per_tok=5,
            norm_topk_prob=False,
            rms_norm_eps=1e-5,
            max_position_embeddings=256,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            tie_word_embeddings=False,
            attention_bias=False,
            clip_qkv=None,
            pad_token_id=PAD,
            bos_token_id=BOS,
            eos_token_id=EOS,
        ),
    ),
    # Qwen3-MoE: 4/4 heads, explicit head_dim 20 (!= 56/4), per-head q/k norm,
    # layer 1 dense (mlp_only_layers=[1]), 7 experts top-3, norm_topk_prob True,
    # bf16 in 2 shards, config vocab 467 > tokenizer vocab 451 (padded embedding rows).
    "qwen3_moe": dict(
        cls=Qwen3MoeForCausalLM,
        cfg_cls=Qwen3MoeConfig,
        tok_vocab=451,
        storage=torch.bfloat16,
        shards=2,
        seed=2000,
        cfg=dict(
            vocab_size=467,
            hidden_size=56,
            intermediate_size=88,
            moe_intermediate_size=40,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=4,
            head_dim=20,
            num_experts=7,
            num_experts_per_tok=3,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[1],
            rms_norm_eps=1e-6,
            max_position_embeddings=256,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            tie_word_embeddings=False,
            attention_bias=False,
            use_sliding_window=False,
            pad_token_id=PAD,
            bos_token_id=BOS,
            eos_token_id=EOS,
        ),
    ),
    # GLM-4-MoE: 5 query heads / 1 kv head, explicit head_dim 16 (!= 60/5), partial
    # rotary 0.5 (first 8 dims of each head rotated), q/k/v bias (o_proj no bias),
    # per-head q/k norm, layer 0 dense, 8 routed experts in 2 groups, top-1 group,
    # top-3 experts, 1 shared expert, sigmoid router + nonzero e_score_correction_bias,
    # routed_scaling_factor 2.5.  float16 single file; router weight and correction
    # bias stay float32 (as transformers keeps them: _keep_in_fp32_modules_strict).
    "glm4_moe": dict(
        cls=Glm4MoeForCausalLM,
        cfg_cls=Glm4MoeConfig,
        tok_vocab=509,
        storage=torch.float16,
        shards=1,
        seed=3000,
        cfg=dict(
            vocab_size=509,
            hidden_size=60,
            intermediate_size=56,
            moe_intermediate_size=24,
            num_hidden_layers=3,
            num_attention_heads=5,
            num_key_value_heads=1,
            head_dim=16,
            n_routed_experts=8,
            num_experts_per_tok=3,
            n_group=2,
            topk_group=1,
            n_shared_experts=1,
            first_k_dense_replace=1,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            use_qk_norm=True,
            attention_bias=True,
            rms_norm_eps=1e-5,
            max_position_embeddings=256,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.5,
            },
            num_nextn_predict_layers=0,
            tie_word_embeddings=False,
            pad_token_id=PAD,
            bos_token_id=BOS,
            eos_token_id=EOS,
        ),
    ),
    # DeepSeek-V3 (MLA): 3 heads (kv heads = heads, as DeepSeek has), q_lora_rank 24 (q_a_proj +
    # q_a_layernorm + q_b_proj), kv_lora_rank 20, qk_nope 12 / qk_rope 8 / v_head_dim 10 (all
    # different), interleaved rope (rope_interleave, the default), YaRN factor 4 over a pretend
    # 64-position pretraining length with mscale 1.0 and mscale_all_dim 0.8 (so both the cos/sin
    # factor and the softmax scale move), layer 0 dense, 9 routed experts in 3 groups (top-2
    # groups, top-3 experts), 1 shared expert, sigmoid + correction bias, x2.5. bf16 single
    # file; router weight and correction bias f32.
    "deepseek_v3": dict(
        cls=DeepseekV3ForCausalLM,
        cfg_cls=DeepseekV3Config,
        tok_vocab=463,
        storage=torch.bfloat16,
        shards=1,
        seed=4000,
        cfg=dict(
            vocab_size=463,
            hidden_size=56,
            intermediate_size=72,
            moe_intermediate_size=20,
            num_hidden_layers=3,
            num_attention_heads=3,
            num_key_value_heads=3,
            q_lora_rank=24,
            kv_lora_rank=20,
            qk_nope_head_dim=12,
            qk_rope_head_dim=8,
            v_head_dim=10,
            n_routed_experts=9,
            num_experts_per_tok=3,
            n_group=3,
            topk_group=2,
            n_shared_experts=1,
            first_k_dense_replace=1,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            rope_interleave=True,
            attention_bias=False,
            rms_norm_eps=1e-6,
            max_position_embeddings=256,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 64,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "mscale": 1.0,
                "mscale_all_dim": 0.8,
            },
            num_mtp_layers=0,
            tie_word_embeddings=False,
            pad_token_id=PAD,
            bos_token_id=BOS,
            eos_token_id=EOS,
        ),
    ),
    # DeepSeek-V3 without q_lora_rank (a plain q_proj, as DeepSeek-V2-Lite has): 4 heads,
    # kv_lora_rank 16, qk_nope 8 / qk_rope 6 / v_head_dim 12, rotate-half rope
    # (rope_interleave false), YaRN factor 2 with mscale = mscale_all_dim = 1.0 (DeepSeek's own
    # setting: cos/sin unscaled, softmax scale x mscale^2), 2 dense layers then MoE (3 layers),
    # 8 experts in 4 groups (top-2 groups, top-3 experts), 1 shared expert. f16 single file.
    "deepseek_v3_noqlora": dict(
        cls=DeepseekV3ForCausalLM,
        cfg_cls=DeepseekV3Config,
        tok_vocab=421,
        storage=torch.float16,
        shards=1,
        seed=5000,
        cfg=dict(
            vocab_size=421,
            hidden_size=48,
            intermediate_size=64,
            moe_intermediate_size=16,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=4,
            q_lora_rank=None,
            kv_lora_rank=16,
            qk_nope_head_dim=8,
            qk_rope_head_dim=6,
            v_head_dim=12,
            n_routed_experts=8,
            num_experts_per_tok=3,
            n_group=4,
            topk_group=2,
            n_shared_experts=1,
            first_k_dense_replace=2,
            routed_scaling_factor=1.8,
            norm_topk_prob=True,
            rope_interleave=False,
            attention_bias=False,
            rms_norm_eps=1e-6,
            max_position_embeddings=256,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 2.0,
                "original_max_position_embeddings": 128,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
            },
            num_mtp_layers=0,
            tie_word_embeddings=False,
            pad_token_id=PAD,
            bos_token_id=BOS,
            eos_token_id=EOS,
        ),
    ),
    # GLM-5 (MLA + the DSA lightning indexer): 3 heads, q_lora_rank 24 (required: the indexer
    # reads the normed low-rank query), kv_lora_rank 20, qk_nope 12 / qk_rope 8 / v 10,
    # interleaved rope (always, in GLM-5), default RoPE; indexer 6 heads of 12 (8 rotated + 4
    # plain), top-7 (not a power of two, below the 9- and 33-token prompts: selection happens),
    # layer 0 dense, 9 experts in 3 groups (top-2 groups, top-3), 1 shared, x2.5. bf16; router
    # weight, correction bias and the indexer's weights_proj f32.
    "glm_moe_dsa": dict(
        cls=GlmMoeDsaForCausalLM,
        cfg_cls=GlmMoeDsaConfig,
        tok_vocab=443,
        storage=torch.bfloat16,
        shards=1,
        seed=6000,
        cfg=dict(
            vocab_size=443,
            hidden_size=56,
            intermediate_size=72,
            moe_intermediate_size=20,
            num_hidden_layers=3,
            num_attention_heads=3,
            num_key_value_heads=3,
            q_lora_rank=24,
            kv_lora_rank=20,
            qk_nope_head_dim=12,
            qk_rope_head_dim=8,
            v_head_dim=10,
            index_n_heads=6,
            index_head_dim=12,
            index_topk=7,
            n_routed_experts=9,
            num_experts_per_tok=3,
            n_group=3,
            topk_group=2,
            n_shared_experts=1,
            first_k_dense_replace=1,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            attention_bias=False,
            rms_norm_eps=1e-5,
            max_position_embeddings=256,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            tie_word_embeddings=False,
            pad_token_id=PAD,
            bos_token_id=BOS,
            eos_token_id=EOS,
        ),
    ),
    # GLM-5 with other awkward shapes: 4 heads, q_lora_rank 20, kv_lora_rank 16, qk_nope 8 /
    # qk_rope 6 / v 12, YaRN factor 2 over 128 with mscale_all_dim 1.0 (softmax scale moves;
    # the indexer's rope gets the scaled cos/sin too); indexer 5 heads of 10 (6 rotated + 4
    # plain), top-5; layers 0-1 dense (mlp_layer_types), 6 experts in one group (GLM-5's
    # n_group 1), top-2, x1.8. f16; router, correction bias and weights_proj f32.
    "glm_moe_dsa_yarn": dict(
        cls=GlmMoeDsaForCausalLM,
        cfg_cls=GlmMoeDsaConfig,
        tok_vocab=401,
        storage=torch.float16,
        shards=1,
        seed=7000,
        cfg=dict(
            vocab_size=401,
            hidden_size=48,
            intermediate_size=64,
            moe_intermediate_size=16,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=4,
            q_lora_rank=20,
            kv_lora_rank=16,
            qk_nope_head_dim=8,
            qk_rope_head_dim=6,
            v_head_dim=12,
            index_n_heads=5,
            index_head_dim=10,
            index_topk=5,
            n_routed_experts=6,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            n_shared_experts=1,
            first_k_dense_replace=2,
            routed_scaling_factor=1.8,
            norm_topk_prob=True,
            attention_bias=False,
            rms_norm_eps=1e-5,
            max_position_embeddings=256,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 2.0,
                "original_max_position_embeddings": 128,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
            },
            tie_word_embeddings=False,
            pad_token_id=PAD,
            bos_token_id=BOS,
            eos_token_id=EOS,
        ),
    ),
    # GLM-5 with a shared indexer (index_topk_freq 2, index_skip_topk_offset 1: layers 0 and 2
    # run their indexer, layers 1 and 3 reuse the previous one's top-k, as GLM's IndexShare
    # configs do with freq 4): 4 layers, otherwise glm_moe_dsa's shapes, indexer 8 heads x 12,
    # top-6, 8 experts in one group. bf16; router, correction bias and weights_proj f32.
    "glm_moe_dsa_shared": dict(
        cls=GlmMoeDsaForCausalLM,
        cfg_cls=GlmMoeDsaConfig,
        tok_vocab=433,
        storage=torch.bfloat16,
        shards=1,
        seed=8000,
        cfg=dict(
            vocab_size=433,
            hidden_size=56,
            intermediate_size=72,
            moe_intermediate_size=20,
            num_hidden_layers=4,
            num_attention_heads=3,
            num_key_value_heads=3,
            q_lora_rank=24,
            kv_lora_rank=20,
            qk_nope_head_dim=12,
            qk_rope_head_dim=8,
            v_head_dim=10,
            index_n_heads=8,
            index_head_dim=12,
            index_topk=6,
            index_topk_freq=2,
            index_skip_topk_offset=1,
            n_routed_experts=8,
            num_experts_per_tok=3,
            n_group=1,
            topk_group=1,
            n_shared_experts=1,
            first_k_dense_replace=1,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            attention_bias=False,
            rms_norm_eps=1e-5,
            max_position_embeddings=256,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            tie_word_embeddings=False,
            pad_token_id=PAD,
            bos_token_id=BOS,
            eos_token_id=EOS,
        ),
    ),
    # DeepSeek-V3.2: GLM-5's DSA with an indexer in every layer and the indexer's rope on the
    # two halves (the MLA's own rope interleaved); 3 layers, 4 heads, q_lora_rank 16,
    # kv_lora_rank 24, qk_nope 8 / qk_rope 8 / v 12; indexer 8 heads of 16 (8 rotated + 8
    # plain), top-6 (below the prompts); layer 0 dense, 8 experts in 4 groups (top-2 groups,
    # top-2), 1 shared, x2.5. bf16; router, correction bias and weights_proj f32.
    "deepseek_v32": dict(
        cls=DeepseekV32ForCausalLM,
        cfg_cls=DeepseekV32Config,
        tok_vocab=421,
        storage=torch.bfloat16,
        shards=1,
        seed=9000,
        cfg=dict(
            vocab_size=421,
            hidden_size=64,
            intermediate_size=80,
            moe_intermediate_size=24,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=4,
            q_lora_rank=16,
            kv_lora_rank=24,
            qk_nope_head_dim=8,
            qk_rope_head_dim=8,
            v_head_dim=12,
            index_n_heads=8,
            index_head_dim=16,
            index_topk=6,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_group=4,
            topk_group=2,
            n_shared_experts=1,
            first_k_dense_replace=1,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            attention_bias=False,
            rms_norm_eps=1e-6,
            max_position_embeddings=256,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            tie_word_embeddings=False,
            pad_token_id=PAD,
            bos_token_id=BOS,
            eos_token_id=EOS,
        ),
    ),
    # DeepSeek-V4 (transformers' deepseek_v4): hyper-connections over 3 residual streams
    # (Sinkhorn-mixed), shared-KV MQA with head_dim 16 (the last 8 rotated, interleaved),
    # per-head sinks, the low-rank query with its unweighted per-head norm, a grouped output
    # projection (2 groups to rank 10), and the three layer kinds: sliding window 6 only, + HCA
    # (one compressed entry per 8 tokens) and + CSA (overlapping windows of 4; an indexer of 6
    # heads x 12 keeps the top 3 entries, below the 33-token prompt's 8; with 3 heads ReLU zeros
    # tied at the cut). Main RoPE theta 10000 plain; compressor layers theta 160000 with YaRN x4
    # over 64 (attention factor 1, as V4 defines it). Layers 0-1 hash-routed (tid2eid), 2-3
    # sqrt-softplus top-3 of 7 with the correction bias, 1 shared expert, x1.5, SwiGLU clamped
    # at 1.5. bf16; routers, bias, hyper-connection weights, sinks and position biases f32.
    "deepseek_v4": dict(
        cls=DeepseekV4ForCausalLM,
        cfg_cls=DeepseekV4Config,
        tok_vocab=409,
        storage=torch.bfloat16,
        shards=1,
        seed=10000,
        cfg=dict(
            vocab_size=409,
            hidden_size=40,
            moe_intermediate_size=20,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=16,
            q_lora_rank=12,
            partial_rotary_factor=0.5,
            num_experts_per_tok=3,
            n_routed_experts=7,
            n_shared_experts=1,
            scoring_func="sqrtsoftplus",
            norm_topk_prob=True,
            routed_scaling_factor=1.5,
            max_position_embeddings=256,
            rope_theta=10000.0,
            compress_rope_theta=160000.0,
            rope_parameters={
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 64,
                "beta_fast": 32,
                "beta_slow": 1,
            },
            layer_types=[
                "sliding_attention",
                "heavily_compressed_attention",
                "compressed_sparse_attention",
                "compressed_sparse_attention",
            ],
            compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
            mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"],
            hc_mult=3,
            hc_sinkhorn_iters=20,
            hc_eps=1e-6,
            swiglu_limit=1.5,
            sliding_window=6,
            o_groups=2,
            o_lora_rank=10,
            index_n_heads=6,
            index_head_dim=12,
            index_topk=3,
            num_nextn_predict_layers=0,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
            pad_token_id=PAD,
            bos_token_id=BOS,
            eos_token_id=EOS,
        ),
    ),
    # Qwen3-Next (transformers' qwen3_next): 4 layers, linear (gated DeltaNet) x2, full
    # (gated attention), linear. DeltaNet: 2 key heads of 8 serving 4 value heads of 10 (two
    # each), causal conv of 4, gated RMSNorm out. Attention: 4 heads / 2 kv heads of 12, the
    # output gated per head, q/k norms zero-centred (1 + w), partial rotary 0.5 (first 6 dims).
    # Layer 1 dense (mlp_only_layers), the others 7 experts top-3 softmax (renormalised) with a
    # shared expert of 24 behind a sigmoid gate. bf16; routers f32.
    "qwen3_next": dict(
        cls=Qwen3NextForCausalLM,
        cfg_cls=Qwen3NextConfig,
        tok_vocab=419,
        storage=torch.bfloat16,
        shards=1,
        seed=11000,
        cfg=dict(
            vocab_size=419,
            hidden_size=48,
            intermediate_size=64,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=12,
            partial_rotary_factor=0.5,
            layer_types=[
                "linear_attention",
                "linear_attention",
                "full_attention",
                "linear_attention",
            ],
            linear_conv_kernel_dim=4,
            linear_key_head_dim=8,
            linear_value_head_dim=10,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            decoder_sparse_step=1,
            mlp_only_layers=[1],
            moe_intermediate_size=20,
            shared_expert_intermediate_size=24,
            num_experts_per_tok=3,
            num_experts=7,
            norm_topk_prob=True,
            rms_norm_eps=1e-6,
            max_position_embeddings=256,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            tie_word_embeddings=False,
            pad_token_id=PAD,
            bos_token_id=BOS,
            eos_token_id=EOS,
        ),
    ),
    # Qwen3-Next with other ratios: 6 layers from the default schedule (full_attention_interval
    # 3: layers 2 and 5 full), one key head serving 3 value heads (k 12, v 6), a 2-tap
    # convolution, 3 heads / 1 kv head of 16 with the default partial rotary (0.25: 4 dims), MoE
    # every other layer (decoder_sparse_step 2), 9 experts top-2 without renormalisation, a
    # shared expert of 8. f16; routers f32.
    "qwen3_next_ratios": dict(
        cls=Qwen3NextForCausalLM,
        cfg_cls=Qwen3NextConfig,
        tok_vocab=389,
        storage=torch.float16,
        shards=1,
        seed=12000,
        cfg=dict(
            vocab_size=389,
            hidden_size=40,
            intermediate_size=56,
            num_hidden_layers=6,
            num_attention_heads=3,
            num_key_value_heads=1,
            head_dim=16,
            full_attention_interval=3,
            linear_conv_kernel_dim=2,
            linear_key_head_dim=12,
            linear_value_head_dim=6,
            linear_num_key_heads=1,
            linear_num_value_heads=3,
            decoder_sparse_step=2,
            moe_intermediate_size=18,
            shared_expert_intermediate_size=8,
            num_experts_per_tok=2,
            num_experts=9,
            norm_topk_prob=False,
            rms_norm_eps=1e-6,
            max_position_embeddings=256,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            tie_word_embeddings=False,
            pad_token_id=PAD,
            bos_token_id=BOS,
            eos_token_id=EOS,
        ),
    ),
    # Kimi Linear (transformers' kimi_linear): 5 layers, KDA x2, MLA, KDA, MLA. KDA: 3 heads of
    # 8, a causal conv of 4 over q, k and v (three conv tensors in the checkpoint), a
    # per-channel forget gate (low rank 8), the output gated by a low-rank sigmoid gate. MLA with
    # NoPE: 4 heads, full q_proj, latent 16, 12 plain + 8 "rope" dims (never rotated), v 10.
    # Layers 0 and 2 dense (mlp_layer_types), the others 8 experts in 2 groups (the best 1
    # kept), top-3 sigmoid with the correction bias, renormalised, x2.446, one shared expert.
    # bf16; routers, correction biases and dt_bias f32.
    "kimi_linear": dict(
        cls=KimiLinearForCausalLM,
        cfg_cls=KimiLinearConfig,
        tok_vocab=409,
        storage=torch.bfloat16,
        shards=1,
        seed=13000,
        cfg=dict(
            vocab_size=409,
            hidden_size=48,
            intermediate_size=64,
            num_hidden_layers=5,
            num_attention_heads=4,
            num_key_value_heads=4,
            q_lora_rank=None,
            kv_lora_rank=16,
            qk_nope_head_dim=12,
            qk_rope_head_dim=8,
            v_head_dim=10,
            layer_types=[
                "linear_attention",
                "linear_attention",
                "full_attention",
                "linear_attention",
                "full_attention",
            ],
            mlp_layer_types=["dense", "sparse", "dense", "sparse", "sparse"],
            linear_head_dim=8,
            linear_num_heads=3,
            linear_conv_kernel_dim=4,
            moe_intermediate_size=20,
            num_local_experts=8,
            num_experts_per_tok=3,
            n_group=2,
            topk_group=1,
            n_shared_experts=1,
            norm_topk_prob=True,
            routed_scaling_factor=2.446,
            rms_norm_eps=1e-5,
            model_max_length=256,
            tie_word_embeddings=False,
            pad_token_id=PAD,
            bos_token_id=BOS,
            eos_token_id=EOS,
        ),
    ),
    # Kimi Linear with the published checkpoint's config layout (rewritten after saving:
    # `linear_attn_config` with 1-indexed `full_attn_layers` / `kda_layers`, `head_dim`,
    # `num_heads`, `short_conv_kernel_size`; `first_k_dense_replace` instead of the per-layer
    # lists): 4 layers (KDA, KDA, MLA, MLA), KDA 2 heads of 12 with a 2-tap conv, MLA with a
    # low-rank query (24), 3 heads, latent 12, 8 + 4 dims, v 6; layer 0 dense, 6 experts top-2
    # in one group, not renormalised, two shared experts. f16; routers f32.
    "kimi_linear_lora": dict(
        cls=KimiLinearForCausalLM,
        cfg_cls=KimiLinearConfig,
        tok_vocab=389,
        storage=torch.float16,
        shards=1,
        seed=14000,
        checkpoint_config=dict(
            drop=(
                "layer_types",
                "mlp_layer_types",
                "linear_head_dim",
                "linear_num_heads",
                "linear_conv_kernel_dim",
            ),
            add=dict(
                linear_attn_config=dict(
                    full_attn_layers=[3, 4],
                    kda_layers=[1, 2],
                    head_dim=12,
                    num_heads=2,
                    short_conv_kernel_size=2,
                ),
                first_k_dense_replace=1,
            ),
        ),
        cfg=dict(
            vocab_size=389,
            hidden_size=40,
            intermediate_size=56,
            num_hidden_layers=4,
            num_attention_heads=3,
            num_key_value_heads=3,
            q_lora_rank=24,
            kv_lora_rank=12,
            qk_nope_head_dim=8,
            qk_rope_head_dim=4,
            v_head_dim=6,
            layer_types=[
                "linear_attention",
                "linear_attention",
                "full_attention",
                "full_attention",
            ],
            mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
            linear_head_dim=12,
            linear_num_heads=2,
            linear_conv_kernel_dim=2,
            moe_intermediate_size=14,
            num_local_experts=6,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            n_shared_experts=2,
            norm_topk_prob=False,
            routed_scaling_factor=1.5,
            rms_norm_eps=1e-6,
            model_max_length=256,
            tie_word_embeddings=False,
            pad_token_id=PAD,
            bos_token_id=BOS,
            eos_token_id=EOS,
        ),
    ),
}

# Parameters that stay float32 in the stored checkpoint regardless of `storage`.
_ROUTER_F32 = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")
# transformers keeps the indexer's head weights in f32 (`_keep_in_fp32_modules`).
_DSA_F32 = _ROUTER_F32 + ("indexer.weights_proj.weight",)
# DeepSeek-V4 keeps its hyper-connections, sinks and compressor position biases in f32
# (`_keep_in_fp32_modules_strict`).
_V4_F32 = (
    "_hc.fn",
    "_hc.base",
    "_hc.scale",
    "hc_head.hc_fn",
    "hc_head.hc_base",
    "hc_head.hc_scale",
    "self_attn.sinks",
    "position_bias",
)
KEEP_F32 = {
    "glm4_moe": _ROUTER_F32,
    "deepseek_v3": _ROUTER_F32,
    "deepseek_v3_noqlora": _ROUTER_F32,
    "glm_moe_dsa": _DSA_F32,
    "glm_moe_dsa_yarn": _DSA_F32,
    "glm_moe_dsa_shared": _DSA_F32,
    "deepseek_v32": _DSA_F32,
    "deepseek_v4": _ROUTER_F32 + _V4_F32,
    "qwen3_next": ("mlp.gate.weight",),
    "qwen3_next_ratios": ("mlp.gate.weight",),
    "kimi_linear": _ROUTER_F32 + ("dt_bias",),
    "kimi_linear_lora": _ROUTER_F32 + ("dt_bias",),
}
# Architectures with sigmoid, group-limited routing and a correction bias.
SIGMOID_ROUTED = (
    "glm4_moe",
    "deepseek_v3",
    "deepseek_v3_noqlora",
    "glm_moe_dsa",
    "glm_moe_dsa_yarn",
    "glm_moe_dsa_shared",
    "deepseek_v32",
    "kimi_linear",
    "kimi_linear_lora",
)
# Architectures with the DSA indexer.
DSA = ("glm_moe_dsa", "glm_moe_dsa_yarn", "glm_moe_dsa_shared", "deepseek_v32")


# --------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------


def build_tokenizer(vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = [line for line in CORPUS.splitlines() if line.strip()]
    tok.train_from_iterator(lines, trainer=trainer)
    got = tok.get_vocab_size(with_added_tokens=True)
    assert got == vocab_size, f"tokenizer vocab {got} != {vocab_size}: enlarge CORPUS"
    for i, s in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(s) == i
    return tok


def write_tokenizer(hf_dir: Path, tok: Tokenizer) -> None:
    tok.save(str(hf_dir / "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|bos|>",
        "eos_token": "<|eos|>",
        "pad_token": "<|pad|>",
        "add_bos_token": False,
        "add_eos_token": False,
        "model_max_length": 256,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    with open(hf_dir / "tokenizer_config.json", "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
        f.write("\n")


def tokenizer_cases(hf_dir: Path) -> dict:
    t = AutoTokenizer.from_pretrained(str(hf_dir))
    texts = [
        "",
        "Hello, world!",
        "The quick brown fox jumps over the lazy dog.",
        "  leading spaces and\ttabs\nnewlines  ",
        "Über café naïve — ✓ 🐦 unseen: zqxj",
        "<|user|>special tokens inline<|eos|>",
        PROMPT_TEXT,
    ]
    enc = [{"text": s, "ids": t.encode(s, add_special_tokens=False)} for s in texts]
    for e in enc:
        assert t.decode(e["ids"]) == e["text"], e
    conv = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hello, world!"},
    ]
    rendered = t.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
    chat_ids = t(rendered, add_special_tokens=False)["input_ids"]
    return {
        "vocab_size": len(t),
        "special_tokens": {s: i for i, s in enumerate(SPECIAL_TOKENS)},
        "bos_token_id": BOS,
        "eos_token_id": EOS,
        "pad_token_id": PAD,
        "encode": enc,
        "chat": {
            "messages": conv,
            "add_generation_prompt": True,
            "rendered": rendered,
            "ids": chat_ids,
        },
    }


def make_prompts(tok: Tokenizer) -> list[list[int]]:
    ids = tok.encode(PROMPT_TEXT).ids
    assert len(ids) >= max(PROMPT_LENS) - 1, len(ids)
    return [[BOS] + ids[: n - 1] for n in PROMPT_LENS]


# --------------------------------------------------------------------------------------
# Weights
# --------------------------------------------------------------------------------------


# Standard deviations used by randomize(); chosen so logits are spread (std ~3-5),
# routing is varied and greedy continuations do not collapse into repeating one token.
SCALES = {
    "embed": 0.6,  # embed_tokens ~ N(0, embed)
    "linear_gain": 1.0,  # every other 2-D/3-D weight ~ N(0, gain / sqrt(fan_in))
    "lm_head_gain": 5.0,
    "router_gain": {
        "olmoe": 2.5,
        "qwen3_moe": 2.5,
        "glm4_moe": 1.5,
        "deepseek_v3": 1.5,
        "deepseek_v3_noqlora": 1.5,
        "glm_moe_dsa": 1.5,
        "glm_moe_dsa_yarn": 1.5,
        "glm_moe_dsa_shared": 1.5,
        "deepseek_v32": 1.5,
        "deepseek_v4": 1.5,
        "qwen3_next": 2.5,
        "qwen3_next_ratios": 2.5,
        "kimi_linear": 1.5,
        "kimi_linear_lora": 1.5,
    },
    "bias": 0.3,
    "e_score_correction_bias": 0.08,
    "norm_lo": 0.8,  # norm weights ~ U(norm_lo, norm_hi)
    "norm_hi": 1.2,
}


def randomize(model: torch.nn.Module, arch: str, seed: int) -> None:
    """Overwrite every parameter/buffer with spread-out deterministic values."""
    g = torch.Generator().manual_seed(seed)
    S = SCALES

    def normal(shape, std):
        return torch.randn(shape, generator=g, dtype=torch.float32) * std

    state = dict(model.named_parameters())
    state.update({n: b for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")})
    for name in sorted(state):
        p = state[name]
        shape = tuple(p.shape)
        if name.endswith("e_score_correction_bias"):
            v = normal(shape, S["e_score_correction_bias"])
        elif name.endswith(("_hc.base", "hc_head.hc_base")):  # DeepSeek-V4's hyper-connections
            v = normal(shape, 0.5)
        elif name.endswith(("_hc.scale", "hc_head.hc_scale")):
            v = 0.5 + torch.rand(shape, generator=g)
        elif name.endswith("linear_attn.A_log"):  # Qwen3-Next: per-step decay exp(-A softplus)
            v = torch.log(0.05 + 0.95 * torch.rand(shape, generator=g))
        elif name.endswith("forget_gate.A_log"):  # Kimi Linear: exp(A_log) x softplus(..)
            v = torch.log(0.05 + 0.95 * torch.rand(shape, generator=g))
        elif name.endswith(("linear_attn.dt_bias", "forget_gate.dt_bias")):
            v = normal(shape, 0.5)
        elif name.endswith("self_attn.sinks"):
            v = normal(shape, 1.0)
        elif name.endswith("position_bias"):
            v = normal(shape, 0.5)
        elif (
            arch.startswith("qwen3_next")
            and name.endswith("norm.weight")
            and not name.endswith("linear_attn.norm.weight")
        ):  # zero-centred: the norm multiplies by 1 + w
            v = normal(shape, 0.1)
        elif name.endswith("norm.weight"):
            v = S["norm_lo"] + (S["norm_hi"] - S["norm_lo"]) * torch.rand(shape, generator=g)
        elif name.endswith(".bias"):
            v = normal(shape, S["bias"])
        elif name.endswith("embed_tokens.weight"):
            v = normal(shape, S["embed"])
        elif name == "lm_head.weight":
            v = normal(shape, S["lm_head_gain"] / math.sqrt(shape[-1]))
        elif name.endswith("mlp.gate.weight"):
            v = normal(shape, S["router_gain"][arch] / math.sqrt(shape[-1]))
        else:
            assert len(shape) in (2, 3), name
            v = normal(shape, S["linear_gain"] / math.sqrt(shape[-1]))
        with torch.no_grad():
            p.copy_(v)
    # DeepSeek-V4's hash routers: each token's experts, distinct, drawn at random.
    for name, b in model.named_buffers():
        if name.endswith("tid2eid"):
            E = model.config.n_routed_experts
            rows = [torch.randperm(E, generator=g)[: b.shape[1]] for _ in range(b.shape[0])]
            with torch.no_grad():
                b.copy_(torch.stack(rows))


def storage_dtype(arch: str, name: str) -> torch.dtype:
    if any(name.endswith(s) for s in KEEP_F32.get(arch, ())):
        return torch.float32
    return SPECS[arch]["storage"]


def round_to_storage(model: torch.nn.Module, arch: str) -> None:
    """Round every weight to its storage dtype, keeping the model in float32."""
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if "rotary_emb" in name or not t.is_floating_point():
                continue
            t.copy_(t.to(storage_dtype(arch, name)).to(torch.float32))


def cast_for_save(model: torch.nn.Module, arch: str) -> None:
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if "rotary_emb" in name or not t.is_floating_point():
                continue
            t.data = t.data.to(storage_dtype(arch, name))


# --------------------------------------------------------------------------------------
# Reference computations
# --------------------------------------------------------------------------------------


class RouterProbe:
    """Records router logits of every MoE layer to measure routing-decision gaps."""

    def __init__(self, model, arch):
        self.arch = arch
        self.records = []
        self.handles = []
        for name, mod in model.named_modules():
            if name.endswith("mlp.gate") and hasattr(mod, "weight"):
                self.handles.append(mod.register_forward_hook(self._hook(mod)))

    def _hook(self, mod):
        def f(_m, _inp, out):
            self.records.append((mod, out[0].detach().double()))

        return f

    def clear(self):
        self.records = []

    def min_gap(self) -> float:
        gaps = []
        for mod, logits in self.records:
            k = mod.top_k
            if hasattr(mod, "tid2eid"):  # DeepSeek-V4's hash routing: no decision to gap
                continue
            if self.arch == "deepseek_v4":
                s = torch.nn.functional.softplus(logits).sqrt()
                s = s + mod.e_score_correction_bias.double()
                srt = s.sort(dim=-1, descending=True)[0]
                gaps.append((srt[:, k - 1] - srt[:, k]).min().item())
            elif self.arch in SIGMOID_ROUTED:
                s = torch.sigmoid(logits) + mod.e_score_correction_bias.double()
                ng, tg = mod.num_group, mod.topk_group
                grouped = s.view(-1, ng, s.shape[-1] // ng)
                gscore = grouped.topk(2, dim=-1)[0].sum(-1)  # [T, ng]
                gs = gscore.sort(dim=-1, descending=True)[0]
                if tg < ng:  # with every group kept there is no group cut
                    gaps.append((gs[:, tg - 1] - gs[:, tg]).min().item())
                gidx = gscore.topk(tg, dim=-1)[1]
                mask = torch.zeros_like(gscore).scatter_(1, gidx, 1).bool()
                masked = grouped.masked_fill(~mask[..., None], float("-inf")).reshape(s.shape)
                srt = masked.sort(dim=-1, descending=True)[0]
                nxt = srt[:, k]
                gaps.append(
                    (srt[:, k - 1] - nxt)[torch.isfinite(nxt)].min().item()
                    if torch.isfinite(nxt).any()
                    else 1.0
                )
            else:
                srt = logits.sort(dim=-1, descending=True)[0]
                gaps.append((srt[:, k - 1] - srt[:, k]).min().item())
        return min(gaps)


class IndexerProbe:
    """Recomputes (in float64) the DSA indexer's scores of every query and records the gap
    at the top-k cut, so a fixture's selection never hinges on a near tie (or an exact one:
    torch's choice among tied scores is its sort's, not a rule an engine can follow)."""

    def __init__(self, model):
        self.gaps = []
        self.selecting = 0  # queries with more positions than the top-k
        self.handles = [
            mod.register_forward_pre_hook(self._hook, with_kwargs=True)
            for name, mod in model.named_modules()
            if name.endswith("self_attn.indexer")
        ]

    def _hook(self, mod, args, kwargs):
        hidden, q_resid, (cos, sin) = args[0], args[1], args[2]
        h, qr = hidden[0].double(), q_resid[0].double()
        T, rd = h.shape[0], mod.qk_rope_head_dim
        q = (qr @ mod.wq_b.weight.double().T).view(T, mod.n_heads, mod.head_dim)
        k = torch.nn.functional.layer_norm(
            h @ mod.wk.weight.double().T,
            (mod.head_dim,),
            mod.k_norm.weight.double(),
            mod.k_norm.bias.double(),
            mod.k_norm.eps,
        )
        c, sn = cos[0, :, : rd // 2].double(), sin[0, :, : rd // 2].double()

        def rope(x, c, sn):  # interleaved pairs, as apply_rotary_pos_emb_interleave
            x1, x2 = x[..., 0:rd:2], x[..., 1:rd:2]
            return torch.cat([x1 * c - x2 * sn, x2 * c + x1 * sn, x[..., rd:]], -1)

        q, k = rope(q, c[:, None, :], sn[:, None, :]), rope(k, c, sn)
        sc = torch.relu(torch.einsum("thd,sd->ths", q, k) * mod.softmax_scale)
        w = (h @ mod.weights_proj.weight.double().T) * mod.n_heads**-0.5
        scores = torch.einsum("th,ths->ts", w, sc)
        for t in range(T):
            if t + 1 > mod.index_topk:
                srt = scores[t, : t + 1].sort(descending=True)[0]
                self.gaps.append((srt[mod.index_topk - 1] - srt[mod.index_topk]).item())
                self.selecting += 1

    def min_gap(self) -> float:
        return min(self.gaps, default=1.0)


@torch.no_grad()
def logits_of(model, ids: list[int]) -> torch.Tensor:
    x = torch.tensor([ids], dtype=torch.long)
    return model(input_ids=x, use_cache=False).logits[0].float()


@torch.no_grad()
def greedy(model, prompt: list[int]) -> tuple[list[int], float]:
    """Argmax loop with full recomputation (no cache, no eos stop)."""
    seq = list(prompt)
    margin = float("inf")
    for _ in range(N_GREEDY):
        last = logits_of(model, seq)[-1]
        top2 = torch.topk(last, 2)
        margin = min(margin, (top2.values[0] - top2.values[1]).item())
        seq.append(int(top2.indices[0]))
    return seq[len(prompt) :], margin


def evaluate(model, arch, prompts):
    probe = RouterProbe(model, arch)
    out = {"logits": [], "greedy": [], "margin": []}
    for p in prompts:
        out["logits"].append(logits_of(model, p))
        toks, m = greedy(model, p)
        out["greedy"].append(toks)
        out["margin"].append(m)
    # Routing gaps over every position ever fed to the model (prompt + greedy prefix).
    probe.clear()
    for p, toks in zip(prompts, out["greedy"], strict=True):
        logits_of(model, p + toks[:-1])
    out["router_gap"] = probe.min_gap()
    for h in probe.handles:
        h.remove()
    out["index_gap"], out["index_selecting"] = 1.0, 0
    if arch == "deepseek_v4":  # the indexer's cut, from the float64 forward
        cfg = model.config.to_dict()
        W = {k: v.double().numpy() for k, v in model.state_dict().items()}
        V4_INDEX_GAPS.clear()
        for p, toks in zip(prompts, out["greedy"], strict=True):
            numpy_forward_v4(cfg, W, p + toks[:-1])
        out["index_gap"], out["index_selecting"] = min(V4_INDEX_GAPS), len(V4_INDEX_GAPS)
    if arch in DSA:
        ip = IndexerProbe(model)
        for p, toks in zip(prompts, out["greedy"], strict=True):
            logits_of(model, p + toks[:-1])
        out["index_gap"], out["index_selecting"] = ip.min_gap(), ip.selecting
        for h in ip.handles:
            h.remove()
    return out


def q4_0_roundtrip(w: torch.Tensor) -> torch.Tensor:
    """ggml Q4_0 quantize -> dequantize along the last dim (rows zero-padded to 32)."""
    shape = w.shape
    n = shape[-1]
    pad = (-n) % 32
    x = w.reshape(-1, n).float()
    if pad:
        x = torch.cat([x, torch.zeros(x.shape[0], pad)], dim=1)
    b = x.view(x.shape[0], -1, 32)
    idx = b.abs().argmax(dim=-1, keepdim=True)  # first max |x| wins, as in ggml
    m = torch.gather(b, -1, idx)
    d = m / -8.0
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    q = torch.clamp(torch.floor(b * inv + 8.5), max=15.0)  # == clamp(round(x/d)+8, 0, 15)
    q = torch.where(d != 0, q, torch.full_like(q, 8.0))
    d16 = d.to(torch.float16).to(torch.float32)
    deq = (q - 8.0) * d16
    return deq.view(x.shape)[:, :n].reshape(shape)


def is_quantized(name: str, t: torch.Tensor) -> bool:
    # Routers and the indexer's head weights stay f32 (as in colibri's int4 models).
    # DeepSeek-V4's hyper-connection weights and compressor position biases too.
    return t.dim() >= 2 and not name.endswith(
        (
            "mlp.gate.weight",
            "indexer.weights_proj.weight",
            "scorer.weights_proj.weight",
            "_hc.fn",
            "hc_head.hc_fn",
            "position_bias",
        )
    )


def kv_b_q4_0_roundtrip(w: torch.Tensor, cfg) -> torch.Tensor:
    """MLA's kv_b_proj as llama.cpp's converter stores it (conversion/deepseek.py): split per
    head into k_b, transposed (so its Q4_0 groups run along qk_nope_head_dim), and v_b (groups
    along kv_lora_rank, as in the checkpoint); colibri's int4 splits it the same way."""
    heads, nope, v = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
    kv_b = w.reshape(heads, nope + v, w.shape[-1])
    k_b, v_b = torch.split(kv_b, [nope, v], dim=1)
    k_b = q4_0_roundtrip(k_b.transpose(1, 2).contiguous()).transpose(1, 2)
    return torch.cat([k_b, q4_0_roundtrip(v_b)], dim=1).reshape(w.shape)


@torch.no_grad()
def q4_0_model(model) -> tuple[torch.nn.Module, list[str]]:
    import copy

    qm = copy.deepcopy(model)
    names = []
    for name, p in qm.named_parameters():
        if name.endswith("kv_b_proj.weight"):
            p.copy_(kv_b_q4_0_roundtrip(p, qm.config))
            names.append(name)
        elif is_quantized(name, p):
            p.copy_(q4_0_roundtrip(p))
            names.append(name)
    if qm.config.tie_word_embeddings:
        assert qm.lm_head.weight.data_ptr() == qm.model.embed_tokens.weight.data_ptr()
    return qm, names


# --------------------------------------------------------------------------------------
# Independent float64 NumPy forward pass (self-check and executable spec)
# --------------------------------------------------------------------------------------


def load_checkpoint(hf_dir: Path) -> tuple[dict, dict]:
    """config.json + every tensor of every *.safetensors file, upcast to float64."""
    from safetensors import safe_open

    cfg = json.loads((hf_dir / "config.json").read_text())
    W = {}
    for fn in sorted(hf_dir.glob("*.safetensors")):
        with safe_open(str(fn), "pt") as f:
            for k in f.keys():
                W[k] = f.get_tensor(k).to(torch.float64).numpy()
    return cfg, W


def numpy_forward(cfg: dict, W: dict, ids: list[int]) -> np.ndarray:
    """Plain float64 re-implementation of the three HF forward passes (no cache)."""
    arch = cfg["model_type"]
    if arch == "deepseek_v4":
        return numpy_forward_v4(cfg, v4_module_names(W), ids)
    if arch == "qwen3_next":  # both Qwen3-Next fixtures (the config's model_type)
        return numpy_forward_qwen3_next(cfg, W, ids)
    if arch == "kimi_linear":
        return numpy_forward_kimi_linear(cfg, W, ids)
    H = cfg["hidden_size"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or H // nh
    eps = cfg["rms_norm_eps"]
    rope = cfg["rope_parameters"]
    rd = int(hd * rope.get("partial_rotary_factor", 1.0))  # rotated dims: the first rd of each head
    T = len(ids)

    def rms(x, w):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w

    def silu(x):
        return x / (1.0 + np.exp(-x))

    def mlp(h, pre):
        return (silu(h @ W[pre + "gate_proj.weight"].T) * (h @ W[pre + "up_proj.weight"].T)) @ W[
            pre + "down_proj.weight"
        ].T

    inv = 1.0 / rope["rope_theta"] ** (np.arange(0, rd, 2, dtype=np.float64) / rd)
    ang = np.arange(T, dtype=np.float64)[:, None] * inv[None, :]
    cos = np.cos(np.concatenate([ang, ang], -1))[:, None, :]  # [T, 1, rd]
    sin = np.sin(np.concatenate([ang, ang], -1))[:, None, :]

    def rope_fn(x):  # x [T, heads, hd]; rotate_half (NeoX) style on the first rd dims
        xr, xp = x[..., :rd], x[..., rd:]
        half = rd // 2
        rot = np.concatenate([-xr[..., half:], xr[..., :half]], -1)
        return np.concatenate([xr * cos + rot * sin, xp], -1)

    x = W["model.embed_tokens.weight"][ids]
    mask = np.triu(np.full((T, T), -np.inf), 1)
    index_mask = None  # the last DSA indexer's selection (shared layers reuse it)
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        h = rms(x, W[p + "input_layernorm.weight"])
        a = p + "self_attn."
        if arch in ("deepseek_v3", "glm_moe_dsa", "deepseek_v32"):
            o, index_mask = numpy_mla(cfg, W, a, h, mask, index_mask)
            x = x + o
        else:
            q, k, v = (h @ W[a + n + "_proj.weight"].T for n in "qkv")
            if a + "q_proj.bias" in W:
                q = q + W[a + "q_proj.bias"]
                k, v = k + W[a + "k_proj.bias"], v + W[a + "v_proj.bias"]
            if arch == "olmoe":  # norm over the whole projection, before the head split
                q, k = rms(q, W[a + "q_norm.weight"]), rms(k, W[a + "k_norm.weight"])
                if cfg.get("clip_qkv") is not None:
                    c = cfg["clip_qkv"]
                    q, k, v = np.clip(q, -c, c), np.clip(k, -c, c), np.clip(v, -c, c)
            q, k, v = q.reshape(T, nh, hd), k.reshape(T, nkv, hd), v.reshape(T, nkv, hd)
            if arch == "qwen3_moe" or (arch == "glm4_moe" and cfg.get("use_qk_norm")):  # per head
                q, k = rms(q, W[a + "q_norm.weight"]), rms(k, W[a + "k_norm.weight"])
            q, k = rope_fn(q), rope_fn(k)
            o = np.zeros((T, nh, hd))
            for i in range(nh):
                j = i // (nh // nkv)
                sc = q[:, i] @ k[:, j].T * hd**-0.5 + mask
                sc = np.exp(sc - sc.max(-1, keepdims=True))
                o[:, i] = (sc / sc.sum(-1, keepdims=True)) @ v[:, j]
            o = o.reshape(T, nh * hd) @ W[a + "o_proj.weight"].T
            if a + "o_proj.bias" in W:
                o = o + W[a + "o_proj.bias"]
            x = x + o
        h = rms(x, W[p + "post_attention_layernorm.weight"])
        m = p + "mlp."
        if m + "gate.weight" not in W:  # dense layer
            x = x + mlp(h, m)
            continue
        E = W[m + "gate.weight"].shape[0]
        K = cfg["num_experts_per_tok"]
        r = h @ W[m + "gate.weight"].T  # [T, E]
        if arch in ("glm4_moe", "deepseek_v3", "glm_moe_dsa", "deepseek_v32"):
            s = 1.0 / (1.0 + np.exp(-r))
            sc = s + W[m + "gate.e_score_correction_bias"]
            ng, tg = cfg["n_group"], cfg["topk_group"]
            g = np.sort(sc.reshape(T, ng, E // ng), -1)[..., -2:].sum(-1)  # sum of top-2 per group
            keep = np.argsort(-g, -1, kind="stable")[:, :tg]
            gm = np.zeros((T, ng), bool)
            np.put_along_axis(gm, keep, True, -1)
            sc = np.where(np.repeat(gm, E // ng, -1), sc, -np.inf)
            idx = np.argsort(-sc, -1, kind="stable")[:, :K]
            w = np.take_along_axis(s, idx, -1)  # weights from the *uncorrected* sigmoid
            if cfg["norm_topk_prob"]:
                w = w / (w.sum(-1, keepdims=True) + 1e-20)
            w = w * cfg["routed_scaling_factor"]
        else:
            pr = np.exp(r - r.max(-1, keepdims=True))
            pr /= pr.sum(-1, keepdims=True)
            idx = np.argsort(-pr, -1, kind="stable")[:, :K]
            w = np.take_along_axis(pr, idx, -1)
            if cfg["norm_topk_prob"]:
                w = w / w.sum(-1, keepdims=True)
        out = np.zeros_like(h)
        for t in range(T):
            for e, we in zip(idx[t], w[t], strict=True):
                out[t] += we * mlp(h[t : t + 1], f"{m}experts.{e}.")[0]
        if m + "shared_experts.gate_proj.weight" in W:
            out += mlp(h, m + "shared_experts.")
        x = x + out
    x = rms(x, W["model.norm.weight"])
    head = W.get("lm_head.weight", W["model.embed_tokens.weight"])  # tied if absent
    return x @ head.T


def numpy_forward_qwen3_next(cfg: dict, W: dict, ids: list[int]) -> np.ndarray:
    """Qwen3-Next in float64 (transformers' qwen3_next, no cache): the gated DeltaNet in its
    recurrent form, one position at a time."""
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    eps, T = cfg["rms_norm_eps"], len(ids)
    rd = int(hd * cfg["rope_parameters"].get("partial_rotary_factor", 1.0))
    nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    hk, hv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    K = cfg["linear_conv_kernel_dim"]
    r = nv // nk

    def rms(x, w=None, plus_one=True):
        y = x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)
        if w is None:
            return y
        return y * (1.0 + w) if plus_one else y * w

    def silu(x):
        return x / (1.0 + np.exp(-x))

    def sigmoid(x):
        return 1.0 / (1.0 + np.exp(-x))

    inv = 1.0 / cfg["rope_parameters"]["rope_theta"] ** (np.arange(0, rd, 2, dtype=np.float64) / rd)
    ang = np.arange(T, dtype=np.float64)[:, None] * inv[None, :]
    cos = np.cos(np.concatenate([ang, ang], -1))[:, None, :]
    sin = np.sin(np.concatenate([ang, ang], -1))[:, None, :]

    def rope(x):  # rotate_half on the first rd dims of each head
        xr, xp = x[..., :rd], x[..., rd:]
        rot = np.concatenate([-xr[..., rd // 2 :], xr[..., : rd // 2]], -1)
        return np.concatenate([xr * cos + rot * sin, xp], -1)

    def mlp(h, pre):
        gate, up = h @ W[pre + "gate_proj.weight"].T, h @ W[pre + "up_proj.weight"].T
        return (silu(gate) * up) @ W[pre + "down_proj.weight"].T

    def full_attention(h, a):
        qg = (h @ W[a + "q_proj.weight"].T).reshape(T, nh, 2 * hd)
        q, gate = qg[..., :hd], qg[..., hd:].reshape(T, nh * hd)
        q = rope(rms(q, W[a + "q_norm.weight"]))
        k = rope(rms((h @ W[a + "k_proj.weight"].T).reshape(T, nkv, hd), W[a + "k_norm.weight"]))
        v = (h @ W[a + "v_proj.weight"].T).reshape(T, nkv, hd)
        mask = np.triu(np.full((T, T), -np.inf), 1)
        o = np.zeros((T, nh, hd))
        for i in range(nh):
            j = i // (nh // nkv)
            sc = q[:, i] @ k[:, j].T * hd**-0.5 + mask
            sc = np.exp(sc - sc.max(-1, keepdims=True))
            o[:, i] = (sc / sc.sum(-1, keepdims=True)) @ v[:, j]
        return (o.reshape(T, nh * hd) * sigmoid(gate)) @ W[a + "o_proj.weight"].T

    def delta_net(h, a):
        qkvz = (h @ W[a + "in_proj_qkvz.weight"].T).reshape(T, nk, 2 * hk + 2 * r * hv)
        ba = (h @ W[a + "in_proj_ba.weight"].T).reshape(T, nk, 2 * r)
        q, k = qkvz[..., :hk], qkvz[..., hk : 2 * hk]
        v = qkvz[..., 2 * hk : 2 * hk + r * hv].reshape(T, nv * hv)
        z = qkvz[..., 2 * hk + r * hv :].reshape(T, nv, hv)
        b, av = ba[..., :r].reshape(T, nv), ba[..., r:].reshape(T, nv)
        mixed = np.concatenate([q.reshape(T, nk * hk), k.reshape(T, nk * hk), v], -1)
        w = W[a + "conv1d.weight"][:, 0, :]  # [channels, K]
        padded = np.concatenate([np.zeros((K - 1, mixed.shape[1])), mixed])
        conv = np.stack([(padded[t : t + K] * w.T).sum(0) for t in range(T)])
        conv = silu(conv)
        q = conv[:, : nk * hk].reshape(T, nk, hk)
        k = conv[:, nk * hk : 2 * nk * hk].reshape(T, nk, hk)
        v = conv[:, 2 * nk * hk :].reshape(T, nv, hv)
        q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6) * hk**-0.5
        k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
        beta = sigmoid(b)
        g = -np.exp(W[a + "A_log"]) * np.logaddexp(0.0, av + W[a + "dt_bias"])
        out = np.zeros((T, nv, hv))
        for j in range(nv):
            S = np.zeros((hk, hv))
            kh = j // r
            for t in range(T):
                S = S * np.exp(g[t, j])
                delta = (v[t, j] - S.T @ k[t, kh]) * beta[t, j]
                S = S + np.outer(k[t, kh], delta)
                out[t, j] = S.T @ q[t, kh]
        out = rms(out, W[a + "norm.weight"], plus_one=False) * silu(z)
        return out.reshape(T, nv * hv) @ W[a + "out_proj.weight"].T

    x = W["model.embed_tokens.weight"][ids]
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        h = rms(x, W[p + "input_layernorm.weight"])
        if cfg["layer_types"][layer] == "full_attention":
            x = x + full_attention(h, p + "self_attn.")
        else:
            x = x + delta_net(h, p + "linear_attn.")
        h = rms(x, W[p + "post_attention_layernorm.weight"])
        m = p + "mlp."
        if m + "gate.weight" not in W:
            x = x + mlp(h, m)
            continue
        logits = h @ W[m + "gate.weight"].T
        pr = np.exp(logits - logits.max(-1, keepdims=True))
        pr /= pr.sum(-1, keepdims=True)
        kk = cfg["num_experts_per_tok"]
        idx = np.argsort(-pr, -1, kind="stable")[:, :kk]
        wts = np.take_along_axis(pr, idx, -1)
        if cfg["norm_topk_prob"]:
            wts = wts / wts.sum(-1, keepdims=True)
        out = np.zeros_like(h)
        gu, dn = W.get(m + "experts.gate_up_proj"), W.get(m + "experts.down_proj")
        for t in range(T):
            for e, we in zip(idx[t], wts[t], strict=True):
                if gu is not None:
                    inter = dn.shape[-1]
                    gate, up = h[t] @ gu[e, :inter].T, h[t] @ gu[e, inter:].T
                    out[t] += we * ((silu(gate) * up) @ dn[e].T)
                else:
                    out[t] += we * mlp(h[t : t + 1], f"{m}experts.{e}.")[0]
        shared = mlp(h, m + "shared_expert.") * sigmoid(h @ W[m + "shared_expert_gate.weight"].T)
        x = x + out + shared
    x = rms(x, W["model.norm.weight"])
    return x @ W["lm_head.weight"].T


def kimi_linear_layout(cfg: dict) -> tuple[list[str], list[str], int, int, int]:
    """Kimi Linear's layer types, MLP types and KDA (head_dim, num_heads, conv kernel) from
    either config layout, as transformers' KimiLinearConfig reads them."""
    lin = cfg.get("linear_attn_config") or {}
    n = cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    if types is None:
        if "full_attn_layers" in lin and "kda_layers" in lin:
            types = [None] * n
            for i in lin["full_attn_layers"]:
                types[i - 1] = "full_attention"
            for i in lin["kda_layers"]:
                types[i - 1] = "linear_attention"
        else:
            types = ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(n)]
    mlp = cfg.get("mlp_layer_types")
    if mlp is None:
        k = cfg.get("first_k_dense_replace", 1)
        mlp = ["dense" if i < k else "sparse" for i in range(n)]
    hd = lin.get("head_dim", cfg.get("linear_head_dim", 128))
    nh = lin.get("num_heads", cfg.get("linear_num_heads", 32))
    kk = lin.get("short_conv_kernel_size", cfg.get("linear_conv_kernel_dim", 4))
    return types, mlp, hd, nh, kk


def numpy_forward_kimi_linear(cfg: dict, W: dict, ids: list[int]) -> np.ndarray:
    """Kimi Linear in float64 (transformers' kimi_linear, no cache) from the checkpoint's own
    tensor names: KDA in its recurrent form, one position at a time; MLA without positions."""
    types, mlp_types, hd, nh, K = kimi_linear_layout(cfg)
    eps, T = cfg["rms_norm_eps"], len(ids)
    heads = cfg["num_attention_heads"]
    nope, rope, vd = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    r_kv = cfg["kv_lora_rank"]

    def rms(x, w, e=eps):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + e) * w

    def silu(x):
        return x / (1.0 + np.exp(-x))

    def sigmoid(x):
        return 1.0 / (1.0 + np.exp(-x))

    def mlp(h, pre, up="up_proj", gate="gate_proj", down="down_proj"):
        g, u = h @ W[f"{pre}{gate}.weight"].T, h @ W[f"{pre}{up}.weight"].T
        return (silu(g) * u) @ W[f"{pre}{down}.weight"].T

    def mla(h, a):
        if cfg.get("q_lora_rank"):
            q = rms(h @ W[a + "q_a_proj.weight"].T, W[a + "q_a_layernorm.weight"], 1e-6)
            q = q @ W[a + "q_b_proj.weight"].T
        else:
            q = h @ W[a + "q_proj.weight"].T
        q = q.reshape(T, heads, nope + rope)
        ckv = h @ W[a + "kv_a_proj_with_mqa.weight"].T
        c, k_rot = rms(ckv[:, :r_kv], W[a + "kv_a_layernorm.weight"], 1e-6), ckv[:, r_kv:]
        kv = (c @ W[a + "kv_b_proj.weight"].T).reshape(T, heads, nope + vd)
        k = np.concatenate([kv[..., :nope], np.repeat(k_rot[:, None, :], heads, 1)], -1)
        v = kv[..., nope:]
        mask = np.triu(np.full((T, T), -np.inf), 1)
        o = np.zeros((T, heads, vd))
        for i in range(heads):
            sc = q[:, i] @ k[:, i].T * (nope + rope) ** -0.5 + mask
            sc = np.exp(sc - sc.max(-1, keepdims=True))
            o[:, i] = (sc / sc.sum(-1, keepdims=True)) @ v[:, i]
        return o.reshape(T, heads * vd) @ W[a + "o_proj.weight"].T

    def kda(h, a):
        qkv = []
        for n in "qkv":  # each projection through its own causal conv, SiLU after
            x = h @ W[f"{a}{n}_proj.weight"].T
            w = W[f"{a}{n}_conv1d.weight"][:, 0, :]  # [channels, K]
            padded = np.concatenate([np.zeros((K - 1, x.shape[1])), x])
            qkv.append(silu(np.stack([(padded[t : t + K] * w.T).sum(0) for t in range(T)])))
        q, k, v = (x.reshape(T, nh, hd) for x in qkv)
        q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6) * hd**-0.5
        k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
        f = (h @ W[a + "f_a_proj.weight"].T) @ W[a + "f_b_proj.weight"].T + W[a + "dt_bias"]
        g = -np.exp(W[a + "A_log"].reshape(nh, 1)) * np.logaddexp(0.0, f.reshape(T, nh, hd))
        beta = sigmoid(h @ W[a + "b_proj.weight"].T)
        out = np.zeros((T, nh, hd))
        for j in range(nh):
            S = np.zeros((hd, hd))
            for t in range(T):
                S = S * np.exp(g[t, j])[:, None]  # each key channel decays at its own rate
                delta = (v[t, j] - S.T @ k[t, j]) * beta[t, j]
                S = S + np.outer(k[t, j], delta)
                out[t, j] = S.T @ q[t, j]
        gate = ((h @ W[a + "g_a_proj.weight"].T) @ W[a + "g_b_proj.weight"].T).reshape(T, nh, hd)
        out = rms(out, W[a + "o_norm.weight"]) * sigmoid(gate)
        return out.reshape(T, nh * hd) @ W[a + "o_proj.weight"].T

    x = W["model.embed_tokens.weight"][ids]
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        h = rms(x, W[p + "input_layernorm.weight"])
        a = p + "self_attn."
        x = x + (mla(h, a) if types[layer] == "full_attention" else kda(h, a))
        h = rms(x, W[p + "post_attention_layernorm.weight"])
        m = p + ("block_sparse_moe." if p + "block_sparse_moe.gate.weight" in W else "mlp.")
        if mlp_types[layer] == "dense":
            dense = p + "mlp." if p + "mlp.gate_proj.weight" in W else p + "block_sparse_moe."
            x = x + mlp(h, dense)
            continue
        E = W[m + "gate.weight"].shape[0]
        kk = cfg["num_experts_per_token"]
        s = sigmoid(h @ W[m + "gate.weight"].T)
        sc = s + W[m + "gate.e_score_correction_bias"]
        ng, tg = cfg["num_expert_group"], cfg["topk_group"]
        gs = np.sort(sc.reshape(T, ng, E // ng), -1)[..., -2:].sum(-1)
        keep = np.argsort(-gs, -1, kind="stable")[:, :tg]
        gm = np.zeros((T, ng), bool)
        np.put_along_axis(gm, keep, True, -1)
        sc = np.where(np.repeat(gm, E // ng, -1), sc, -np.inf)
        idx = np.argsort(-sc, -1, kind="stable")[:, :kk]
        wts = np.take_along_axis(s, idx, -1)
        if cfg["moe_renormalize"]:
            wts = wts / (wts.sum(-1, keepdims=True) + 1e-20)
        wts = wts * cfg["routed_scaling_factor"]
        out = np.zeros_like(h)
        for t in range(T):
            for e, we in zip(idx[t], wts[t], strict=True):
                out[t] += we * mlp(h[t : t + 1], f"{m}experts.{e}.", "w3", "w1", "w2")[0]
        x = x + out + mlp(h, m + "shared_experts.")
    x = rms(x, W["model.norm.weight"])
    return x @ W["lm_head.weight"].T


# DeepSeek-V4's checkpoint names (as published, and as transformers saves them) -> transformers'
# module names, in the order transformers' conversion mapping applies them.
V4_RENAMES = (
    (r"\.attn\.", ".self_attn."),
    (r"\.ffn\.", ".mlp."),
    (r"\.indexer\.compressor\.", ".compressor.indexer."),
    (r"^embed\.weight", "embed_tokens.weight"),
    (r"^head\.weight", "lm_head.weight"),
    (r"^hc_head_fn", "hc_head.hc_fn"),
    (r"^hc_head_base", "hc_head.hc_base"),
    (r"^hc_head_scale", "hc_head.hc_scale"),
    (r"\.attn_norm\.", ".input_layernorm."),
    (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.hc_attn_(fn|base|scale)", r".attn_hc.\1"),
    (r"\.hc_ffn_(fn|base|scale)", r".ffn_hc.\1"),
    (r"\.attn_sink", ".sinks"),
    (r"\.indexer\.weights_proj\.", ".compressor.indexer.scorer.weights_proj."),
    (r"\.indexer\.wq_b\.", ".compressor.indexer.q_b_proj."),
    (r"\.norm\.", ".kv_norm."),
    (r"\.ape", ".position_bias"),
    (r"\.wq_a\.", ".q_a_proj."),
    (r"\.self_attn\.wq_b\.", ".self_attn.q_b_proj."),
    (r"\.wkv\.", ".kv_proj."),
    (r"\.wgate\.", ".gate_proj."),
    (r"\.wo_a\.", ".o_a_proj."),
    (r"\.wo_b\.", ".o_b_proj."),
    (r"\.q_norm\.", ".q_a_norm."),
    (r"\.gate\.bias", ".gate.e_score_correction_bias"),
    (r"\.shared_experts\.w1\.", ".shared_experts.gate_proj."),
    (r"\.shared_experts\.w2\.", ".shared_experts.down_proj."),
    (r"\.shared_experts\.w3\.", ".shared_experts.up_proj."),
)


def v4_module_names(W: dict) -> dict:
    """A DeepSeek-V4 checkpoint's tensors under transformers' module names (experts fused)."""
    import re

    out, experts = {}, {}
    for name, t in W.items():
        bare = name.removeprefix("model.")
        for pat, rep in V4_RENAMES:
            bare = re.sub(pat, rep, bare)
        m = re.match(r"(layers\.\d+\.mlp\.experts)\.(\d+)\.(w[123])\.weight$", bare)
        if m:
            experts.setdefault(m[1], {}).setdefault(m[3], {})[int(m[2])] = t
            continue
        out[bare if bare == "lm_head.weight" else "model." + bare] = t
    for prefix, parts in experts.items():
        stack = {w: np.stack([parts[w][e] for e in sorted(parts[w])]) for w in parts}
        out[f"model.{prefix}.gate_up_proj"] = np.concatenate([stack["w1"], stack["w3"]], 1)
        out[f"model.{prefix}.down_proj"] = stack["w2"]
    return out


# Gaps at the top-k cut of DeepSeek-V4's indexer, recorded by numpy_forward_v4 (float64).
V4_INDEX_GAPS: list[float] = []


def numpy_forward_v4(cfg: dict, W: dict, ids: list[int]) -> np.ndarray:
    """DeepSeek-V4 in float64 from the files alone (transformers' deepseek_v4, no cache)."""
    H, nh, hd = cfg["hidden_size"], cfg["num_attention_heads"], cfg["head_dim"]
    eps, N, T = cfg["rms_norm_eps"], cfg["hc_mult"], len(ids)
    hc_eps = cfg["hc_eps"]
    rd = int(hd * cfg["partial_rotary_factor"])
    pos = np.arange(T, dtype=np.float64)

    def inv_freq(p):
        if p.get("rope_type", "default") == "yarn":
            return yarn_inv_freq({"rope_parameters": p}, rd)[0]  # attention factor 1 (V4)
        return 1.0 / p["rope_theta"] ** (np.arange(0, rd, 2, dtype=np.float64) / rd)

    inv_main = inv_freq(cfg["rope_parameters"]["main"])
    inv_comp = inv_freq(cfg["rope_parameters"]["compress"])

    def rope(x, at, inv, sign=1.0):  # interleaved pairs of the last rd dims; x [T, ..., d]
        ang = at[:, None] * inv[None, :]
        shape = (len(at),) + (1,) * (x.ndim - 2) + (rd // 2,)
        c, sn = np.cos(ang).reshape(shape), sign * np.sin(ang).reshape(shape)
        out = x.copy()
        x1, x2 = x[..., -rd:][..., 0::2], x[..., -rd:][..., 1::2]
        r = np.empty_like(x[..., -rd:])
        r[..., 0::2], r[..., 1::2] = x1 * c - x2 * sn, x2 * c + x1 * sn
        out[..., -rd:] = r
        return out

    def rms(x, w=None):
        y = x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)
        return y if w is None else y * w

    def sigmoid(x):
        return 1.0 / (1.0 + np.exp(-x))

    def softmax(x, axis):
        m = np.max(np.where(np.isfinite(x), x, -np.inf), axis=axis, keepdims=True)
        e = np.exp(x - m)
        return e / e.sum(axis=axis, keepdims=True)

    def hyper(X, pre):  # -> post [T, N], comb [T, N, N], collapsed [T, H]
        mix = rms(X.reshape(T, N * H)) @ W[pre + "fn"].T
        base, scale = W[pre + "base"], W[pre + "scale"]
        a = sigmoid(mix[:, :N] * scale[0] + base[:N]) + hc_eps
        post = 2.0 * sigmoid(mix[:, N : 2 * N] * scale[1] + base[N : 2 * N])
        comb = softmax((mix[:, 2 * N :] * scale[2] + base[2 * N :]).reshape(T, N, N), -1) + hc_eps
        comb = comb / (comb.sum(-2, keepdims=True) + hc_eps)
        for _ in range(cfg["hc_sinkhorn_iters"] - 1):
            comb = comb / (comb.sum(-1, keepdims=True) + hc_eps)
            comb = comb / (comb.sum(-2, keepdims=True) + hc_eps)
        return post, comb, (a[:, :, None] * X).sum(1)

    def compress(h, c, m, width, overlap, norm_eps_w):  # -> entries [T // m, width]
        kv, g = h @ W[c + "kv_proj.weight"].T, h @ W[c + "gate_proj.weight"].T
        bias = W[c + "position_bias"]
        out = []
        for w in range(T // m):
            k, z = kv[w * m : (w + 1) * m], g[w * m : (w + 1) * m] + bias
            if overlap:  # window w-1's first half, then window w's second half
                if w == 0:
                    pk, pz = np.zeros((m, width)), np.full((m, width), -np.inf)
                else:
                    pk = kv[(w - 1) * m : w * m, :width]
                    pz = g[(w - 1) * m : w * m, :width] + bias[:, :width]
                k = np.concatenate([pk, k[:, width:]])
                z = np.concatenate([pz, z[:, width:]])
            e = (k * softmax(z, 0)).sum(0)
            out.append(rms(e, norm_eps_w))
        ent = np.array(out).reshape(-1, width)
        return rope(ent, np.arange(len(ent), dtype=np.float64) * m, inv_comp)

    def attention(h, layer):
        a = f"model.layers.{layer}.self_attn."
        kind = cfg["layer_types"][layer]
        inv = inv_main if kind == "sliding_attention" else inv_comp
        qr = rms(h @ W[a + "q_a_proj.weight"].T, W[a + "q_a_norm.weight"])
        q = rope(rms((qr @ W[a + "q_b_proj.weight"].T).reshape(T, nh, hd)), pos, inv)
        kv = rope(rms(h @ W[a + "kv_proj.weight"].T, W[a + "kv_norm.weight"]), pos, inv)
        i, j = np.arange(T)[:, None], np.arange(T)[None, :]
        bias = np.where((j <= i) & (j > i - cfg["sliding_window"]), 0.0, -np.inf)
        keys = kv
        if kind != "sliding_attention":
            c = a + "compressor."
            m = cfg["compress_rates"][kind]
            csa = kind == "compressed_sparse_attention"
            ent = compress(h, c, m, hd, csa, W[c + "kv_norm.weight"])
            ready = np.arange(len(ent))[None, :] < ((np.arange(T) + 1) // m)[:, None]
            if csa:
                x = c + "indexer."
                ihd, inh = cfg["index_head_dim"], cfg["index_n_heads"]
                ik = compress(h, x, m, ihd, True, W[x + "kv_norm.weight"])
                iq = rope((qr @ W[x + "q_b_proj.weight"].T).reshape(T, inh, ihd), pos, inv_comp)
                sc = np.maximum(np.einsum("thd,sd->ths", iq, ik), 0.0) * ihd**-0.5
                wts = (h @ W[x + "scorer.weights_proj.weight"].T) * inh**-0.5
                score = np.einsum("th,ths->ts", wts, sc)
                chosen = np.zeros_like(ready)
                k = cfg["index_topk"]
                for t in range(T):
                    valid = np.flatnonzero(ready[t])
                    order = valid[np.argsort(-score[t, valid], kind="stable")]
                    chosen[t, order[:k]] = True
                    if len(valid) > k:
                        srt = score[t, order]
                        V4_INDEX_GAPS.append(float(srt[k - 1] - srt[k]))
                ready = chosen
            keys = np.concatenate([kv, ent])
            bias = np.concatenate([bias, np.where(ready, 0.0, -np.inf)], 1)
        sc = np.einsum("thd,sd->ths", q, keys) * hd**-0.5 + bias[:, None, :]
        sinks = np.broadcast_to(W[a + "sinks"][None, :, None], (T, nh, 1))
        pr = softmax(np.concatenate([sc, sinks], -1), -1)[..., :-1]
        o = rope(np.einsum("ths,sd->thd", pr, keys), pos, inv, -1.0)
        G, R = cfg["o_groups"], cfg["o_lora_rank"]
        wa = W[a + "o_a_proj.weight"].reshape(G, R, nh * hd // G)
        og = np.einsum("tgi,gri->tgr", o.reshape(T, G, nh * hd // G), wa).reshape(T, G * R)
        return og @ W[a + "o_b_proj.weight"].T

    def swiglu(x, gate_w, up_w, down_w):
        lim = cfg["swiglu_limit"]
        g = np.minimum(x @ gate_w.T, lim)
        u = np.clip(x @ up_w.T, -lim, lim)
        return (g / (1.0 + np.exp(-g)) * u) @ down_w.T

    def moe(h, layer):
        m = f"model.layers.{layer}.mlp."
        r = h @ W[m + "gate.weight"].T
        s = np.sqrt(np.logaddexp(0.0, r))  # sqrt(softplus)
        K = cfg["num_experts_per_tok"]
        if cfg["mlp_layer_types"][layer] == "hash_moe":
            idx = W[m + "gate.tid2eid"][ids].astype(np.int64)
        else:
            idx = np.argsort(-(s + W[m + "gate.e_score_correction_bias"]), -1, kind="stable")[:, :K]
        w = np.take_along_axis(s, idx, -1)
        w = w / (w.sum(-1, keepdims=True) + 1e-20) * cfg["routed_scaling_factor"]
        gu, dn = W[m + "experts.gate_up_proj"], W[m + "experts.down_proj"]
        inter = dn.shape[-1]
        out = np.zeros_like(h)
        for t in range(T):
            for e, we in zip(idx[t], w[t], strict=True):
                out[t] += we * swiglu(h[t : t + 1], gu[e, :inter], gu[e, inter:], dn[e])[0]
        sh = m + "shared_experts."
        return out + swiglu(h, *(W[f"{sh}{n}_proj.weight"] for n in ("gate", "up", "down")))

    X = np.repeat(W["model.embed_tokens.weight"][ids][:, None, :], N, 1)
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        for hc, norm, block in (
            ("attn_hc.", "input_layernorm.weight", attention),
            ("ffn_hc.", "post_attention_layernorm.weight", moe),
        ):
            post, comb, col = hyper(X, p + hc)
            y = block(rms(col, W[p + norm]), layer)
            X = post[:, :, None] * y[:, None, :] + np.einsum("tjk,tjd->tkd", comb, X)
    mix = rms(X.reshape(T, N * H)) @ W["model.hc_head.hc_fn"].T
    a = sigmoid(mix * W["model.hc_head.hc_scale"][0] + W["model.hc_head.hc_base"]) + hc_eps
    x = rms((a[:, :, None] * X).sum(1), W["model.norm.weight"])
    return x @ W["lm_head.weight"].T


def yarn_inv_freq(cfg: dict, dim: int) -> tuple[np.ndarray, float]:
    """YaRN inverse frequencies and cos/sin factor (transformers' `_compute_yarn_parameters`)."""
    p = cfg["rope_parameters"]
    base, factor = p["rope_theta"], p["factor"]
    orig = p["original_max_position_embeddings"]

    def get_mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if p.get("attention_factor") is not None:
        af = p["attention_factor"]
    elif p.get("mscale") and p.get("mscale_all_dim"):
        af = get_mscale(factor, p["mscale"]) / get_mscale(factor, p["mscale_all_dim"])
    else:
        af = get_mscale(factor)
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def corr_dim(rot):
        return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

    low, high = corr_dim(beta_fast), corr_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    pos = base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    extrapolation = 1.0 - ramp
    inv = (1.0 / (factor * pos)) * (1 - extrapolation) + (1.0 / pos) * extrapolation
    return inv, af


def numpy_indexer_mask(cfg, W, a, h, qa, cos, sin, rot, causal) -> np.ndarray:
    """The DSA lightning indexer of one layer: 0 at each query's top-k positions, -inf
    elsewhere (the fixtures have no near ties at the cut, so a stable sort picks the same)."""
    T = h.shape[0]
    nh, hd, rd, k = (
        cfg["index_n_heads"],
        cfg["index_head_dim"],
        cfg["qk_rope_head_dim"],
        cfg["index_topk"],
    )
    p = a + "indexer."
    q = (qa @ W[p + "wq_b.weight"].T).reshape(T, nh, hd)
    key = h @ W[p + "wk.weight"].T
    mu = key.mean(-1, keepdims=True)
    var = ((key - mu) ** 2).mean(-1, keepdims=True)
    key = (key - mu) / np.sqrt(var + 1e-6) * W[p + "k_norm.weight"] + W[p + "k_norm.bias"]
    q = np.concatenate([rot(q[..., :rd]), q[..., rd:]], -1)
    key = np.concatenate([rot(key[:, None, :rd])[:, 0], key[:, rd:]], -1)
    sc = np.maximum(np.einsum("thd,sd->ths", q, key) * hd**-0.5, 0.0)
    w = (h @ W[p + "weights_proj.weight"].T) * nh**-0.5
    scores = np.einsum("th,ths->ts", w, sc) + causal
    out = np.full((T, T), -np.inf)
    for t in range(T):
        keep = np.argsort(-scores[t], kind="stable")[: min(k, T)]
        out[t, keep] = 0.0
    return out


def numpy_mla(cfg: dict, W: dict, a: str, h: np.ndarray, mask: np.ndarray, index_mask=None):
    """DeepSeek-V3 multi-head latent attention of one layer (prefix `a`), expanded as
    transformers computes it: the latent through kv_b_proj into per-head keys and values.
    With GLM-5's DSA, only over the top-k of this layer's indexer (or, for a layer without
    one, of `index_mask`, the previous indexer's). Returns the output and the index mask."""
    T = h.shape[0]
    nh = cfg["num_attention_heads"]
    nope, rd, vd = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    r = cfg["kv_lora_rank"]

    def rms6(x, w):  # q_a_layernorm / kv_a_layernorm keep RMSNorm's default eps
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6) * w

    if cfg.get("q_lora_rank"):
        qa = rms6(h @ W[a + "q_a_proj.weight"].T, W[a + "q_a_layernorm.weight"])
        q = qa @ W[a + "q_b_proj.weight"].T
    else:
        q = h @ W[a + "q_proj.weight"].T
    q = q.reshape(T, nh, nope + rd)
    ckv = h @ W[a + "kv_a_proj_with_mqa.weight"].T
    lat = rms6(ckv[:, :r], W[a + "kv_a_layernorm.weight"])
    kr = ckv[:, None, r:]  # [T, 1, rd]: one rope key shared by every head
    kv = (lat @ W[a + "kv_b_proj.weight"].T).reshape(T, nh, nope + vd)
    kn, v = kv[..., :nope], kv[..., nope:]
    qn, qr = q[..., :nope], q[..., nope:]
    p = cfg["rope_parameters"]
    if p.get("rope_type", "default") == "yarn":
        inv, af = yarn_inv_freq(cfg, rd)
    else:
        inv, af = 1.0 / p["rope_theta"] ** (np.arange(0, rd, 2, dtype=np.float64) / rd), 1.0
    ang = np.arange(T, dtype=np.float64)[:, None] * inv[None, :]
    cos = (np.cos(np.concatenate([ang, ang], -1)) * af)[:, None, :]
    sin = (np.sin(np.concatenate([ang, ang], -1)) * af)[:, None, :]

    def rot(x):
        if cfg.get("rope_interleave", True):  # (x0, x1, x2, ..) -> (x0, x2, .., x1, x3, ..)
            x = np.concatenate([x[..., 0::2], x[..., 1::2]], -1)
        half = rd // 2
        return x * cos + np.concatenate([-x[..., half:], x[..., :half]], -1) * sin

    def rot_halves(x):  # DeepSeek-V3.2's indexer: rotate_half on the rope dims as they are
        half = rd // 2
        return x * cos + np.concatenate([-x[..., half:], x[..., :half]], -1) * sin

    qr, kr = rot(qr), rot(kr)
    if a + "indexer.wq_b.weight" in W:  # DSA: attend over the indexer's top-k only
        index_rot = rot_halves if cfg["model_type"] == "deepseek_v32" else rot
        index_mask = numpy_indexer_mask(cfg, W, a, h, qa, cos, sin, index_rot, mask)
    if index_mask is not None:  # this layer's selection, or a shared layer's predecessor's
        mask = mask + index_mask
    scale = (nope + rd) ** -0.5
    if p.get("rope_type", "default") != "default" and p.get("mscale_all_dim"):
        m = 1.0 if p["factor"] <= 1 else 0.1 * p["mscale_all_dim"] * math.log(p["factor"]) + 1.0
        scale *= m * m
    o = np.zeros((T, nh, vd))
    for i in range(nh):
        sc = (qn[:, i] @ kn[:, i].T + qr[:, i] @ kr[:, 0].T) * scale + mask
        sc = np.exp(sc - sc.max(-1, keepdims=True))
        o[:, i] = (sc / sc.sum(-1, keepdims=True)) @ v[:, i]
    return o.reshape(T, nh * vd) @ W[a + "o_proj.weight"].T, index_mask


# --------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------


def build(arch: str, seed: int):
    spec = SPECS[arch]
    cfg = spec["cfg_cls"](**spec["cfg"])
    torch.manual_seed(seed)
    model = spec["cls"](cfg).float().eval()
    model.set_attn_implementation("eager")
    model.set_experts_implementation("eager")
    randomize(model, arch, seed)
    if cfg.tie_word_embeddings:
        model.tie_weights()
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    round_to_storage(model, arch)
    return model


def load(hf_dir: Path):
    model = AutoModelForCausalLM.from_pretrained(
        str(hf_dir),
        dtype=torch.float32,
        attn_implementation="eager",
        experts_implementation="eager",
    ).eval()
    assert model.config._attn_implementation == "eager"
    return model


def shard_size(model, arch) -> int:
    total = 0
    for name, t in model.state_dict().items():
        total += t.numel() * torch.tensor([], dtype=storage_dtype(arch, name)).element_size()
    return total


def rewrite_config(path: Path, drop: tuple[str, ...], add: dict) -> None:
    """Rewrites a saved config.json: the keys `drop` removed, `add` added (the reference is
    then computed from the model transformers loads from the rewritten file)."""
    cfg = json.loads(path.read_text())
    for k in drop:
        del cfg[k]
    cfg.update(add)
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def make(arch: str) -> dict:
    spec = SPECS[arch]
    out_dir = OUT / arch
    hf_dir = out_dir / "hf"
    if out_dir.exists():
        shutil.rmtree(out_dir)
    hf_dir.mkdir(parents=True)

    tok = build_tokenizer(spec["tok_vocab"])
    prompts = make_prompts(tok)

    # Seed search: first seed whose greedy and routing decisions are not near ties,
    # and whose greedy continuations never produce eos.
    for seed in range(spec["seed"], spec["seed"] + 500):
        model = build(arch, seed)
        ev = evaluate(model, arch, prompts)
        ok = (
            min(ev["margin"]) >= MIN_GREEDY_MARGIN
            and ev["router_gap"] >= MIN_ROUTER_GAP
            and ev["index_gap"] >= MIN_INDEX_GAP
            and all(EOS not in g for g in ev["greedy"])
            and all(len(set(g)) >= MIN_DISTINCT for g in ev["greedy"])
        )
        print(
            f"[{arch}] seed {seed}: greedy margin {min(ev['margin']):.4f} "
            f"router gap {ev['router_gap']:.4f} index gap {ev['index_gap']:.2e} ok={ok}"
        )
        if ok:
            break
    else:
        raise SystemExit(f"{arch}: no acceptable seed")

    # Save exactly the rounded weights in the storage dtype(s).
    cast_for_save(model, arch)
    kwargs = {}
    if spec["shards"] > 1:
        kwargs["max_shard_size"] = int(shard_size(model, arch) * 0.6)
    model.save_pretrained(str(hf_dir), **kwargs)
    if "checkpoint_config" in spec:  # the published checkpoint's layout of the same config
        rewrite_config(hf_dir / "config.json", **spec["checkpoint_config"])
    write_tokenizer(hf_dir, tok)
    shards = sorted(p.name for p in hf_dir.glob("*.safetensors"))
    assert len(shards) == spec["shards"], shards

    # Reference from what is on disk.
    ref = load(hf_dir)
    ref_sd = ref.state_dict()
    model_sd = {k: v.float() for k, v in model.state_dict().items()}
    for k, v in ref_sd.items():
        if "rotary_emb" in k:
            continue
        assert torch.equal(v.float(), model_sd[k]), k
    ev2 = evaluate(ref, arch, prompts)
    for a, b in zip(ev["logits"], ev2["logits"], strict=True):
        assert torch.allclose(a, b, atol=1e-4, rtol=0), (a - b).abs().max()
    assert ev["greedy"] == ev2["greedy"]
    ev = ev2

    # Cross-check the manual argmax loop against model.generate (KV cache path).
    for p, g in zip(prompts, ev["greedy"], strict=True):
        gen = ref.generate(
            torch.tensor([p]),
            do_sample=False,
            max_new_tokens=N_GREEDY,
            pad_token_id=PAD,
            eos_token_id=EOS,
        )[0, len(p) :].tolist()
        assert gen == g, (gen, g)

    # Independent float64 NumPy forward from the files alone must agree.
    cfg_json, W = load_checkpoint(hf_dir)
    np_err = 0.0
    for p, L in zip(prompts, ev["logits"], strict=True):
        ref_np = numpy_forward(cfg_json, W, p)
        err = np.abs(ref_np - L.numpy()).max() / np.abs(ref_np).max()
        np_err = max(np_err, float(err))
    assert np_err < 1e-4, f"numpy forward disagrees with transformers: {np_err}"

    # Routing sanity for GLM: the correction bias must actually change the selection.
    route_changed = None
    if arch in SIGMOID_ROUTED:
        route_changed = glm_bias_effect(ref, prompts)
        assert route_changed > 0, "e_score_correction_bias does not change routing"

    # Q4_0 weight error.
    qm, qnames = q4_0_model(ref)
    L = ev["logits"]
    rel2, rel_all = q4_0_errors(qm, prompts, L)

    npz = {}
    for i, p in enumerate(prompts):
        npz[f"prompt_{i}"] = np.asarray(p, dtype=np.int32)
        npz[f"logits_{i}"] = ev["logits"][i].numpy().astype(np.float32)
        npz[f"greedy_{i}"] = np.asarray(ev["greedy"][i], dtype=np.int32)
        npz[f"greedy_margin_{i}"] = np.float32(ev["margin"][i])
    npz["router_min_gap"] = np.float32(ev["router_gap"])
    if arch in DSA or arch == "deepseek_v4":
        npz["index_min_gap"] = np.float32(ev["index_gap"])
        npz["index_selecting_queries"] = np.int32(ev["index_selecting"])
    npz["q4_0_rel_error"] = np.float32(rel2)
    npz["q4_0_rel_error_all"] = np.float32(rel_all)
    np.savez(out_dir / "reference.npz", **npz)

    cases = tokenizer_cases(hf_dir)
    with open(out_dir / "tokenizer_cases.json", "w") as f:
        json.dump(cases, f, indent=1, ensure_ascii=False)
        f.write("\n")

    size = sum(p.stat().st_size for p in out_dir.rglob("*") if p.is_file())
    summary = dict(
        arch=arch,
        seed=seed,
        greedy_margins=[round(m, 4) for m in ev["margin"]],
        router_min_gap=round(ev["router_gap"], 4),
        index_min_gap=round(ev["index_gap"], 4),
        index_selecting_queries=ev["index_selecting"],
        q4_0_rel_error=rel2,
        q4_0_rel_error_all=rel_all,
        logit_std=[round(x.std().item(), 3) for x in L],
        greedy=ev["greedy"],
        glm_tokens_with_bias_changed_routing=route_changed,
        shards=shards,
        bytes=size,
        quantized_tensors=len(qnames),
        numpy_vs_torch_max_rel=np_err,
    )
    print(json.dumps(summary))
    return summary


def q4_0_errors(qm, prompts, L) -> tuple[float, float]:
    """The Q4_0 model's relative logit error on prompt 2 and on all prompts together."""
    lq = [logits_of(qm, p) for p in prompts]
    rel2 = ((lq[2] - L[2]).norm() / L[2].norm()).item()
    cat_l, cat_q = torch.cat(L), torch.cat(lq)
    return rel2, ((cat_q - cat_l).norm() / cat_l.norm()).item()


def refresh_q4_0_anchor(arch: str) -> dict:
    """Recompute only a fixture's Q4_0 anchors (q4_0_rel_error, q4_0_rel_error_all) from the
    committed checkpoint and logits, leaving every other array of reference.npz as it is: for
    a change to how Q4_0 is applied (MLA's kv_b_proj, split as llama.cpp stores it) without
    regenerating the fixture under other library versions."""
    out_dir = OUT / arch
    ref = load(out_dir / "hf")
    with np.load(out_dir / "reference.npz") as z:
        npz = {k: z[k] for k in z.files}
    n = sum(1 for k in npz if k.startswith("prompt_"))
    prompts = [npz[f"prompt_{i}"].tolist() for i in range(n)]
    L = [torch.from_numpy(npz[f"logits_{i}"]) for i in range(n)]
    mine = [logits_of(ref, p) for p in prompts]
    worst = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(mine, L, strict=True))
    assert worst < 1e-4, f"{arch}: this torch/transformers disagrees with the fixture: {worst}"
    qm, _ = q4_0_model(ref)
    rel2, rel_all = q4_0_errors(qm, prompts, L)
    before = (float(npz["q4_0_rel_error"]), float(npz["q4_0_rel_error_all"]))
    npz["q4_0_rel_error"] = np.float32(rel2)
    npz["q4_0_rel_error_all"] = np.float32(rel_all)
    np.savez(out_dir / "reference.npz", **npz)
    return dict(arch=arch, before=before, after=(rel2, rel_all), fp32_agreement=worst)


@torch.no_grad()
def glm_bias_effect(model, prompts) -> int:
    """Number of (layer, token) routing decisions that differ with the bias zeroed."""
    changed = 0
    gates = [
        m
        for n, m in model.named_modules()
        if n.endswith("mlp.gate") and hasattr(m, "e_score_correction_bias")
    ]
    sel = {}

    def hook(key):
        def f(_m, _i, out):
            sel.setdefault(key, []).append(torch.sort(out[2], dim=-1)[0])

        return f

    for variant in ("bias", "zero"):
        saved = [g.e_score_correction_bias.clone() for g in gates]
        if variant == "zero":
            for g in gates:
                g.e_score_correction_bias.zero_()
        hs = [g.register_forward_hook(hook((variant, i))) for i, g in enumerate(gates)]
        for p in prompts:
            logits_of(model, p)
        for h in hs:
            h.remove()
        for g, s in zip(gates, saved, strict=True):
            g.e_score_correction_bias.copy_(s)
    for i in range(len(gates)):
        a = torch.cat(sel[("bias", i)])
        b = torch.cat(sel[("zero", i)])
        changed += int((a != b).any(dim=-1).sum())
    return changed


def main():
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    if sys.argv[1:2] == ["--q4-0-anchor-only"]:
        for a in sys.argv[2:]:
            print(json.dumps(refresh_q4_0_anchor(a)))
        return
    archs = sys.argv[1:] or list(SPECS)
    summaries = [make(a) for a in archs]
    versions = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "numpy": np.__version__,
        "python": sys.version.split()[0],
    }
    # All of them: the top-level record; some: a record beside each (the others keep theirs).
    paths = (
        [OUT / "versions.json"]
        if set(archs) == set(SPECS)
        else [OUT / a / "versions.json" for a in archs]
    )
    for path in paths:
        with open(path, "w") as f:
            json.dump(versions, f, indent=2)
            f.write("\n")
    print("done:", [(s["arch"], s["bytes"]) for s in summaries])


if __name__ == "__main__":
    main()
