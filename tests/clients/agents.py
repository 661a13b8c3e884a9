"""The coding agents of the real-client suite: pinned versions, how each is installed (cached
under ``~/.cache/colibri/clients``, ``COLI_CACHE_DIR``) and how each runs non-interactively
against a colibri server. Every command and config here is the one docs/API.md ("Coding
agents") gives users; the suite checks that they work.

Run ``python -m tests.clients.agents [NAME...]`` to install without testing.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import venv
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from colibri.demo.builtin import cache_dir


class InstallFailed(RuntimeError):
    """The client could not be installed on this machine (said why)."""


@dataclass(frozen=True)
class Run:
    argv: list[str]
    env: dict[str, str]
    files: dict[str, str] = field(default_factory=dict)  # relative to HOME ("~/") or workdir


@dataclass(frozen=True)
class Agent:
    name: str
    package: str  # npm package, PyPI distribution or Go package path
    version: str
    registry: str  # "npm" | "pypi" | "go"
    binary: str  # path of the executable inside the install directory
    # (install dir, server base URL without /v1, model id, home, task) -> the run
    run: Callable[[Path, str, str, Path, str], Run]

    @property
    def home(self) -> Path:
        return cache_dir() / "clients" / f"{self.name}-{self.version}"

    def executable(self) -> Path:
        return self.home / self.binary

    def install(self) -> Path:
        """Installs the pinned version once (a marker file says it is complete)."""
        marker = self.home / ".installed"
        if marker.exists():
            return self.executable()
        if self.home.exists():
            shutil.rmtree(self.home)
        self.home.mkdir(parents=True)
        try:
            if self.registry == "npm":
                _npm_install(self.home, f"{self.package}@{self.version}")
            elif self.registry == "go":
                _go_install(self.home, f"{self.package}@v{self.version}")
            else:
                _pip_install(self.home, f"{self.package}=={self.version}")
        except subprocess.CalledProcessError as e:
            shutil.rmtree(self.home, ignore_errors=True)
            raise InstallFailed(f"{self.name}: {e.cmd[:3]} failed:\n{e.stdout}\n{e.stderr}") from e
        if not self.executable().exists():
            raise InstallFailed(f"{self.name}: {self.executable()} missing after install")
        marker.write_text(self.version)
        return self.executable()


def _npm_install(prefix: Path, spec: str) -> None:
    subprocess.run(
        ["npm", "install", "--prefix", str(prefix), "--no-audit", "--no-fund",
         "--loglevel=error", spec],
        check=True, capture_output=True, text=True, timeout=900,
    )  # fmt: skip


def _pip_install(prefix: Path, spec: str) -> None:
    venv.create(prefix, with_pip=True)
    subprocess.run(
        [str(prefix / "bin" / "python"), "-m", "pip", "install", "-q",
         "--disable-pip-version-check", spec],
        check=True, capture_output=True, text=True, timeout=1800,
    )  # fmt: skip


def _go_install(prefix: Path, spec: str) -> None:
    # Built from source out of the Go module proxy (GOTOOLCHAIN passes through, for a module
    # that needs a newer Go); niced, as the build takes every core for minutes.
    subprocess.run(
        ["go", "install", spec],
        env={**os.environ, "GOBIN": str(prefix / "bin"), "CGO_ENABLED": "0"},
        preexec_fn=lambda: os.nice(10),
        check=True, capture_output=True, text=True, timeout=1800,
    )  # fmt: skip


# --- each client -------------------------------------------------------------------------------
# The demo model's context (its CARD.md): every config below tells the client this window.
FULL_CONTEXT = 32768


def _claude(exe: Path, url: str, model: str, home: Path, task: str) -> Run:
    env = {
        "ANTHROPIC_BASE_URL": url,
        "ANTHROPIC_API_KEY": "local",
        # Claude Code names a model per role; every one is the served model.
        **{
            f"ANTHROPIC_{role}": model
            for role in (
                "MODEL",
                "SMALL_FAST_MODEL",
                "DEFAULT_HAIKU_MODEL",
                "DEFAULT_SONNET_MODEL",
                "DEFAULT_OPUS_MODEL",
            )
        },
        # Nothing but the model's own requests (no telemetry, updates, error reports).
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_AUTOUPDATER": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_ERROR_REPORTING": "1",
    }
    # --bare, no tools and a one-line system prompt: a short first request (a quick prefill).
    argv = [str(exe), "-p", "--bare", "--tools", "", "--system-prompt", "Be brief.", task]
    return Run(argv, env)


def _opencode(exe: Path, url: str, model: str, home: Path, task: str) -> Run:
    config = {
        "$schema": "https://opencode.ai/config.json",
        "provider": {
            "colibri": {
                "npm": "@ai-sdk/openai-compatible",
                "name": "colibri",
                "options": {"baseURL": url + "/v1", "apiKey": "local"},
                "models": {
                    model: {"name": model, "tool_call": True,
                            "limit": {"context": FULL_CONTEXT, "output": 512}},
                },
            }
        },
        "model": f"colibri/{model}",
        "small_model": f"colibri/{model}",
        "autoupdate": False,
        "share": "disabled",
        # A short agent prompt and the read tool only: short requests (a quick prefill).
        "agent": {"build": {"prompt": "Be brief."}},
        "tools": {t: False for t in ("bash", "edit", "glob", "grep", "skill", "task",
                                     "todowrite", "webfetch", "write")},
    }  # fmt: skip
    env = {
        "XDG_CONFIG_HOME": str(home / ".config"),
        "XDG_DATA_HOME": str(home / ".local/share"),
        "XDG_CACHE_HOME": str(home / ".cache"),
        "OPENCODE_DISABLE_MODELS_FETCH": "1",
        "OPENCODE_DISABLE_AUTOUPDATE": "1",
        "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
        "OPENCODE_DISABLE_SHARE": "1",
        "OPENCODE_DISABLE_DEFAULT_PLUGINS": "1",
        # On a context-length 400 opencode compacts and retries for ever; fail once instead.
        "OPENCODE_DISABLE_AUTOCOMPACT": "1",
    }
    return Run([str(exe), "run", task], env, {"opencode.json": json.dumps(config, indent=2)})


def _pi(exe: Path, url: str, model: str, home: Path, task: str) -> Run:
    models = {
        "providers": {
            "colibri": {
                "baseUrl": url + "/v1",
                "api": "openai-completions",
                "apiKey": "local",
                "models": [
                    {"id": model, "name": model, "contextWindow": FULL_CONTEXT, "maxTokens": 512}
                ],
            }
        }
    }
    # pi compacts when the context has less than reserveTokens (16384) left: with a small
    # window, after every prompt. Off: one request per turn.
    settings = {"compaction": {"enabled": False}}
    agent_dir = home / ".pi" / "agent"
    env = {
        "PI_CODING_AGENT_DIR": str(agent_dir),
        "PI_OFFLINE": "1",
        "PI_SKIP_VERSION_CHECK": "1",
        "PI_TELEMETRY": "0",
    }
    argv = [str(exe), "-p", "--provider", "colibri", "--model", model, "--tools", "read",
            "--system-prompt", "Be brief.", "-ns", "-nc", task]  # fmt: skip
    files = {
        "~/.pi/agent/models.json": json.dumps(models, indent=2),
        "~/.pi/agent/settings.json": json.dumps(settings),
    }
    return Run(argv, env, files)


def _aider(exe: Path, url: str, model: str, home: Path, task: str) -> Run:
    metadata = {
        f"openai/{model}": {
            "max_input_tokens": FULL_CONTEXT, "max_output_tokens": 512,
            "max_tokens": FULL_CONTEXT,
            "input_cost_per_token": 0, "output_cost_per_token": 0,
            "litellm_provider": "openai", "mode": "chat",
        }
    }  # fmt: skip
    argv = [
        str(exe), "--message", task, "--yes-always", "--no-git", "--no-auto-commits",
        "--model", f"openai/{model}", "--openai-api-base", url + "/v1",
        "--openai-api-key", "local", "--no-show-model-warnings", "--no-check-update",
        "--no-analytics", "--no-show-release-notes", "--no-pretty", "--no-fancy-input",
    ]  # fmt: skip
    files = {
        ".aider.model.metadata.json": json.dumps(metadata, indent=2),
        # aider fetches LiteLLM's price list from GitHub once a day; an empty cache skips it.
        "~/.aider/caches/model_prices_and_context_window.json": "{}",
    }
    return Run(argv, {"LITELLM_LOCAL_MODEL_COST_MAP": "True"}, files)


def _codex(exe: Path, url: str, model: str, home: Path, task: str) -> Run:
    config = f"""model = "{model}"
