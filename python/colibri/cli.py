"""`colibri` / `coli` command line: serve, generate, convert, upgrade, bench."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from colibri.chat.families import FAMILIES
from colibri.runtime.budget import STATE_COPIES

if TYPE_CHECKING:
    from colibri.runtime.catalog import CatalogEntry


def _model_dir(arg: str | None) -> Path:
    """``--model``, else ``COLI_MODEL``, else the built-in default model."""
    chosen = arg or os.environ.get("COLI_MODEL")
    if chosen:
        return Path(chosen)
    from colibri.demo.builtin import default_model_dir

    return default_model_dir()


class UsageError(Exception):
    """A bad flag only the model directory can tell (a --context above the model's): exit
    status 2, as argparse's own."""


def _load(
    args: argparse.Namespace,
    slots: int = 1,
    kv_dir: Path | None = None,
    model_dir: Path | None = None,
    context: int | None = None,
    expert_gb: float | None = None,
    sized: bool = False,
):
    """The engine of ``model_dir`` (default: ``--model``'s) as the flags say; ``context``:
    instead of ``--context`` (a catalog entry's, never above its model's). With ``sized``, its
    expert cache is ``expert_gb`` as the server's RAM budget gave it; else ``--ram-gb`` is this
    one model's budget (its cache: what the budget leaves after its resident weights and KV)."""
    from colibri.runtime.engine import Engine

    context = args.context if context is None else context
    path = model_dir or _model_dir(args.model)
    if not sized and args.ram_gb is not None:
        expert_gb = _single_budget(args, path, slots, context).engine_ram_gb("model")
    try:
        return Engine(
            path,
            threads=args.threads,
            slots=slots,
            kv_dir=kv_dir,
            ram_gb=expert_gb,
            pin_gb=args.pin_gb,
            # Flags only switch on; off means "as COLI_DIRECT_IO / COLI_PREFETCH say".
            direct_io=True if args.direct_io else None,
            prefetch=True if args.prefetch else None,
            context=context,
        )
    except ValueError as e:
        # The engine's refusal of a context above the model's (crates/engine/src/model/mod.rs).
        if context is not None and str(e).startswith(f"context {context} is out of"):
            raise UsageError(f"--{e}") from None
        raise


def _single_budget(args: argparse.Namespace, path: Path, slots: int, context: int | None):
    """``--ram-gb`` for one model: its expert cache gets what the budget leaves after its
    resident weights, KV slots and states (UsageError with the numbers when nothing is left)."""
    from colibri.runtime.budget import BudgetError, RamBudget, plan_model

    try:
        return RamBudget(int(args.ram_gb * 1e9), {"model": plan_model(path, slots, context)}, {})
    except BudgetError as e:
        raise UsageError(str(e)) from None


def _size(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def kv_report(slots: int, info: dict) -> str:
    """The startup line on the context in use and the KV memory it can take at most."""
    context, own = info["context_length"], info["model_context_length"]
    per_token = info["kv_bytes_per_token"]
    lowered = f" (the model's: {own})" if context < own else ""
    line = (
        f"colibri: context {context} tokens{lowered}; KV memory up to "
        f"{_size(slots * context * per_token)} ({slots} slot(s) x {context} tokens x "
        f"{per_token} bytes per token)"
    )
    state = info.get("state_bytes_per_slot", 0)
    if state:
        line += (
            f"; per-slot state (linear attention, DeepSeek-V4's windows) up to "
            f"{_size(slots * state * STATE_COPIES)} "
            f"({slots} slot(s) x {STATE_COPIES} copies x {state} bytes)"
        )
    return line


def _kv_dir(args: argparse.Namespace, model_dir: Path) -> Path | None:
    """``--kv-dir``, else ``COLI_KV_DIR``, else a directory per model under the cache dir;
    None with ``--no-kv-persist``."""
    if args.no_kv_persist:
        return None
    chosen = args.kv_dir or os.environ.get("COLI_KV_DIR")
    if chosen:
        return Path(chosen)
    import hashlib

    from colibri.demo.builtin import cache_dir

    resolved = str(model_dir.resolve())
    tag = hashlib.sha256(resolved.encode()).hexdigest()[:12]
    return cache_dir() / "kv" / f"{model_dir.resolve().name}-{tag}"


# The engine's error for a slot file another process holds (crates/engine/src/slotfile/lock.rs).
SLOT_FILE_IN_USE = "the slot file is in use"


def kv_dir_in_use_hint(kv_dir: Path) -> str:
    """What to do when another server holds the slot files of ``kv_dir``."""
    return (
        f"Another colibri server is using the KV directory {kv_dir}; to run a second server "
        "beside it, give this one a directory of its own with --kv-dir DIR, or keep its KV "
        "slots in memory with --no-kv-persist"
    )


def cmd_serve(args: argparse.Namespace) -> int:
    from colibri import server

    if args.api_key == "":
        print(
            "colibri serve: --api-key is empty; give a key or leave the flag out", file=sys.stderr
        )
        return 2
    if args.max_active is not None and args.max_active > args.kv_slots:
        print(
            f"colibri serve: --max-active {args.max_active} is more than the {args.kv_slots} KV "
            "slots; give at most --kv-slots (or more slots)",
            file=sys.stderr,
        )
        return 2
    api_key = args.api_key or os.environ.get("COLI_API_KEY") or None
    try:
        server.check_bind(args.host, api_key, args.allow_unauthenticated)
    except server.StartupRefused as e:
        print(f"colibri serve: {e}", file=sys.stderr)
        return 2
    sock = server.open_socket(args.host, args.port)

    from colibri.api.app import create_app
    from colibri.runtime.catalog import CatalogError
    from colibri.runtime.models import ModelSet
    from colibri.runtime.served import ServedModel, ServerConfig

    model_dir = _model_dir(args.model)
    try:
        entries = _catalog(args, model_dir)
    except CatalogError as e:
        print(f"colibri serve: {e}", file=sys.stderr)
        return 2
    default = entries[0]
    several = args.models_dir is not None or args.catalog is not None
    try:
        budget = _ram_budget(args, entries)
    except UsageError as e:
        print(f"colibri serve: {e}", file=sys.stderr)
        return 2

    def expert_gb(entry: CatalogEntry) -> float | None:
        return None if budget is None else budget.engine_ram_gb(entry.id)

    kv_dir = _entry_kv_dir(args, default.id) if several else _kv_dir(args, model_dir)
    try:
        engine = _load(
            args,
            slots=args.kv_slots,
            kv_dir=kv_dir,
            expert_gb=expert_gb(default),
            sized=budget is not None,
        )
    except ValueError as e:
        if kv_dir is None or SLOT_FILE_IN_USE not in str(e):
            raise
        print(f"colibri serve: {e}. {kv_dir_in_use_hint(kv_dir)}", file=sys.stderr)
        return 2
    context, per_token = engine.info["context_length"], engine.info["kv_bytes_per_token"]
    try:
        server.check_kv_memory(
            args.kv_slots,
            context,
            per_token,
            engine.info.get("state_bytes_per_slot", 0) * STATE_COPIES,
        )
    except server.StartupRefused as e:
        have = server.available_memory_bytes() or 0
        fit = have // max(1, args.kv_slots * per_token)
        hint = f", or keep them with --context {fit} or less" if 1 <= fit < context else ""
        print(f"colibri serve: {e}{hint}", file=sys.stderr)
        return 2
    print(kv_report(args.kv_slots, engine.info), file=sys.stderr, flush=True)
    config = ServerConfig(
        model_id=default.id,
        aliases=default.aliases,
        api_key=api_key,
        allowed_hosts=(*server.env_list("COLI_ALLOWED_HOSTS"), *(args.allowed_host or ())),
        cors_origins=tuple(args.cors_origin or ()),
        max_tokens=args.max_tokens,
        continue_assistant=os.environ.get("COLI_CONTINUE_ASSISTANT", "1") != "0",
        chat_family=args.chat_family,
        kv_slots=args.kv_slots,
        max_active=args.max_active,
        max_queue=args.max_queue,
        queue_timeout=args.queue_timeout,
        access_log=not args.quiet,
        log_format=args.log_format,
    )
    from colibri.observability import MetricsHub

    hub = MetricsHub()  # one /metrics for every model, each under its `model` label
    served = ServedModel(engine, config, default.created, hub=hub)

    def load(entry: CatalogEntry) -> ServedModel:
        """A catalog entry's engine (its expert cache as the RAM budget gives it), KV slots (in
        a directory of its own) and scheduler."""
        entry_engine = _load(
            args,
            args.kv_slots,
            _entry_kv_dir(args, entry.id),
            entry.path,
            context=_entry_context(args, entry),
            expert_gb=expert_gb(entry),
            sized=budget is not None,
        )
        own = dataclasses.replace(
            config, model_id=entry.id, aliases=entry.aliases, chat_family=entry.chat_family
        )
        return ServedModel(entry_engine, own, entry.created, hub=hub)

    loaded = {default.id: served}
    for entry in entries[1:]:
        if entry.pinned:
            loaded[entry.id] = load(entry)
    models = ModelSet(
        entries,
        load,
        loaded,
        context=args.context,
        ready_timeout=args.ready_timeout,
        state_dir=lambda entry: _entry_kv_dir(args, entry.id),
        budget_bytes=None if budget is None else budget.total,
        footprint=_footprint(args, budget),
        refusal=None if budget is None else lambda entry: budget.refusal(entry.id),
        request_timeout=_request_timeout(args.request_timeout, several),
    )
    if several:
        print(
            f"colibri: {len(entries)} models in the catalog, {len(loaded)} loaded: "
            + ", ".join(f"{e.id} ({e.name})" for e in entries),
            file=sys.stderr,
            flush=True,
        )
    from colibri.api.web import dashboard_dir

    page = server.browser_url(sock) + "/" if dashboard_dir() is not None else None
    if args.open_browser and page is not None:
        server.open_browser(page)
    server.run(
        create_app(served, models), sock, config.model_id, on_stop=models.close, dashboard=page
    )
    return 0


# --request-timeout's default with a catalog: the 300 s after which proxies and clients give up
# on a silent response (seed 003's edge limit), as --ready-timeout's.
CATALOG_REQUEST_TIMEOUT_S = 300.0


def _request_timeout(given: float | None, several: bool) -> float | None:
    """--request-timeout in force: as given (0: off); else 300 s with a catalog, and off for
    one model, whose long CPU generations not streamed have always run to their end."""
    if given is None:
        return CATALOG_REQUEST_TIMEOUT_S if several else None
    return given or None


def _entry_context(args: argparse.Namespace, entry: CatalogEntry) -> int | None:
    """The context a catalog entry runs with: ``--context``, lowered to its model's own."""
    cap = entry.configured_context
    return min(args.context, cap) if args.context and cap else args.context


def _ram_gb(args: argparse.Namespace) -> float | None:
    """``--ram-gb``, or the deprecated ``--models-ram-gb`` (a warning; both at once: a
    UsageError naming the one to keep)."""
    old = args.models_ram_gb
    if old is None:
        return args.ram_gb
    if args.ram_gb is not None:
        raise UsageError(
            "--models-ram-gb is replaced by --ram-gb, the one RAM budget of the whole server "
            "(every model's resident weights, KV slots and expert cache together); give only "
            f"--ram-gb (the total: --ram-gb {old:g} to keep the models' limit)"
        )
    print(
        "colibri serve: warning: --models-ram-gb (COLI_MODELS_RAM_GB) is deprecated: it is "
        f"now --ram-gb (COLI_RAM_GB), the one RAM budget of the whole server; using --ram-gb "
        f"{old:g}",
        file=sys.stderr,
        flush=True,
    )
    return old


def _ram_budget(args: argparse.Namespace, entries: list[CatalogEntry]):
    """The server's RAM budget over the catalog (None without ``--ram-gb``), reported on
    stderr: each model loaded at startup with its expert cache, and what is left for the
    models loaded on demand. UsageError when the models loaded at startup cannot fit."""
    from colibri.runtime.budget import BudgetError, RamBudget, gb, plan_model

    total = _ram_gb(args)
    if total is None:
        return None
    kept, on_demand = {}, {}
    for i, entry in enumerate(entries):
        slots, ctx = args.kv_slots, _entry_context(args, entry)
        if i == 0 or entry.pinned:
            kept[entry.id] = plan_model(entry.path, slots, ctx)
            continue
        try:
            on_demand[entry.id] = plan_model(entry.path, slots, ctx)
        except (ValueError, RuntimeError, OSError):
            on_demand[entry.id] = None  # its load reports the problem
    try:
        budget = RamBudget(int(total * 1e9), kept, on_demand)
    except BudgetError as e:
        raise UsageError(str(e)) from None
    parts = []
    for entry_id, m in kept.items():
        cache = budget.cache_bytes(entry_id)
        experts = f" + expert cache {gb(cache)} of {gb(m.experts)}" if m.experts else ""
        parts.append(f"{entry_id} {gb(m.fixed + cache)} ({m.describe()}{experts})")
    line = f"colibri: RAM budget {gb(budget.total)} (--ram-gb): " + "; ".join(parts)
    if on_demand:
        line += f"; {gb(budget.on_demand_room)} left for the models loaded on demand"
    print(line, file=sys.stderr, flush=True)
    from colibri.server import available_memory_bytes

    have = available_memory_bytes()
    if have is not None and budget.total > have:
        print(
            f"colibri serve: warning: --ram-gb {total:g} is more than the {gb(have)} of memory "
            "available now: the system may swap or stop the server before the budget is reached",
            file=sys.stderr,
            flush=True,
        )
    return budget


def _footprint(args: argparse.Namespace, budget):
    """What a catalog model counts against the RAM budget (health's ``ram_bytes``): its
    resident weights, KV slots, states and expert cache as the budget sizes them; without a
    budget, every expert resident (nothing is unloaded then)."""
    from colibri.runtime.budget import plan_model

    plans: dict[str, int] = {}

    def footprint(entry: CatalogEntry, model) -> int:
        if budget is not None:
            return budget.need(entry.id)
        if entry.id not in plans:
            try:
                m = plan_model(entry.path, args.kv_slots, _entry_context(args, entry))
                plans[entry.id] = m.fixed + m.experts
            except (ValueError, RuntimeError, OSError):
                plans[entry.id] = 0
        return plans[entry.id]

    return footprint


def _catalog(args: argparse.Namespace, model_dir: Path) -> list[CatalogEntry]:
    """The served models: ``--model``'s (or the demo model) first, under its id as today, then
    the catalog file's entries and the models ``--models-dir`` holds."""
    from colibri.demo.builtin import model_id_for
    from colibri.runtime.catalog import make_entry, merge, read_catalog, scan_models_dir

    dir_id = model_id_for(model_dir)
    alias = args.model_id or os.environ.get("COLI_MODEL_ID") or None
    default = make_entry(
        model_dir,
        id=alias or dir_id,
        aliases=(dir_id,) if alias else (),
        chat_family=args.chat_family,
    )
    listed = read_catalog(Path(args.catalog)) if args.catalog else []
    scanned = scan_models_dir(Path(args.models_dir)) if args.models_dir else []
    return merge([default, *listed], scanned)


def _entry_kv_dir(args: argparse.Namespace, entry_id: str) -> Path | None:
    """A catalog entry's KV directory: a subdirectory named after its id of ``--kv-dir``
    (else ``COLI_KV_DIR``, else the cache dir's ``kv/``); None with ``--no-kv-persist``."""
    if args.no_kv_persist:
        return None
    chosen = args.kv_dir or os.environ.get("COLI_KV_DIR")
    if chosen:
        base = Path(chosen)
    else:
        from colibri.demo.builtin import cache_dir

        base = cache_dir() / "kv"
    from colibri.runtime.catalog import dir_name

    return base / dir_name(entry_id)


def cmd_generate(args: argparse.Namespace) -> int:
    engine = _load(args)
    ids = engine.tokenize(args.prompt)
    if not ids:
        print("colibri: the prompt is empty", file=sys.stderr)
        return 2
    out: list[int] = []
    shown = ""
    stream = engine.generate(
        ids, args.max_tokens, args.temperature, args.top_p, engine.eos_token_ids, args.seed
    )
    for tok in stream:
        if tok in engine.eos_token_ids:
            break
        out.append(tok)
        text = engine.detokenize(out)
        # Hold back a trailing partial UTF-8 sequence until it completes.
        if text.endswith("\ufffd"):
            continue
        sys.stdout.write(text[len(shown) :])
        sys.stdout.flush()
        shown = text
    text = engine.detokenize(out)
    sys.stdout.write(text[len(shown) :] + "\n")
    return 0


def cmd_upgrade(args: argparse.Namespace) -> int:
    from colibri.runtime.engine import upgrade

    t0 = time.perf_counter()
    summary = upgrade(args.old_dir, args.new_dir, progress=sys.stderr.isatty())
    print(
        f"upgraded {args.old_dir} to {args.new_dir}: {summary['matrices']} int4 matrices "
        f"re-encoded, {summary['bytes'] / 1e6:.1f} MB, {time.perf_counter() - t0:.1f} s"
    )
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from colibri.runtime.engine import convert

    src, dst = Path(args.hf_dir), Path(args.out_dir)
    if not (src / "config.json").is_file():
        print(
            f"colibri convert: {src}/config.json not found: not a Hugging Face checkpoint",
            file=sys.stderr,
        )
        return 2
    t0 = time.perf_counter()
    q8 = [] if args.pure else (args.q8 or None)
    summary = convert(
        src,
        dst,
        args.quant,
        progress=sys.stderr.isatty(),
        keep_f32=args.keep_f32,
        q8=q8,
        calibration=args.calibration,
        threads=args.threads,
        q4_0_rounding=args.q4_0_rounding,
        grid=args.grid,
    )
    dt = time.perf_counter() - t0
    mb = (summary["resident_bytes"] + summary["expert_bytes"]) / 1e6
    print(
        f"converted {summary['architecture']} to {dst} ({args.quant}): {mb:.1f} MB "
        f"({summary['resident_bytes'] / 1e6:.1f} MB resident, "
        f"{summary['expert_bytes'] / 1e6:.1f} MB experts), "
        f"{summary['skipped_tensors']} tensors skipped, {dt:.1f} s"
    )
    if cal := summary.get("calibration"):
        print(
            f"int4 error weighted by {args.calibration}: {cal['tokens']} tokens in chunks of "
            f"{cal['ctx']}, sha256 {cal['sha256']}"
        )
    return 0


def cmd_eval_ppl(args: argparse.Namespace) -> int:
    from colibri.quality import evaluate
    from colibri.runtime.engine import Engine

    try:
        text = Path(args.text).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"--text {args.text}: {e}") from None
    engine = _load(args)
    if args.ctx > engine.info["context_length"]:
        raise UsageError(
            f"--ctx {args.ctx} is above the model's context ({engine.info['context_length']})"
        )
    reference = Engine(args.reference, threads=args.threads) if args.reference else None
    tokens = engine.tokenize(text, add_special_tokens=True)
    bos = engine.info.get("bos_token_id")
    # As llama-perplexity: each chunk opens with BOS when the tokenizer adds one.
    adds_bos = bos is not None and engine.tokenize("a", add_special_tokens=True)[:1] == [bos]
    try:
        q = evaluate(
            engine,
            tokens,
            args.ctx,
            reference=reference,
            bos=bos if adds_bos else None,
            max_chunks=args.chunks,
        )
    except ValueError as e:
        raise UsageError(str(e)) from None
    result = {
        "model": str(engine.path),
        "reference": args.reference,
        "quantization": engine.info["quantization"],
        "text_tokens": len(tokens),
        **q.as_dict(),
    }
    if args.json:
        print(json.dumps(result))
        return 0
    line = (
        f"{engine.info['architecture']} {engine.info['quantization']}: "
        f"PPL {q.ppl:.4f} +/- {q.ppl_err:.4f} over {q.scored_tokens} tokens "
        f"({q.chunks} chunks of {q.ctx})"
    )
    if q.kl_mean is not None:
        line += (
            f"; KL from {args.reference}: mean {q.kl_mean:.6f} +/- {q.kl_err:.6f}, "
            f"p99 {q.kl_p99:.6f}, max {q.kl_max:.6f}; same top token {100 * q.same_top:.2f}%"
        )
    print(line)
    return 0


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def cmd_bench(args: argparse.Namespace) -> int:
    import numpy as np

    engine = _load(args)
    vocab = engine.info["vocab_size"]
    rng = np.random.default_rng(0)
    prefill: list[float] = []
    decode: list[float] = []
    # One untimed run first (as llama-bench does): caches, page tables and thread pool warm.
    list(engine.generate([int(x) for x in rng.integers(0, vocab, args.prompt_tokens)], 2))
    for _ in range(args.repeat):
        prompt = [int(x) for x in rng.integers(0, vocab, args.prompt_tokens)]
        stream = engine.generate(prompt, args.gen_tokens + 1)
        t0 = time.perf_counter()
        next(stream)  # prefill + first token
        t1 = time.perf_counter()
        n = sum(1 for _ in stream)
        t2 = time.perf_counter()
        prefill.append(args.prompt_tokens / (t1 - t0))
        if n:
            decode.append(n / (t2 - t1))
    result = {
        "model": str(engine.path),
        "architecture": engine.info["architecture"],
        "quantization": engine.info["quantization"],
        "kernel": engine.info["kernel"],
        "kernel_prefetch": engine.info["kernel_prefetch"],
        "kernel_prefetch_decode": engine.info["kernel_prefetch_decode"],
        "threads": engine.info["threads"],
        "prompt_tokens": args.prompt_tokens,
        "gen_tokens": args.gen_tokens,
        "prefill_tok_s": float(np.median(prefill)),
        "decode_tok_s": float(np.median(decode)) if decode else 0.0,
        "prefill_runs": prefill,
        "decode_runs": decode,
        "peak_rss_mb": _peak_rss_mb(),
        "kv_bytes_per_token": engine.info["kv_bytes_per_token"],
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"{result['architecture']} {result['quantization']} kernel={result['kernel']} "
            f"threads={result['threads']}\n"
            f"prefill ({args.prompt_tokens} tokens): {result['prefill_tok_s']:.1f} tok/s\n"
            f"decode: {result['decode_tok_s']:.2f} tok/s\n"
            f"peak RSS: {result['peak_rss_mb']:.0f} MB"
        )
    return 0


def _env_number(name: str, kind: type, default: float | None) -> str | None:
    """The default of a numeric flag from the environment, checked by the flag's own type
    (``None``: no default unless the variable is set)."""
    return os.environ.get(name, None if default is None else str(kind(default)))


def _number(kind: type, low: float, high: float | None = None, above: bool = False):
    """An argparse type: ``kind`` at least ``low`` (more than ``low`` with ``above``), and at
    most ``high`` when given."""

    def parse(text: str):
        value = kind(text)
        if high is not None and not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be {low}..{high}, got {value}")
        if above and not value > low:
            raise argparse.ArgumentTypeError(f"must be more than {low}, got {value}")
        if not above and not value >= low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value

    return parse


_slots = _number(int, 1, 16)
_non_negative_int = _number(int, 0)
_non_negative_float = _number(float, 0)
_positive_float = _number(float, 0, above=True)
_positive_int = _number(int, 1)


def serve_args(sp: argparse.ArgumentParser, model_args) -> None:
    """The flags of `colibri serve`, which `colibri web` shares."""
    model_args(sp)
    sp.add_argument("--host", default="127.0.0.1", help="bind address (default: 127.0.0.1)")
    sp.add_argument("--port", type=int, default=8000, help="port (default: 8000; 0: any free)")
    sp.add_argument("--model-id", help="name clients use for the model ($COLI_MODEL_ID)")
    sp.add_argument(
        "--models-dir",
        metavar="DIR",
        help="also serve every colibri model directory under DIR, each loaded on first use",
    )
    sp.add_argument(
        "--catalog",
        metavar="FILE",
        help="also serve the models a catalog file lists (JSON, or TOML when it ends in .toml; "
        "docs/API.md, 'Model catalog')",
    )
    sp.add_argument("--api-key", help="require this key from clients ($COLI_API_KEY)")
    sp.add_argument(
        "--allowed-host",
        action="append",
        help="extra Host header name to accept, repeatable ($COLI_ALLOWED_HOSTS, comma-separated)",
    )
    sp.add_argument(
        "--cors-origin", action="append", help="extra exact CORS origin, repeatable ('*': any)"
    )
    sp.add_argument(
        "--max-tokens",
        type=_positive_int,
        default=None,
        help="default reply budget for chat requests without max_tokens (default: the context)",
    )
    sp.add_argument(
        "--chat-family",
        choices=sorted(FAMILIES),
        help="override the chat family detected from the model",
    )
    sp.add_argument(
        "--kv-slots",
        type=_slots,
        default=_env_number("COLI_KV_SLOTS", int, 1),
        help="KV slots: generations that run side by side, 1..16 ($COLI_KV_SLOTS, default 1)",
    )
    sp.add_argument(
        "--max-active",
        type=_slots,
        default=_env_number("COLI_MAX_ACTIVE", int, None),
        help="requests that may hold a KV slot at once, stepping together, 1..slots "
        "($COLI_MAX_ACTIVE, default: every slot)",
    )
    sp.add_argument(
        "--max-queue",
        type=_non_negative_int,
        default=_env_number("COLI_MAX_QUEUE", int, 8),
        help="requests that may wait for a slot ($COLI_MAX_QUEUE, default 8; 0: none wait)",
    )
    sp.add_argument(
        "--queue-timeout",
        type=_positive_float,
        default=_env_number("COLI_QUEUE_TIMEOUT", float, 300.0),
        help="seconds a request may wait for a slot ($COLI_QUEUE_TIMEOUT, default 300)",
    )
    sp.add_argument(
        "--models-ram-gb",
        type=_positive_float,
        default=_env_number("COLI_MODELS_RAM_GB", float, None),
        metavar="G",
        help="deprecated: the same as --ram-gb, the one RAM budget ($COLI_MODELS_RAM_GB)",
    )
    sp.add_argument(
        "--ready-timeout",
        type=_positive_float,
        default=_env_number("COLI_READY_TIMEOUT", float, 300.0),
        help="seconds a request that is not streamed waits for its model to load, then 503 + "
        "Retry-After ($COLI_READY_TIMEOUT, default 300)",
    )
    sp.add_argument(
        "--request-timeout",
        type=_non_negative_float,
        default=_env_number("COLI_REQUEST_TIMEOUT", float, None),
        metavar="S",
        help="seconds a request that is not streamed may take from arrival to answer, then 504 "
        "(its generation stopped) ($COLI_REQUEST_TIMEOUT; default: 300 with --catalog or "
        "--models-dir, off with one model; 0: off)",
    )
    sp.add_argument(
        "--kv-dir",
        help="where KV slot files live ($COLI_KV_DIR; default: per model, under the cache dir)",
    )
    sp.add_argument("--no-kv-persist", action="store_true", help="keep KV slots in memory only")
    sp.add_argument(
        "--log-format",
        choices=["text", "json"],
        default="text",
        help="access log lines on stderr: text (key=value, default) or json (one object a line)",
    )
    sp.add_argument("--quiet", action="store_true", help="no access log")
    sp.add_argument(
        "--allow-unauthenticated",
        action="store_true",
        help="allow a non-loopback --host without an API key (trusted networks only)",
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="colibri", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    def model_args(sp: argparse.ArgumentParser) -> None:
        sp.add_argument(
            "--model", help="colibri model directory (default: $COLI_MODEL, else built-in)"
        )
        sp.add_argument(
            "--threads", type=int, default=None, help="worker threads (default: all cores)"
        )
        sp.add_argument(
            "--context",
            type=_positive_int,
            default=_env_number("COLI_CONTEXT", int, None),
            metavar="N",
            help="run with a context of N tokens, at most the model's ($COLI_CONTEXT; "
            "default: the model's)",
        )
        sp.add_argument(
            "--ram-gb",
            type=_positive_float,
            default=_env_number("COLI_RAM_GB", float, None),
            metavar="G",
            help="the RAM budget in GB: every loaded model's resident weights, KV slots and "
            "expert cache together; the expert caches get what is left, and a catalog's models "
            "used longest ago are unloaded to make room (docs/API.md, 'RAM budget') "
            "($COLI_RAM_GB; default: no limit, every expert resident when it fits)",
        )
        sp.add_argument(
            "--pin-gb",
            type=_non_negative_float,
            default=None,
            help="part of each expert cache pinned to the hottest experts ($COLI_PIN_GB)",
        )
        sp.add_argument(
            "--direct-io", action="store_true", help="read experts with O_DIRECT ($COLI_DIRECT_IO)"
        )
        sp.add_argument(
            "--prefetch",
            action="store_true",
            help="load the next layer's likely experts ahead ($COLI_PREFETCH)",
        )

    s = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API and the web dashboard")
    serve_args(s, model_args)
    s.set_defaults(func=cmd_serve, open_browser=False)

    w = sub.add_parser("web", help="serve (as `serve`) and open the web dashboard in a browser")
    serve_args(w, model_args)
    w.add_argument(
        "--no-browser",
        dest="open_browser",
        action="store_false",
        help="only print the dashboard's address (headless hosts)",
    )
    w.set_defaults(func=cmd_serve, open_browser=True)

    g = sub.add_parser("generate", help="print a completion of a prompt")
    model_args(g)
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("convert", help="convert a Hugging Face checkpoint")
    c.add_argument("hf_dir")
    c.add_argument("out_dir")
    c.add_argument("--quant", choices=["int4", "f32"], default="int4")
    c.add_argument(
        "--keep-f32",
        action="append",
        default=[],
        metavar="PATTERN",
        help="keep the resident weight matrices so named at f32 (`lm_head`, `layers.*.v`; `*` "
        "matches anything; repeatable): to measure which tensors the quantization hurts",
    )
    eight = c.add_mutually_exclusive_group()
    eight.add_argument(
        "--q8",
        action="append",
        default=[],
        metavar="PATTERN",
        help="store the resident weight matrices so named at 8 bits (repeatable; replaces the "
        "default, which in an int4 conversion is `layers.*.v` and `layers.*.o`)",
    )
    eight.add_argument(
        "--pure",
        action="store_true",
        help="every resident weight matrix at --quant: no 8-bit matrices by default",
    )
    c.add_argument(
        "--calibration",
        metavar="FILE",
        help="a UTF-8 text: run the f32 model over it and weight each int4 matrix's error per "
        "input column by the mean squared activation there (AWQ/imatrix style; int4 only)",
    )
    c.add_argument(
        "--threads", type=_positive_int, default=None, help="threads of the calibration run"
    )
    c.add_argument(
        "--q4-0-rounding",
        action="store_true",
        help="round int4 groups as llama.cpp's Q4_0 does (max-abs scale) instead of colibri's "
        "error-minimising search: same bytes and speed, larger error; for comparisons",
    )
    c.add_argument(
        "--grid",
        choices=["linear", "table"],
        default="linear",
        help="the int4 levels: `linear` (-8..7) or `table` (16 levels in -16..15, denser near "
        "zero: the same 4.5 bits a weight, a smaller error; int4 only)",
    )
    c.set_defaults(func=cmd_convert)

    u = sub.add_parser(
        "upgrade", help="re-encode a model directory of an older format (lossless) into a new one"
    )
    u.add_argument("old_dir")
    u.add_argument("new_dir")
    u.set_defaults(func=cmd_upgrade)

    # Listed for --help; main() hands its arguments to colibri.demo.eval.
    sub.add_parser("eval-demo", help="accuracy of the demo model on held-out prompts")

    e = sub.add_parser(
        "eval-ppl",
        help="perplexity on a text, and KL divergence from a reference model (llama-perplexity's "
        "method)",
    )
    model_args(e)
    e.add_argument("--text", required=True, help="a UTF-8 text file")
    e.add_argument(
        "--reference", help="a model directory to compare with (the same weights at f32, say)"
    )
    e.add_argument("--ctx", type=_positive_int, default=512, help="chunk length (default 512)")
    e.add_argument("--chunks", type=_positive_int, default=None, help="at most N chunks")
    e.add_argument("--json", action="store_true", help="print one JSON object")
    e.set_defaults(func=cmd_eval_ppl)

    b = sub.add_parser("bench", help="measure prefill and decode speed")
    model_args(b)
    b.add_argument("--prompt-tokens", type=int, default=64)
    b.add_argument("--gen-tokens", type=int, default=32)
    b.add_argument("--repeat", type=int, default=3)
    b.add_argument("--json", action="store_true", help="print one JSON object")
    b.set_defaults(func=cmd_bench)
    return p


def main(argv: list[str] | None = None) -> int:
    # numpy's BLAS threads are never used here, and idle ones still compete with the engine's.
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["eval-demo"]:
        # Its own options (argparse cannot pass "--help" and friends through a subcommand).
        from colibri.demo import eval as demo_eval

        return demo_eval.main(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except UsageError as e:
        print(f"colibri {args.command}: {e}", file=sys.stderr)
        return 2
    except (RuntimeError, ValueError, OSError) as e:
        print(f"colibri: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
