"""The checks after training: greedy generation with the HF model on a few prompts, then
``colibri convert`` to f32 and int4 and the engine's evaluation of both (as subprocesses of
``.venv``)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

from .config import EOS_TOKENS
from .repo import COLIBRI, VENV_PY, demo_data


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


def convert_and_eval(
    work: Path,
    n_per_task: int,
    eval_seed: int,
    long_n: int = 0,
    long_tokens: list[int] | None = None,
) -> dict:
    """Converts WORK/hf to f32 and int4 and evaluates both (``results[quant]``); with
    ``long_n``, also ``long_n`` prompts per task at the end of an agent preamble of about each
    of ``long_tokens`` tokens (``results["long"][str(tokens)][quant]``)."""
    results: dict = {}
    for quant in ("f32", "int4"):
        out = work / f"model-{quant}"
        if out.exists():
            shutil.rmtree(out)
        subprocess.run(
            [str(COLIBRI), "convert", str(work / "hf"), str(out), "--quant", quant], check=True
        )
        evaluate = [str(VENV_PY), "-m", "colibri.demo.eval", "--model", str(out)]
        evaluate += ["--seed", str(eval_seed)]
        subprocess.run(
            [*evaluate, "--n", str(n_per_task), "--json", str(work / f"eval-{quant}.json")],
            check=True,
        )
        results[quant] = json.loads((work / f"eval-{quant}.json").read_text())
        for tokens in (long_tokens or []) if long_n > 0 else []:
            path = work / f"eval-long{tokens}-{quant}.json"
            subprocess.run(
                [*evaluate, "--n", str(long_n), "--preamble-tokens", str(tokens)]
                + ["--json", str(path)],
                check=True,
            )
            long = json.loads(path.read_text())
            results.setdefault("long", {}).setdefault(str(tokens), {})[quant] = long
    return results