model_provider = "colibri"
model_context_window = {FULL_CONTEXT}

[model_providers.colibri]
name = "colibri"
base_url = "{url}/v1"
env_key = "COLIBRI_API_KEY"
wire_api = "responses"

[analytics]
enabled = false
"""
    env = {"CODEX_HOME": str(home / ".codex"), "COLIBRI_API_KEY": "local"}
    return Run([str(exe), "exec", "--skip-git-repo-check", task], env,
               {"~/.codex/config.toml": config})  # fmt: skip


def _crush(exe: Path, url: str, model: str, home: Path, task: str) -> Run:
    config = {
        "$schema": "https://charm.land/crush.json",
        "providers": {
            "colibri": {
                # crush's own advice: "openai-compat" for a server that is not OpenAI.
                "name": "colibri", "type": "openai-compat", "base_url": url + "/v1",
                "api_key": "local",
                "models": [{"id": model, "name": model, "context_window": FULL_CONTEXT,
                            "default_max_tokens": 512}],
            }
        },
        "models": {size: {"provider": "colibri", "model": model} for size in ("large", "small")},
        # No catalogue download (catwalk) and no usage metrics; the view tool only.
        "options": {
            "disable_provider_auto_update": True, "disable_metrics": True,
            "disabled_tools": ["agent", "agentic_fetch", "bash", "download", "edit", "fetch",
                               "glob", "grep", "ls", "multiedit", "sourcegraph", "todos",
                               "write"],
        },
    }  # fmt: skip
    env = {
        "XDG_CONFIG_HOME": str(home / ".config"),
        "XDG_DATA_HOME": str(home / ".local/share"),
        "CRUSH_DISABLE_PROVIDER_AUTO_UPDATE": "1",
        "CRUSH_DISABLE_METRICS": "1",
        "DO_NOT_TRACK": "1",
    }
    files = {"crush.json": json.dumps(config, indent=2)}  # the project's config
    return Run([str(exe), "run", "--quiet", task], env, files)


# --- each client as shipped (its default preamble and tools) ------------------------------------
# The runs above trim each client to a short request (a quick test); these keep everything the
# client sends by default (Claude Code ~28k tokens on the demo tokenizer, codex ~21.7k,
# opencode ~17.5k) and only point it at the server.


def _claude_full(exe: Path, url: str, model: str, home: Path, task: str) -> Run:
    return Run([str(exe), "-p", task], _claude(exe, url, model, home, task).env)


def _opencode_full(exe: Path, url: str, model: str, home: Path, task: str) -> Run:
    spec = _opencode(exe, url, model, home, task)
    config = json.loads(spec.files["opencode.json"])
    del config["agent"], config["tools"]
    return Run(spec.argv, spec.env, {"opencode.json": json.dumps(config, indent=2)})


FULL_RUNS: dict[str, Callable[[Path, str, str, Path, str], Run]] = {
    "claude": _claude_full,
    "opencode": _opencode_full,
    # codex's setup is its default one already (its fixed preamble and tools, ~21.7k tokens).
    "codex": _codex,
}


AGENTS = {
    a.name: a
    for a in (
        Agent("claude", "@anthropic-ai/claude-code", "2.1.332", "npm",
              "node_modules/@anthropic-ai/claude-code-linux-x64/claude", _claude),
        Agent("opencode", "opencode-ai", "1.18.33", "npm",
              "node_modules/opencode-linux-x64/bin/opencode", _opencode),
        Agent("pi", "@mariozechner/pi-coding-agent", "0.73.1", "npm",
              "node_modules/.bin/pi", _pi),
        Agent("aider", "aider-chat", "0.86.2", "pypi", "bin/aider", _aider),
        Agent("codex", "@openai/codex", "0.171.0", "npm",
              "node_modules/@openai/codex-linux-x64/vendor/x86_64-unknown-linux-musl/bin/codex",
              _codex),
        Agent("crush", "github.com/charmbracelet/crush", "0.96.1", "go", "bin/crush", _crush),
    )
}  # fmt: skip


def run_agent(
    agent: Agent,
    url: str,
    model: str,
    workdir: Path,
    task: str,
    timeout: float = 300,
    full: bool = False,
) -> subprocess.CompletedProcess:
    """Runs ``agent`` once on ``task`` in ``workdir`` with a fresh HOME of its own; ``full``:
    with the client's default setup (``FULL_RUNS``) instead of the small one."""
    exe = agent.install()
    home = workdir.parent / f"home-{agent.name}"
    home.mkdir(exist_ok=True)
    spec = (FULL_RUNS[agent.name] if full else agent.run)(exe, url, model, home, task)
    for rel, text in spec.files.items():
        path = home / rel[2:] if rel.startswith("~/") else workdir / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "LANG": "C.UTF-8",
        "TERM": "dumb",
        "NO_COLOR": "1",
        **spec.env,
    }
    return subprocess.run(
        spec.argv,
        cwd=workdir,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


if __name__ == "__main__":
    for name in sys.argv[1:] or list(AGENTS):
        print(name, AGENTS[name].install())
