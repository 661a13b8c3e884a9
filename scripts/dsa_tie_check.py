#!/usr/bin/env python3
"""Shows that transformers' own DSA top-k depends on how a sequence is run when scores tie.

Run by hand with the reference venv (torch + transformers are not project dependencies):

    /root/refvenv/bin/python scripts/dsa_tie_check.py

A random GLM-5 (glm_moe_dsa) model shaped like tests/fixtures/glm_moe_dsa but with one indexer
head (relu zeroes about half the scores, so ties at the top-k cut are common). Layer 0's inputs
are the same in a one-shot forward of 40 tokens and in a cached decode of the same tokens, yet
torch.topk, which leaves the choice among tied scores to its selection algorithm over the whole
row (masked future positions included), picks other positions for some queries. No engine can
match both; colibri breaks ties towards the earlier position in every pass alike
(crates/engine/src/model/layers/topk.rs), and the fixtures are seeded without ties at the cut.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

FIXTURE = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "glm_moe_dsa"


def main() -> None:
    cfg = json.loads((FIXTURE / "hf" / "config.json").read_text())
    for k in ("architectures", "transformers_version", "dtype", "torch_dtype"):
        cfg.pop(k, None)
    cfg.update(index_n_heads=1, index_topk=7, indexer_types=None)
    torch.manual_seed(0)
    model = GlmMoeDsaForCausalLM(GlmMoeDsaConfig(**cfg)).float().eval()
    model.set_attn_implementation("eager")
    model.set_experts_implementation("eager")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, p.shape[-1] ** -0.5 if p.dim() > 1 else 0.1)
    picks: list[list[list[int]]] = []
    indexer = model.model.layers[0].self_attn.indexer
    indexer.register_forward_hook(lambda m, i, o: picks.append([sorted(r) for r in o[0].tolist()]))
    ids = torch.randint(3, 400, (1, 40), generator=torch.Generator().manual_seed(1))
    k = cfg["index_topk"]
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)
        one_shot = picks.pop()
        out = model(input_ids=ids[:, :1], use_cache=True)
        for t in range(1, ids.shape[1]):
            out = model(input_ids=ids[:, t : t + 1], cache=out.cache, use_cache=True)
    decode = [p[0] for p in picks]  # query t's row: the t-th call (the first call is query 0)
    differ = [t for t in range(k, ids.shape[1]) if one_shot[t][:k] != decode[t][:k]]
    for t in differ[:3]:
        print(f"query {t}: one-shot forward {one_shot[t]}, cached decode {decode[t]}")
    print(f"{len(differ)} of {ids.shape[1] - k} selecting queries pick differently")


if __name__ == "__main__":
    main()
