"""Starts the real `colibri serve` (real engine) on a loopback port for a test module."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

_READY = re.compile(r"colibri: serving (\S+) on (http://\S+) ")


class RunningServer:
    """``colibri serve`` on the random built-in model (whose output never ends on its own), or
    with ``default_model=True`` on whatever the server picks without --model (the demo).
    ``command="web"`` starts `colibri web` instead (the same server, and a browser opened)."""

    def __init__(
        self,
        *args: str,
        env: dict[str, str] | None = None,
        timeout: float = 120,
        default_model: bool = False,
        command: str = "serve",
    ) -> None:
        if "--model" not in args and not default_model:
            from colibri.demo.builtin import builtin_model_dir

            args = ("--model", str(builtin_model_dir()), *args)
        full_env = dict(os.environ)
        for key in (
            "COLI_API_KEY",
            "COLI_MODEL_ID",
            "COLI_ALLOWED_HOSTS",
            "COLI_MODEL",
            "COLI_KV_DIR",
        ):
            full_env.pop(key, None)
        full_env.update(env or {})
        if "--kv-dir" not in args and "--no-kv-persist" not in args:
            # Each server its own KV directory: slot files are locked by the server using them.
            import tempfile

            self.kv_dir = self._own_kv_dir = tempfile.mkdtemp(prefix="colibri-kv-")
            args = ("--kv-dir", self.kv_dir, *args)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "colibri", command, "--port", "0", "--threads", "2", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=full_env,
        )
        self.log: list[str] = []
        self.kv_dir = getattr(self, "kv_dir", None)
        deadline = time.monotonic() + timeout
        assert self.proc.stdout is not None
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError("server exited before it was ready:\n" + "".join(self.log))
            self.log.append(line)
            m = _READY.search(line)
            if m:
                self.model_id, self.url = m.group(1), m.group(2)
                break
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("server not ready in time:\n" + "".join(self.log))
        # Keep draining the output so the server never blocks on a full pipe.
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.log.append(line)

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        own = getattr(self, "_own_kv_dir", None)
        if own is not None:
            shutil.rmtree(own, ignore_errors=True)


def family_template(name: str) -> str:
    """The chat template the tests serve a family with: colibri's built-in one where the family
    has it (DeepSeek-V3.2, V4), else the test template in fixtures/templates/."""
    from colibri.chat.families import FAMILIES

    builtin = FAMILIES[name].builtin_template_source()
    if builtin is not None:
        return builtin
    return (Path(__file__).parent / "fixtures" / "templates" / f"{name}.jinja").read_text()


def model_with_template(src: Path, dst: Path, template: str | None) -> Path:
    """A copy of a converted model directory whose chat template is ``template`` (None: the
    manifest names none)."""
    import json

    shutil.copytree(src, dst)
    manifest = json.loads((dst / "manifest.json").read_text())
    manifest["chat_template"] = template
    (dst / "manifest.json").write_text(json.dumps(manifest))
    return dst


def long_window_builtin(where: Path) -> Path:
    """A copy of the built-in model (random: its replies never end) with a 65,536-token window,
    its manifest's only change: a reply runs as long as a test needs (its own window ran out
    in a few seconds under the full suite)."""
    import json

    from colibri.demo.builtin import builtin_model_dir

    model = where / "long"
    shutil.copytree(builtin_model_dir(), model)
    manifest = json.loads((model / "manifest.json").read_text())
    manifest["config"]["max_position_embeddings"] = 65536
    (model / "manifest.json").write_text(json.dumps(manifest))
    return model


def builtin_prompt_ids(engine, messages, thinking: bool = False) -> list[int]:
    """The token ids the server renders for ``messages`` on the built-in (GLM-4.5-style)
    template: the in-process oracle for prompt sizes and greedy outputs."""
    from colibri.chat.families import GLM
    from colibri.chat.literal import shield, tokenize_shielded
    from colibri.chat.render import render_chat
    from colibri.chat.template import ChatTemplate
    from colibri.demo.builtin import CHAT_TEMPLATE

    shielded = shield(messages, engine.special_tokens)
    rendered = render_chat(
        ChatTemplate(CHAT_TEMPLATE), GLM, shielded.messages, enable_thinking=thinking
    )
    return tokenize_shielded(rendered.text, shielded, engine.tokenize, engine.tokenize_literal)


def think_open_template() -> str:
    """A GLM-4.7-style variant of the built-in template: with thinking on, the generation
    prompt opens the think block itself, so the output starts inside reasoning."""
    from colibri.demo.builtin import CHAT_TEMPLATE

    template = CHAT_TEMPLATE.replace(
        "{%- if add_generation_prompt -%}\n<|assistant|>",
        "{%- if add_generation_prompt -%}\n<|assistant|>{% if enable_thinking %}<think>{% endif %}",
    )
    assert template != CHAT_TEMPLATE
    return template


def routing_heat_json(layer_counts: dict[int, list[int]]) -> str:
    """A ``routing-heat.json`` of these counts per MoE layer, as the engine writes it
    (crates/engine/src/store/heat.rs): put in a KV directory, it picks the pinned experts."""
    import json

    experts = len(next(iter(layer_counts.values())))
    layers = [{"layer": layer, "counts": c} for layer, c in sorted(layer_counts.items())]
    return json.dumps(
        {"format": "colibri-routing-heat", "version": 1, "experts": experts, "layers": layers}
    )


def ram_gb_for(
    model: Path, expert_cache_bytes: float, slots: int = 1, context: int | None = None
) -> str:
    """``--ram-gb`` (the server's one RAM budget) that leaves ``expert_cache_bytes`` to the
    expert cache of ``model`` served alone: its resident weights, ``slots`` KV slots at full
    context and its states come first (runtime/budget.py)."""
    from colibri.runtime.budget import plan_model

    fixed = plan_model(model, slots, context).fixed
    return repr((fixed + expert_cache_bytes) / 1e9)
