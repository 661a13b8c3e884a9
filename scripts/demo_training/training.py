"""The training loop: AdamW on freshly sampled batches (short conversations and, with
``--long-share``, long-preamble ones), loss only on the generated tokens, GLM's bias-based
expert balancing, quantization-aware steps at the end, per-task loss in the log."""

from __future__ import annotations

import math
import random
import time
from pathlib import Path

from .batches import LOSS_LABELS, batches, long_batches, name_pieces
from .config import EOS_TOKENS
from .weights import build_model, fake_int4, load_init, save_checkpoint


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
