"""What a run leaves beside the model: CARD.md (shape, data recipe, training, evaluation, the
issue's targets, long prompts) and loss.png."""

from __future__ import annotations

from pathlib import Path

from .config import CONFIG, SEED
from .repo import demo_data


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


def card(summary: dict, results: dict, args) -> str:
    cfg = dict(CONFIG)
    a = summary["args"]
    cfg["max_position_embeddings"] = int(a.get("context", cfg["max_position_embeddings"]))
    yarn = float(a.get("rope_yarn", "0"))
    rope_note = (
        f", YaRN x{yarn:g} over {a.get('rope_original')} positions"
        + (
            f" with attention factor {float(a['rope_attention_factor']):g}"
            if a.get("rope_attention_factor", "None") != "None"
            else ""
        )
        if yarn
        else ""
    )
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
        f"{cfg['num_key_value_heads']} KV heads of {cfg['head_dim']} (RoPE on half{rope_note}, "
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
    late_note = (
        "a run from scratch must add them late: from the start, the copying never formed, tool "
        "calls 27%; this fine-tune starts from weights that copy"
        if a.get("init_from", "None") != "None"
        else "from the start, the copying never formed: tool calls\n27%"
    )
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
    if summary.get("argv"):
        # The run's own command line (the card written by --only-convert / --card-only is the
        # training run's).
        command = "python scripts/train_demo_model.py " + " ".join(summary["argv"])
    else:
        command = (
            f"python scripts/train_demo_model.py --seed {a.get('seed', SEED)} --steps "
            f"{a['steps']}\n  --time-budget-min {a['time_budget_min']} --piece-names-from "
            f"{a.get('piece_names_from', '0')}\n  --piece-share {piece_share} --short-pieces "
            f"{a.get('short_pieces', '0')} --warmup {warmup}\n  --lr {a['lr']} --near-miss "
            f"{near_miss} --copy-drill {drill}{tie_flag}{trailing_flag}\n  {later_flags}--ship"
        )
    origin = (
        "from scratch, then fine-tuned for agent-length prompts (see Long prompts; the run it"
        " started from is under Base model),"
        if summary.get("base_card")
        else "from scratch"
    )
    return f"""# colibri demo model

A tiny GLM-4.5-format Mixture-of-Experts (`Glm4MoeForCausalLM`) trained {origin} by
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
first), so every piece is copied in training ({late_note}){short_note}{near_note}; the rest are
6,000 generated city-like names (some accented, some two words), ~90 real cities and the
capitals.{drill_note}{trailing_note}
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
- Command: `{command}`
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
        yarn = float(a.get("rope_yarn", "0"))
        rope = (
            f"YaRN RoPE scaling x{yarn:g} over {a.get('rope_original')} positions (transformers'"
            " `rope_type: yarn`, which the engine computes the same way"
            + (
                f", attention factor {float(a['rope_attention_factor']):g}"
                if a.get("rope_attention_factor", "None") != "None"
                else ""
            )
            + "), in training and in the shipped config"
            if yarn
            else "RoPE as it was (theta 10000, the default type, no scaling)"
        )
        out.append(
            f"Fine-tuned from `{init}` (its weights, dequantized when it is a colibri model "
            f"directory) with `max_position_embeddings` {a.get('context')} and {rope}. RoPE "
            "scaling alone, without training, does not carry the short-context model past ~3k "
            "tokens (`python -m colibri.demo.rope_sweep`, docs/PERFORMANCE.md)."
        )
    if share:
        if init != "None":
            out.append("")
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
        out.append("")
        out.append("The command is under Training.")
    for tokens, by_quant in (long or {}).items():
        r0 = by_quant["int4"]
        out += [
            "",
            f"Evaluation: `python -m colibri.demo.eval --model DIR --n {r0['tasks']['arith']['n']} "
            f"--preamble-tokens {tokens}`: the held-out prompts above, each after an agent "
            f"preamble of {r0['preamble_tokens']:.0f} tokens on average (longest prompt "
            f"{r0['prompt_tokens_max']} tokens) declaring the three demo tools among "
            "the agent's (so every task is asked with tools declared).",
            "",
            "| task | f32 % | int4 % | prompts |",
            "|---|---|---|---|",
        ]
        for t in r0["tasks"]:
            cells = [
                f"{by_quant[q]['tasks'][t]['accuracy'] * 100:.1f}" if q in by_quant else "-"
                for q in ("f32", "int4")
            ]
            out.append(f"| {t} | {cells[0]} | {cells[1]} | {r0['tasks'][t]['n']} |")
    base = summary.get("base_card")
    if base and "## Training" in base:
        section = base.split("## Training", 1)[1].split("\n## ", 1)[0].strip("\n")
        section = section.replace("![training loss](loss.png)", "").strip("\n")
        # A base that was itself fine-tuned: its own base follows (the chain back to scratch).
        earlier = (
            base.split("\n## Base model\n", 1)[1].strip("\n") if "\n## Base model\n" in base else ""
        )
        out += [
            "",
            "## Base model",
            "",
            f"The weights this run started from (`{init}`); the Training section of their card:",
            "",
            section,
        ]
        if earlier:
            out += ["", "Its own base:", "", earlier]
        else:
            out += [
                "",
                "(trained from scratch with the recipe above, the copying city names joining "
                "later)",
            ]
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
