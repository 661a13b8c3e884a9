"""Builds colibri's built-in demo model: a tiny GLM-4.5-format MoE trained on synthetic chats.

Development only: needs torch and transformers, which are not colibri dependencies. Run it with a
Python that has them (the package's own pure-Python pieces, the chat template and the demo data
of ``colibri/demo/``, are loaded straight from their files, so the compiled engine is not
needed here); the conversion and the evaluation run the real engine through ``colibri`` of
``.venv`` as subprocesses. This file is the command line; the steps are the modules of
``scripts/demo_training/`` (its ``__init__`` lists them).

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
import json
import os
import random
import shutil
import sys
import time
from pathlib import Path

from demo_training.batches import encode_conversation
from demo_training.config import CONFIG, SEED, rope_yarn
from demo_training.evaluation import convert_and_eval, f32_sanity
from demo_training.repo import SHIP_DIR, TEMPLATE_PATH, chat_template, demo_data
from demo_training.report import card, plot_loss
from demo_training.tokenizer import build_tokenizer
from demo_training.training import train
from demo_training.weights import save_checkpoint


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
        help="max_position_embeddings of the model",
    )
    ap.add_argument(
        "--rope-yarn",
        type=float,
        default=0.0,
        help="YaRN RoPE scaling by this factor over --rope-original positions (transformers' "
        "rope_type yarn, which the engine computes the same way); 0: plain RoPE",
    )
    ap.add_argument(
        "--rope-original",
        type=int,
        default=2048,
        help="original_max_position_embeddings of --rope-yarn (the context RoPE was trained at)",
    )
    ap.add_argument(
        "--rope-attention-factor",
        type=float,
        default=None,
        help="attention_factor of --rope-yarn (default: YaRN's 0.1 ln(factor) + 1)",
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
    ap.add_argument(
        "--long-eval-tokens",
        type=int,
        nargs="+",
        default=[12000],
        help="preamble lengths of the long evaluation (each --long-eval-n prompts per task)",
    )
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
    if args.rope_yarn:
        CONFIG["rope_parameters"] = rope_yarn(
            args.rope_yarn, args.rope_original, args.rope_attention_factor
        )
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
        if args.init_from and (args.init_from / "CARD.md").exists():
            # The card of the weights this run started from: the new card keeps its story.
            summary["base_card"] = (args.init_from / "CARD.md").read_text(encoding="utf-8")
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


if __name__ == "__main__":
    main()
