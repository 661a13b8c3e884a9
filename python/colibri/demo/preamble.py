"""Long synthetic "agent preambles" for the demo model: the system turn a coding agent opens with.

Coding agents (Claude Code, aider, opencode, crush) start every conversation with a 10-20k
character system prompt and a JSON catalog of 12-21 tools (``Bash``, ``Read``, ``Edit``, ...),
each with a long description and an input schema. The demo tokenizer spends ~3 characters a token
on such prose, so that preamble is 5-8k tokens, long ones 12k and more. This module writes
preambles of that shape from word lists and templates (the words mean nothing; the shape and the
length are the point), with the demo tools (``data.TOOLS``) declared among the others, so
the demo model can be trained and evaluated on its tasks asked at the end of one.

Pure Python like ``data`` (no torch, no engine); every function takes its randomness from a
``random.Random`` or a seed. Lengths are asked in characters (``agent_preamble``) or, with a
token counter, in tokens (``fit_preamble``).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Sequence
from typing import Any

# Relative, so that scripts/train_demo_model.py (a Python without colibri) can load this
# package from its directory under another name.
from . import data as _dd

# --- word lists ---------------------------------------------------------------------------------

AGENT_TOOL_NAMES = [
    "Bash",
    "Read",
    "Edit",
    "MultiEdit",
    "Write",
    "Glob",
    "Grep",
    "LS",
    "WebFetch",
    "WebSearch",
    "TodoWrite",
    "TodoRead",
    "Task",
    "NotebookRead",
    "NotebookEdit",
    "ExitPlanMode",
    "BashOutput",
    "KillShell",
    "SlashCommand",
    "AskUserQuestion",
    "Skill",
    "ListMcpResources",
    "ReadMcpResource",
    "apply_patch",
    "view",
    "fetch",
    "diagnostics",
    "sourcegraph",
    "agent",
    "download",
]
_NAME_VERBS = [
    "list",
    "read",
    "write",
    "create",
    "delete",
    "update",
    "search",
    "find",
    "run",
    "check",
    "open",
    "close",
    "move",
    "copy",
    "rename",
    "fetch",
    "get",
    "set",
    "show",
    "format",
    "lint",
    "build",
    "test",
    "deploy",
    "merge",
    "review",
    "explain",
    "index",
    "sync",
    "watch",
]
_NAME_NOUNS = [
    "file",
    "files",
    "directory",
    "branch",
    "commit",
    "issue",
    "issues",
    "pull_request",
    "symbol",
    "symbols",
    "test",
    "tests",
    "task",
    "todo",
    "notebook",
    "cell",
    "page",
    "url",
    "process",
    "shell",
    "diff",
    "patch",
    "config",
    "secret",
    "package",
    "module",
    "log",
    "logs",
    "build",
    "job",
    "workspace",
    "project",
    "memory",
    "note",
    "snippet",
    "tag",
]
_VERBS = [
    "read",
    "edit",
    "run",
    "check",
    "search",
    "update",
    "create",
    "delete",
    "review",
    "explain",
    "verify",
    "summarize",
    "refactor",
    "commit",
    "install",
    "inspect",
    "format",
    "test",
    "rename",
    "document",
    "open",
    "list",
    "compare",
    "plan",
    "describe",
]
_OBJECTS = [
    "the file",
    "the tests",
    "the repository",
    "a new branch",
    "the user's code",
    "the configuration",
    "the documentation",
    "the lint command",
    "the build output",
    "the error message",
    "the function",
    "the module",
    "the diff",
    "the changes",
    "the working directory",
    "the commit message",
    "the dependencies",
    "the README",
    "the test suite",
    "the type checker",
    "the task list",
    "the shell command",
    "the pull request",
    "the code base",
    "the imports",
    "the style guide",
    "the logs",
    "the stack trace",
    "the API",
    "the schema",
    "the output",
    "the existing code",
]
_CONDITIONS = [
    "before making any changes",
    "after each edit",
    "when you are unsure",
    "if the task is complex",
    "unless the user asks you to",
    "when the command fails",
    "before you commit",
    "if a test breaks",
    "when the file is large",
    "after the build passes",
    "whenever it is possible",
    "if the user gives you a path",
    "before you answer",
    "when you start a new task",
    "if there is more than one way",
    "at the end of the turn",
]
_ADVERBS = ["Always", "Never", "Usually", "Only", "First", "Then", "Carefully", "Briefly"]
_TOPICS = [
    "Tone and style",
    "Proactiveness",
    "Following conventions",
    "Code style",
    "Task management",
    "Doing tasks",
    "Tool usage policy",
    "Code references",
    "Security",
    "Git workflow",
    "Testing",
    "Planning",
    "Asking questions",
    "Editing files",
    "Running commands",
    "Environment",
    "Memory",
    "Output format",
    "Examples",
    "Safety",
]
_PATH_DIRS = ["src", "lib", "tests", "docs", "scripts", "app", "pkg", "cmd", "internal", "web"]
_PATH_NAMES = [
    "main",
    "utils",
    "config",
    "server",
    "client",
    "index",
    "parser",
    "models",
    "routes",
    "handlers",
    "cli",
    "api",
    "store",
    "cache",
    "types",
    "helpers",
    "settings",
    "errors",
]
_EXTS = ["py", "ts", "js", "go", "rs", "md", "json", "toml", "yaml", "sh", "c", "h"]
_COMMANDS = [
    "git status",
    "git diff",
    "git log --oneline -5",
    "npm test",
    "npm run lint",
    "pytest -q",
    "cargo build",
    "cargo test",
    "go test ./...",
    "make check",
    "ls -la",
    "ruff check .",
    "just test",
    "yarn build",
    "tsc --noEmit",
    "uv run pytest",
]
_REQUESTS = [
    "fix the failing test",
    "add a flag to the command line",
    "rename this function",
    "explain what this file does",
    "write a test for the parser",
    "update the README",
    "find where the config is loaded",
    "remove the unused imports",
    "make the build pass",
    "add logging to the server",
    "check why the import fails",
    "bump the version",
]
_REPLIES = [
    "Done.",
    "I fixed it.",
    "The test passes now.",
    "It reads the config file.",
    "4",
    "Yes.",
    "I renamed it in three files.",
    "The build is green.",
    "src/main.py",
]
_TYPES = ["string", "string", "string", "integer", "boolean", "number", "array", "object"]
_PARAM_NAMES = [
    "path",
    "file_path",
    "pattern",
    "command",
    "query",
    "url",
    "content",
    "old_string",
    "new_string",
    "limit",
    "offset",
    "timeout",
    "description",
    "prompt",
    "glob",
    "todos",
    "recursive",
    "replace_all",
    "cwd",
    "max_results",
    "include",
    "exclude",
    "output_mode",
    "line",
    "column",
    "message",
    "branch",
    "title",
    "body",
    "mode",
    "language",
    "depth",
]


def _path(rng: random.Random) -> str:
    return (
        f"{rng.choice(_PATH_DIRS)}/{rng.choice(_PATH_NAMES)}.{rng.choice(_EXTS)}"
        if rng.random() < 0.8
        else f"{rng.choice(_PATH_DIRS)}/{rng.choice(_PATH_DIRS)}/{rng.choice(_PATH_NAMES)}"
    )


def _tool_ref(rng: random.Random) -> str:
    return rng.choice(AGENT_TOOL_NAMES)


def sentence(rng: random.Random) -> str:
    """One sentence of agent instructions."""
    k = rng.randrange(12)
    v, o, c = rng.choice(_VERBS), rng.choice(_OBJECTS), rng.choice(_CONDITIONS)
    if k == 0:
        return f"{rng.choice(_ADVERBS)} {v} {o} {c}."
    if k == 1:
        return f"When the user asks you to {rng.choice(_REQUESTS)}, {v} {o} first."
    if k == 2:
        return f"Do not {v} {o} unless the user asks you to {rng.choice(_VERBS)} it."
    if k == 3:
        return f"Use the {_tool_ref(rng)} tool to {v} {o} instead of the {_tool_ref(rng)} tool."
    if k == 4:
        return f"IMPORTANT: you must {v} {o} {c}."
    if k == 5:
        return f"Run `{rng.choice(_COMMANDS)}` to {v} {o} {c}."
    if k == 6:
        return f"If you need to {v} `{_path(rng)}`, {rng.choice(_VERBS)} {o} {c}."
    if k == 7:
        return f"You should {v} {o} and then {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}."
    if k == 8:
        n = rng.randint(1, 9)
        return f"Keep your answer to {n} lines or fewer {c}."
    if k == 9:
        return f"It is better to {v} {o} than to {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}."
    if k == 10:
        return f"The user can see {o}, so never {v} it {c}."
    other = f"{rng.choice(_VERBS)} {rng.choice(_OBJECTS)}"
    return f"{rng.choice(_ADVERBS)} prefer to {v} {o}; {other} {c}."


def _paragraph(rng: random.Random) -> str:
    return " ".join(sentence(rng) for _ in range(rng.randint(2, 6)))


def _section(rng: random.Random) -> str:
    head = f"# {rng.choice(_TOPICS)}\n"
    r = rng.random()
    if r < 0.4:
        body = _paragraph(rng)
    elif r < 0.8:
        body = "\n".join(f"- {sentence(rng)}" for _ in range(rng.randint(2, 7)))
    else:
        examples = []
        for _ in range(rng.randint(1, 3)):
            examples.append(
                f"<example>\nuser: {rng.choice(_REQUESTS)}\n"
                f"assistant: {rng.choice(_REPLIES)}\n</example>"
            )
        body = _paragraph(rng) + "\n" + "\n".join(examples)
    return head + body


def prose(rng: random.Random, target_chars: int) -> str:
    """Agent instructions (headed sections of sentences, lists, examples) of about
    ``target_chars`` characters (at least one sentence)."""
    parts = [
        "You are an interactive CLI agent that helps users with software engineering tasks. "
        "Use the instructions below and the tools available to you to assist the user."
    ]
    size = len(parts[0])
    while size < target_chars:
        s = _section(rng)
        parts.append(s)
        size += len(s) + 2
    return "\n\n".join(parts)


def _tool_name(rng: random.Random, taken: set[str]) -> str:
    while True:
        if rng.random() < 0.5:
            name = rng.choice(AGENT_TOOL_NAMES)
        else:
            name = f"{rng.choice(_NAME_VERBS)}_{rng.choice(_NAME_NOUNS)}"
            if rng.random() < 0.3:
                name = "mcp__" + rng.choice(["github", "linear", "fs", "docs", "ide"]) + "__" + name
        if name not in taken and name not in _dd.TOOLS:
            taken.add(name)
            return name


def _schema_property(rng: random.Random) -> dict[str, Any]:
    t = rng.choice(_TYPES)
    prop: dict[str, Any] = {"type": t, "description": sentence(rng)}
    if t == "string" and rng.random() < 0.2:
        prop["enum"] = rng.sample(["content", "files_with_matches", "count", "auto", "all"], 3)
    if t == "array":
        if rng.random() < 0.5:
            prop["items"] = {"type": "string"}
        else:
            prop["items"] = {
                "type": "object",
                "properties": {
                    "content": {"type": "string", "minLength": 1},
                    "status": {"type": "string", "enum": ["pending", "in_progress", "completed"]},
                    "id": {"type": "string"},
                },
                "required": ["content", "status", "id"],
                "additionalProperties": False,
            }
    if t == "integer" and rng.random() < 0.5:
        prop["minimum"] = 0
        if rng.random() < 0.5:
            prop["maximum"] = rng.choice([100, 600000, 2000])
    if t == "object":
        prop["additionalProperties"] = {"type": "string"}
    return prop


def agent_tool(rng: random.Random, name: str) -> dict[str, Any]:
    """One tool of an agent's catalog, in the OpenAI function shape the chat template renders:
    a long description (paragraphs, a usage list) and a JSON schema of 1-6 parameters."""
    desc = [_paragraph(rng)]
    if rng.random() < 0.7:
        desc.append("Usage:\n" + "\n".join(f"- {sentence(rng)}" for _ in range(rng.randint(2, 9))))
    if rng.random() < 0.4:
        desc.append(_paragraph(rng))
    names = rng.sample(_PARAM_NAMES, rng.randint(1, 6))
    props = {n: _schema_property(rng) for n in names}
    required = [n for n in names if rng.random() < 0.6] or names[:1]
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": "\n\n".join(desc),
            "parameters": {
                "type": "object",
                "properties": props,
                "required": required,
                "additionalProperties": False,
                "$schema": "http://json-schema.org/draft-07/schema#",
            },
        },
    }


def _tool_chars(tool: dict) -> int:
    return len(json.dumps(tool, ensure_ascii=False)) + 1


def agent_preamble(
    rng: random.Random,
    target_chars: int,
    demo_tools: Sequence[dict] = (),
    prose_share: float | None = None,
) -> dict[str, Any]:
    """A system prompt and a tool catalog of about ``target_chars`` characters in all.

    Returns ``{"system": str, "tools": [tool, ...]}``: agent tools with long descriptions (at
    least one once there is room for it), ``demo_tools`` (``data.TOOLS`` entries, as given)
    each at a random place among them. ``prose_share`` of the characters are instructions
    (default: drawn from 0.25-0.65, what agents ship); the demo tools count toward the rest."""
    if target_chars < 0:
        raise ValueError(f"target_chars must be >= 0, got {target_chars}")
    share = rng.uniform(0.25, 0.65) if prose_share is None else prose_share
    system = prose(rng, int(target_chars * share))
    room = target_chars - len(system) - sum(_tool_chars(t) for t in demo_tools)
    taken: set[str] = set()
    tools: list[dict] = []
    while room > 600 or (not tools and room > 0):
        t = agent_tool(rng, _tool_name(rng, taken))
        tools.append(t)
        room -= _tool_chars(t)
    for t in demo_tools:
        tools.insert(rng.randint(0, len(tools)), t)
    return {"system": system, "tools": tools}


def _trim_prose(system: str, chars: int) -> str:
    """``system`` without about its last ``chars`` characters, cut after a sentence or a line
    (never below the opening sentence)."""
    keep = max(len(system) - chars, 0)
    cut = max(system.rfind(". ", 0, keep + 1), system.rfind("\n", 0, keep + 1))
    first = system.find(". ") + 1
    if cut < first:
        return system[:first]
    return system[: cut + 1].rstrip()


def fit_preamble(
    rng: random.Random,
    target_tokens: int,
    count: Callable[[dict], int],
    demo_tools: Sequence[dict] = (),
    chars_per_token: float = 2.0,
    tries: int = 3,
) -> dict[str, Any]:
    """``agent_preamble`` sized to about ``target_tokens`` tokens as ``count`` measures them
    (``count(preamble) -> tokens``, e.g. the rendered system turn through the tokenizer): each
    try redraws from the same state of ``rng`` with the characters rescaled by the last try's
    ratio, aiming a little high; then agent tools that fit in the excess are dropped and the
    instructions lose sentences at their end until the count is within 2% (a tool is 1-2k
    characters, a sentence ~80). The result is a function of the seed. Returns the preamble
    with ``"tokens"``."""
    state = rng.getstate()
    aim = int(target_tokens * 1.03)
    chars = int(aim * chars_per_token)
    best: dict[str, Any] | None = None
    for _ in range(tries):
        rng.setstate(state)
        p = agent_preamble(rng, chars, demo_tools)
        p["tokens"] = n = count(p)
        # The closest at or above the target (what trimming can bring down), else the closest.
        if (
            best is None
            or (n >= target_tokens) > (best["tokens"] >= target_tokens)
            or (
                (n >= target_tokens) == (best["tokens"] >= target_tokens)
                and abs(n - aim) < abs(best["tokens"] - aim)
            )
        ):
            best = p
        if n <= 0 or abs(n - aim) <= 0.02 * target_tokens:
            break
        chars = int(chars * aim / n)
    assert best is not None
    demo_names = {t["function"]["name"] for t in demo_tools}
    while best["tokens"] - target_tokens > 0.02 * target_tokens:
        # Drop the largest agent tool that fits in the excess, if one does.
        room = (best["tokens"] - target_tokens) * chars_per_token * 1.1
        fits = [
            (_tool_chars(t), i)
            for i, t in enumerate(best["tools"])
            if t["function"]["name"] not in demo_names and _tool_chars(t) <= room
        ]
        if not fits:
            break
        drop = max(fits)[1]
        best = dict(best, tools=[t for i, t in enumerate(best["tools"]) if i != drop])
        best["tokens"] = count(best)
    for _ in range(4):
        excess = best["tokens"] - target_tokens
        if excess <= 0.02 * target_tokens:
            break
        system = _trim_prose(best["system"], int(excess * chars_per_token))
        if system == best["system"]:
            break
        best = dict(best, system=system)
        best["tokens"] = count(best)
    return best


def with_preamble(conv_or_item: dict, preamble: dict) -> dict:
    """A copy of a conversation (``data.train_conversation``) or evaluation item
    (``data.eval_items``) whose prompt opens with ``preamble``: its system message
    (``SYSTEM_PROMPTS`` line, if any) is replaced by the preamble's instructions, and its tools
    (if any) join the preamble's catalog, which already holds the demo tools the preamble was
    made with. The tools of ``conv_or_item`` must be among those (or the preamble declares
    them): whether a demo tool is declared is what the trained answers depend on."""
    names = {t["function"]["name"] for t in preamble["tools"]}
    tools = list(preamble["tools"])
    for t in conv_or_item.get("tools") or []:
        if t["function"]["name"] not in names:
            raise ValueError(f"the preamble does not declare {t['function']['name']}")
    messages = [m for m in conv_or_item["messages"] if m["role"] != "system"]
    out = dict(conv_or_item)
    out["messages"] = [{"role": "system", "content": preamble["system"]}] + messages
    out["tools"] = tools
    return out


def demo_tools_of(conv_or_item: dict) -> list[dict]:
    """The demo tools (``data.TOOLS``) a conversation or item declares."""
    return [t for t in conv_or_item.get("tools") or [] if t["function"]["name"] in _dd.TOOLS]


def long_train_conversation(
    rng: random.Random,
    target_chars: int,
    episodes: int,
    pieces: Any = None,
    trailing: bool = False,
    mix: Sequence[tuple[str, int]] | None = None,
    tool_extra: int = 0,
) -> dict:
    """A training conversation (``data.train_conversation`` with ``episodes`` episodes)
    whose prompt opens with an agent preamble of about ``target_chars`` characters declaring
    the demo tools the conversation declares (none, in a third of them: then a tool request
    is answered like one whose tool is not declared, as in short conversations)."""
    conv = _dd.train_conversation(
        rng,
        pieces,
        trailing=trailing,
        mix=_dd.TRAIN_MIX if mix is None else mix,
        tool_extra=tool_extra,
        episodes=episodes,
    )
    pre = agent_preamble(rng, target_chars, demo_tools_of(conv))
    return with_preamble(conv, pre)


def long_eval_items(
    task: str,
    n: int,
    seed: int,
    target_tokens: int,
    count: Callable[[dict], int],
    group: int = 10,
) -> list[dict]:
    """``data.eval_items(task, n, seed)``, each behind a ~``target_tokens``-token agent
    preamble declaring all three demo tools among the agent's (the tools an item declares are
    among them, so the expected answers stay right). ``group`` consecutive items share one
    preamble (an engine can reuse its prefill); each item gets ``"preamble_tokens"``."""
    items = _dd.eval_items(task, n, seed)
    demo = list(_dd.TOOLS.values())
    out: list[dict] = []
    pre: dict | None = None
    for i, item in enumerate(items):
        if i % max(1, group) == 0:
            rng = random.Random(f"preamble/{task}/{seed}/{i}")
            pre = fit_preamble(rng, target_tokens, count, demo)
        assert pre is not None
        long = with_preamble(item, pre)
        long["preamble_tokens"] = pre["tokens"]
        out.append(long)
    return out
