"""The Python face of the Rust engine: a loaded model plus its Hugging Face tokenizer."""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import sys
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Encoding, Tokenizer

from colibri import _engine
from colibri.runtime import long_texts

log = logging.getLogger("colibri.engine")


class Engine:
    """A converted colibri model, loaded once.

    ``threads`` defaults to every core; ``kernel`` forces a compute path (``"scalar"``,
    ``"avx2"``, ``"avx512"``), otherwise the best one this CPU has (or ``COLI_KERNEL``) is used.
    ``slots`` KV slots keep their history between generations; with ``kv_dir`` each slot is
    persisted to ``kv_dir/slot-N.kv`` and restored at the next load (a file from another model
    or layout is refused with a log line and replaced), and the routing heat is kept there too
    (``routing-heat.json``; one an older version left in the model directory is read while
    ``kv_dir`` has none; without ``kv_dir`` the heat is counted in memory only). ``ram_gb``
    bounds the RAM for routed experts (an expert cache over the experts file; default
    ``COLI_RAM_GB``, else every expert resident), ``pin_gb`` of it holds the hottest experts
    for the whole run (``COLI_PIN_GB``),
    ``direct_io`` reads with O_DIRECT (``COLI_DIRECT_IO``), ``prefetch`` loads the next layer's
    likely experts ahead (``COLI_PREFETCH``). Results never depend on these. ``context`` runs
    the model with a context of that many tokens (prompt and reply), 1 up to the model's own
    (``max_position_embeddings``, the default): generation stops there, ``logits`` refuses more,
    KV memory is bounded by it, and a persisted slot holding that many tokens or more starts
    empty; anything else raises ``ValueError`` naming both numbers. ``info["context_length"]``
    is the context in use, ``info["model_context_length"]`` the model's own.
    Generation and scoring release the GIL, so other Python threads keep running.
    """

    def __init__(
        self,
        path: str | Path,
        threads: int | None = None,
        kernel: str | None = None,
        slots: int = 1,
        kv_dir: str | Path | None = None,
        ram_gb: float | None = None,
        pin_gb: float | None = None,
        direct_io: bool | None = None,
        prefetch: bool | None = None,
        context: int | None = None,
    ) -> None:
        self.path = Path(path)
        self._model = _engine.Model(
            str(self.path),
            threads,
            kernel,
            slots,
            None if kv_dir is None else str(kv_dir),
            ram_gb,
            pin_gb,
            direct_io,
            prefetch,
            context,
        )
        for note in self._model.load_notes():
            log.warning("KV slot file refused: %s", note)
        info = dict(self._model.info())
        tok_path = self.path / info["tokenizer"]
        try:
            self._tokenizer = Tokenizer.from_file(str(tok_path))
        except Exception as e:  # tokenizers raises a bare Exception
            raise RuntimeError(f"{tok_path}: cannot load the tokenizer: {e}") from e
        self._literal_tokenizer: Tokenizer | None = None
        self.tokenizer_config: dict[str, Any] = {}
        if info.get("tokenizer_config"):
            cfg_path = self.path / info["tokenizer_config"]
            self.tokenizer_config = json.loads(cfg_path.read_text(encoding="utf-8"))
        self._cuts_long_texts = long_texts.cuts_long_texts(self.tokenizer_config)
        self.info: dict[str, Any] = info

    @property
    def eos_token_ids(self) -> list[int]:
        """Token ids that end a reply: the config's ``eos_token_id`` plus the tokenizer's EOS."""
        ids = list(self.info["eos_token_ids"])
        eos = self.tokenizer_config.get("eos_token")
        if isinstance(eos, dict):
            eos = eos.get("content")
        if isinstance(eos, str):
            tid = self._tokenizer.token_to_id(eos)
            if tid is not None and tid not in ids:
                ids.append(tid)
        return ids

    def tokenize(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text`` (special-token strings in it are recognised as such); a long
        text cut first where the checkpoint's tokenizer cuts it (``runtime.long_texts``)."""
        if self._cuts_long_texts and long_texts.needs_cuts(text):
            whole = self._tokenizer.encode(text, add_special_tokens=False)
            enc = self._encode_in_pieces(self._tokenizer, text, whole)
            if add_special_tokens:
                enc = self._tokenizer.post_process(enc, add_special_tokens=True)
            return list(enc.ids)
        return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def tokenize_literal(self, text: str) -> list[int]:
        """Token ids of ``text`` read as plain text: special-token strings in it are split into
        ordinary tokens (for what users and tools wrote, see ``colibri.chat.literal``)."""
        if self._literal_tokenizer is None:
            # A second instance: the switch is per tokenizer, and the shared one must keep
            # recognising special tokens for concurrent requests.
            literal = Tokenizer.from_str(self._tokenizer.to_str())
            literal.encode_special_tokens = True
            self._literal_tokenizer = literal
        if self._cuts_long_texts and long_texts.needs_cuts(text):
            return list(self._encode_in_pieces(self._literal_tokenizer, text, None).ids)
        return list(self._literal_tokenizer.encode(text, add_special_tokens=False).ids)

    def _encode_in_pieces(self, tok: Tokenizer, text: str, whole: Encoding | None) -> Encoding:
        """``text`` encoded piece by piece (``long_texts.pieces``) within each segment between
        the special tokens ``whole`` (its encoding in one piece) found; None: one segment."""
        parts: list[Encoding] = []
        start = 0
        marks = [] if whole is None else zip(whole.ids, whole.offsets, strict=True)
        for tid, (a, b) in marks:
            if tid in self._special_ids:
                segment = long_texts.pieces(text[start:a])
                parts += tok.encode_batch(segment, add_special_tokens=False)
                parts.append(tok.encode(text[a:b], add_special_tokens=False))
                start = b
        parts += tok.encode_batch(long_texts.pieces(text[start:]), add_special_tokens=False)
        return Encoding.merge(parts, growing_offsets=True)

    @functools.cached_property
    def _special_ids(self) -> frozenset[int]:
        added = self._tokenizer.get_added_tokens_decoder().items()
        return frozenset(i for i, t in added if t.special)

    @functools.cached_property
    def special_tokens(self) -> tuple[str, ...]:
        """The strings the tokenizer reads as special tokens (turn markers and the like)."""
        added = self._tokenizer.get_added_tokens_decoder().values()
        return tuple(sorted({t.content for t in added if t.special and t.content}))

    def token_id(self, token: str) -> int | None:
        """The id of a token's exact text (e.g. a special marker), or None if it is not one."""
        return self._tokenizer.token_to_id(token)

    def detokenize(self, ids: Iterable[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=False)

    def logits(self, ids: list[int]) -> np.ndarray:
        """Logits ``[len(ids), vocab]`` (float32) of a full forward pass from an empty context."""
        if not ids:
            raise ValueError("logits() needs at least one token")
        raw = self._model.logits(list(ids))
        return np.frombuffer(raw, dtype="<f4").reshape(len(ids), self.info["vocab_size"])

    def generate(
        self,
        ids: list[int],
        max_tokens: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        stop_token_ids: Iterable[int] = (),
        seed: int | None = None,
        slot: int | None = None,
        grammar: Grammar | None = None,
    ) -> _Tokens:
        """Yields generated token ids one at a time (a stop token is yielded, then it ends).

        Each token is computed with the GIL released. Closing the iterator (or dropping it)
        stops the computation: no token is computed ahead of the one asked for. With ``slot``,
        the prompt is matched against that KV slot's history and only the rest is prefilled
        (``reused_tokens`` says how much was reused); without, the history is private. With
        ``grammar``, every token is one the grammar allows (the stop tokens and
        ``grammar.end_ids`` only where it accepts); a grammar that completes ends the
        generation, and ``grammar_state`` says whether it was completed.
        """
        stream = self._model.generate(
            list(ids),
            int(max_tokens),
            float(temperature),
            float(top_p),
            list(stop_token_ids),
            seed,
            slot,
            None if grammar is None else (grammar.kind, grammar.source),
            [] if grammar is None else list(grammar.trigger),
            [] if grammar is None else list(grammar.end_ids),
        )
        return _Tokens(stream)

    def score(
        self, context: list[int], options: list[list[int]], slot: int | None = None
    ) -> _Scoring:
        """The log-probabilities of each option (token ids) after ``context``, nothing
        generated: step the returned object until it ends, then read its ``scores``.

        With ``slot``, the context is matched against that KV slot's history and only the rest
        is prefilled; the slot keeps the context afterwards (the options are run after it and
        dropped), so a later scoring that shares its start reuses it. Without, the history is
        private.
        """
        return _Scoring(self._model.score(list(context), [list(o) for o in options], slot))

    def step_many(self, streams: list[_Tokens]) -> list[int | tuple[int, int] | None | Exception]:
        """One step of every generation in ``streams`` together, with the GIL released: one
        forward pass runs each one's next tokens over its own KV slot, reading every weight once
        for all of them (each gets exactly the tokens it gets stepped alone). Returns each
        stream's ``step()`` result, or the exception its step raised (one stream's bad input
        fails it alone). A closed stream's result is None. Streams must be in different slots.
        """
        open_ = [t for t in streams if not t._closed]
        raw = self._model.step_many([t._stream for t in open_]) if open_ else []
        by_stream: dict[int, Any] = {}
        for t, r in zip(open_, raw, strict=True):
            if t.reused_tokens is None:
                t.reused_tokens = t._stream.reused_tokens
            by_stream[id(t)] = r
        return [by_stream.get(id(t)) for t in streams]

    def score_many(
        self, questions: list[tuple[list[int], list[list[int]]]], slot: int | None = None
    ) -> _Scoring:
        """Several questions, each ``(context, options)``, in one scoring: the start their
        contexts share (a state asked several questions) is prefilled once, the rest of every
        context runs in one batched pass, the options of several tokens in rounds. ``scores``
        lists every question's options in order, each exactly as :meth:`score` gives it. With
        ``slot``, the slot keeps the first question's context."""
        return _Scoring(
            self._model.score_many(
                [(list(c), [list(o) for o in opts]) for c, opts in questions], slot
            )
        )

    def check_grammar(self, kind: str, source: str) -> None:
        """Compiles a grammar (``json_schema``, ``lark`` or ``regex``) against the model's
        tokenizer; ``ValueError`` with llguidance's message when it is refused."""
        self._model.check_grammar(kind, source)

    def last_profile(self) -> dict[str, Any]:
        """The last finished generation's profile: ``io_wait_s``, ``expert_matmul_s``,
        ``attention_s``, ``lm_head_s``, ``other_s``, ``bytes_read``, ``cache_hit_rate``,
        ``prefill_tok_s``, ``decode_tok_s`` and more (docs/API.md)."""
        return dict(json.loads(self._model.last_profile_json()))

    def profiles(self) -> list[dict[str, Any]]:
        """The last 30 generations' profiles, oldest first."""
        return list(json.loads(self._model.profiles_json()))

    def last_routed_experts(self) -> list[list[int]]:
        """Per layer, the expert ids routed to in the last generation."""
        return [list(x) for x in self._model.last_routed_experts()]

    def routing_heat(self) -> dict[str, Any]:
        """Routing counts per (MoE layer, expert): ``{"experts", "layers": [{"layer",
        "counts"}]}``, kept in ``routing-heat.json`` beside the slot files of ``kv_dir`` (in
        memory only without one)."""
        return dict(json.loads(self._model.routing_heat_json()))

    def expert_tiers(self) -> dict[int, str]:
        """Where each routed expert is now, per MoE layer (model layer index): one letter per
        expert, ``r`` resident (no expert cache: every expert in RAM), ``p`` pinned (the
        hottest, held for the whole run), ``c`` in the RAM cache, ``d`` on disk."""
        return {int(layer): str(tiers) for layer, tiers in self._model.expert_tiers()}

    def store_stats(self) -> dict[str, Any] | None:
        """The expert cache's counters, or None when every expert is resident."""
        return json.loads(self._model.store_stats_json())

    @property
    def slots(self) -> int:
        return int(self._model.slot_count())

    def slot_info(self, slot: int) -> dict[str, Any]:
        """``cached_tokens`` (the slot's history length), ``tokens``, ``persistent`` and
        ``store_error`` (why persisting stopped, if it did)."""
        return dict(self._model.slot_info(slot))


@dataclass(frozen=True)
class Grammar:
    """A constraint on a generation's output, as llguidance reads it: ``kind`` is
    ``json_schema``, ``lark`` or ``regex``; it applies once the output ends with the ``trigger``
    token ids (empty: from the first token); ``end_ids`` (with the stop tokens) end the output
    where the grammar accepts."""

    kind: str
    source: str
    trigger: tuple[int, ...] = ()
    end_ids: tuple[int, ...] = ()


class _Stepped:
    """A Rust stream stepped from Python: a part of a prompt's prefill, or one result, per
    ``step()``; ``close()`` ends it for good (and ends the slot's turn: a persistent slot is
    synced to disk)."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self._closed = False
        self.reused_tokens: int | None = None

    def step(self) -> int | tuple[int, int] | None:
        """One step: ``(done, total)`` prompt tokens once a part of the prefill is computed (a
        long prompt prefills in steps of about half a second, so the caller can report progress
        and stop between them); an int result; None once it has ended."""
        if self._closed:
            return None
        step = self._stream.step()
        if self.reused_tokens is None:
            self.reused_tokens = self._stream.reused_tokens
        if step is None or isinstance(step, tuple):
            return step
        return int(step)

    def close(self) -> None:
        if not self._closed:
            self._stream.close()
        self._closed = True


class _Tokens(_Stepped, Iterator[int]):
    """A generation's tokens (``step()`` results are token ids)."""

    def __next__(self) -> int:
        if self._closed:
            raise StopIteration
        tok = next(self._stream)
        if self.reused_tokens is None:
            self.reused_tokens = self._stream.reused_tokens
        return int(tok)

    @property
    def grammar_state(self) -> str | None:
        """None without a grammar; else ``pending`` (before its trigger), ``active``,
        ``satisfied`` (completed) or ``incomplete`` (ended before it was complete). Readable
        after ``close()`` too."""
        return self._stream.grammar_state

    def mask_stats(self) -> dict[str, Any] | None:
        """The grammar's timings: ``masks``, ``compute_s``, ``wait_s``, ``consume_s`` (None
        without one)."""
        stats = self._stream.mask_stats()
        return None if stats is None else dict(stats)


class _Scoring(_Stepped):
    """A scoring in progress on the engine (see :meth:`Engine.score`); ``step()`` results are
    the index of the last option scored so far (a step may score several)."""

    @property
    def context_tokens(self) -> int:
        """Context tokens the scoring runs: the start its questions share once, then each
        question's rest."""
        return int(self._stream.context_tokens)

    @property
    def scores(self) -> list[tuple[float, int]]:
        """``(logprob, tokens)`` per option scored so far: the natural-log probability of the
        option's tokens after the context, and how many tokens it has."""
        return [(float(lp), int(n)) for lp, n in self._stream.scores]

    def run(self) -> list[tuple[float, int]]:
        """Every step at once (on the calling thread); the scores."""
        while self.step() is not None:
            pass
        return self.scores


#: Tokens per forward pass of a calibration run (llama.cpp's imatrix default), or the model's
#: context when shorter.
CALIBRATION_CTX = 512


def check_tiktoken_tokenizer(hf_dir: Path) -> None:
    """For a checkpoint that ships ``tiktoken.model`` instead of tokenizer.json (Kimi's): the
    tokenizer.json the conversion writes for it must load in ``tokenizers`` (its split pattern
    comes from the checkpoint's tokenizer module, in the regex dialect of tiktoken, which the
    gateway's regex engine must accept). Checked before the long part of a conversion;
    ``ValueError`` if not. Nothing to check for other checkpoints."""
    if (hf_dir / "tokenizer.json").is_file() or not (hf_dir / "tiktoken.model").is_file():
        return
    try:
        raw = (hf_dir / "config.json").read_text(encoding="utf-8")
        vocab = int(json.loads(_engine.text_model_config(raw))["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return  # the converter names what is wrong with config.json
    text = _engine.tiktoken_tokenizer(str(hf_dir), vocab)
    try:
        Tokenizer.from_str(text)
    except Exception as e:  # tokenizers raises a bare Exception
        raise ValueError(
            f"{hf_dir}: the tokenizer made from tiktoken.model does not load: {e}"
        ) from e


def convert(
    hf_dir: str | Path,
    out_dir: str | Path,
    quant: str = "int4",
    progress: bool = False,
    keep_f32: Iterable[str] = (),
    q8: Iterable[str] | None = None,
    calibration: str | Path | None = None,
    threads: int | None = None,
    q4_0_rounding: bool = False,
    grid: str = "linear",
) -> dict:
    """Converts a Hugging Face checkpoint directory to a colibri model directory; resident
    weight matrices whose names match a ``keep_f32`` pattern (``*`` = any run of characters)
    stay f32, those matching a ``q8`` pattern are stored at 8 bits. ``q8=None`` is the default:
    attention ``v`` and ``o`` at 8 bits in an int4 conversion; ``q8=()`` stores every resident
    matrix at ``quant`` (``colibri convert --pure``).

    ``calibration``: a UTF-8 text file. The checkpoint is first converted to f32 (in a
    temporary directory beside ``out_dir``, removed after), that model runs over the text in
    chunks of :data:`CALIBRATION_CTX` tokens on ``threads`` threads, recording each weight
    matrix's mean squared input per column (routed experts: of the tokens routed to them), and
    the int4 quantization minimises the squared error weighted by those statistics (AWQ /
    imatrix style). The manifest records the text's SHA-256 and token count; the summary has
    them under ``"calibration"``. A missing, empty or non-UTF-8 file raises ``ValueError``
    before anything is written.

    ``q4_0_rounding``: every int4 group rounded to nearest under llama.cpp Q4_0's max-abs scale
    instead of the error-minimising search (same layout, bytes and kernels; a larger error): to
    measure the search against Q4_0 on colibri's own engine. Not with ``calibration``.

    ``grid``: ``"linear"`` (dtype ``q4``: codes ``q - 8``) or ``"table"`` (dtype ``q4t``: 16
    levels in -16..15, denser near zero; the same bytes per weight, a smaller error; MLA's
    ``kv_b`` halves stay linear). int4 only; not with ``q4_0_rounding``."""
    if q4_0_rounding and (quant != "int4" or calibration is not None):
        raise ValueError("Q4_0 rounding applies to a plain int4 conversion (no calibration)")
    if grid not in ("linear", "table"):
        raise ValueError(f"unknown grid {grid!r} (linear, table)")
    if grid == "table" and (quant != "int4" or q4_0_rounding):
        raise ValueError("the table grid applies to an int4 conversion without Q4_0 rounding")
    check_tiktoken_tokenizer(Path(hf_dir))
    importance, record = None, None
    if calibration is not None:
        if quant != "int4":
            raise ValueError(
                f"a calibration weights the int4 quantization; a {quant} conversion has none"
            )
        raw = read_calibration(calibration)
        importance, ctx = _collect_importance(
            Path(hf_dir), Path(out_dir), raw.decode("utf-8"), progress, threads
        )
        record = {"sha256": hashlib.sha256(raw).hexdigest(), "tokens": importance.tokens}
        record["ctx"] = ctx
    summary = dict(
        _engine.convert_checkpoint(
            str(hf_dir),
            str(out_dir),
            quant,
            progress,
            list(keep_f32),
            None if q8 is None else list(q8),
            importance,
            record["sha256"] if record else "",
            record["ctx"] if record else 0,
            q4_0_rounding,
            grid,
        )
    )
    if record:
        summary["calibration"] = record
    return summary


def read_calibration(path: str | Path) -> bytes:
    """The bytes of a calibration text file: ``ValueError`` naming the file when it is missing,
    unreadable, empty (or only whitespace) or not UTF-8."""
    p = Path(path)
    try:
        raw = p.read_bytes()
    except FileNotFoundError:
        raise ValueError(f"calibration file {p} not found") from None
    except OSError as e:
        raise ValueError(f"calibration file {p}: {e.strerror or e}") from None
    if not raw.strip():
        raise ValueError(f"calibration file {p} is empty: give it text like the model's use")
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(
            f"calibration file {p} is not UTF-8 text (byte {e.start}: {e.reason})"
        ) from None
    return raw


def _collect_importance(
    hf_dir: Path, out_dir: Path, text: str, progress: bool, threads: int | None
) -> tuple[Any, int]:
    """The checkpoint's importance statistics on ``text`` (see :func:`convert`) and the chunk
    length used."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(
        prefix=f".{out_dir.name}.calibration-f32-", dir=out_dir.parent
    ) as tmp:
        _engine.convert_checkpoint(str(hf_dir), tmp, "f32", progress, [], None)
        engine = Engine(tmp, threads=threads)
        ids = engine.tokenize(text, add_special_tokens=True)
        ctx = min(CALIBRATION_CTX, int(engine.info["context_length"]))
        chunks = [ids[i : i + ctx] for i in range(0, len(ids), ctx)]
        if progress:
            print(f"calibrating on {len(ids)} tokens ({len(chunks)} chunks)", file=sys.stderr)
        importance = engine._model.collect_importance(chunks)
        del engine  # its maps of the temporary files go before the directory does
    return importance, ctx


def upgrade(src: str | Path, dst: str | Path, progress: bool = False) -> dict:
    """Re-encodes a format-v2 colibri model directory as the current format into the new
    directory ``dst``, losslessly (the same weights; no checkpoint needed)."""
    return dict(_engine.upgrade_model(str(src), str(dst), progress))
