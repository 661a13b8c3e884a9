"""The model a server serves: engine, names, chat family and template, limits."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from colibri.chat.families import Family, detect_family, family_by_name
from colibri.chat.template import ChatTemplate, sorts_tool_keys, special_tokens_of
from colibri.errors import ApiError
from colibri.observability import (
    AccessRecord,
    Metrics,
    MetricsHub,
    RequestObserver,
    make_tracer,
)
from colibri.runtime.engine import Engine
from colibri.runtime.generation import Generator
from colibri.runtime.scheduler import Lease, Scheduler


@dataclass(frozen=True)
class ServerConfig:
    """What `colibri serve` was told (docs/API.md lists the flags and environment variables)."""

    model_id: str
    aliases: tuple[str, ...] = ()
    api_key: str | None = None
    allowed_hosts: tuple[str, ...] = ()
    cors_origins: tuple[str, ...] = ()
    # Default completion budget for chat requests that give none (None: what the context holds).
    max_tokens: int | None = None
    continue_assistant: bool = True
    chat_family: str | None = None
    kv_slots: int = 1
    # Requests that may hold a slot at once (None: every slot); the active ones step together.
    max_active: int | None = None
    max_queue: int = 8
    queue_timeout: float = 300.0
    # The access log (api/access_log.py): on unless --quiet; "text" or "json" lines.
    access_log: bool = True
    log_format: str = "text"


class ServedModel:
    def __init__(
        self,
        engine: Engine,
        config: ServerConfig,
        created: int,
        span_exporter: object = None,
        hub: MetricsHub | None = None,
    ) -> None:
        """``hub``: the server's metrics, which every model of a catalog shares (each under
        its ``model`` label); None: a registry of this model's own."""
        self.engine = engine
        self.config = config
        self.id = config.model_id
        self.created = created
        self.context_length = int(engine.info["context_length"])
        source = engine.info.get("chat_template")
        self.family: Family = (
            family_by_name(config.chat_family)
            if config.chat_family
            else detect_family(engine.info["architecture"], source)
        )
        # Where the template comes from: the checkpoint's, else the family's built-in one (for
        # vendors that publish the chat format as code), else none (chat requests refused).
        self.template_origin = "model" if source else None
        if not source:
            source = self.family.builtin_template_source()
            self.template_origin = "builtin" if source else None
        self.template = (
            ChatTemplate(
                source,
                special_tokens_of(engine.tokenizer_config),
                sort_tool_keys=sorts_tool_keys(engine.tokenizer_config),
            )
            if source
            else None
        )
        self.scheduler = Scheduler(
            config.kv_slots,
            config.max_queue,
            config.queue_timeout,
            on_release=self._released,
            max_active=config.max_active,
        )
        self.metrics = (
            Metrics(self.scheduler, self.id, store_stats=engine.store_stats)
            if hub is None
            else hub.attach(self.id, self.scheduler, engine.store_stats)
        )
        self.generator = Generator(engine, on_batch=self.metrics.batch_size.observe)
        self.metrics.kv_bytes_per_token.set(float(engine.info.get("kv_bytes_per_token", 0)))
        self.metrics.state_bytes_per_slot.set(float(engine.info.get("state_bytes_per_slot", 0)))
        self.tracer = make_tracer(span_exporter)

    def _released(self, lease: Lease, outcome: str, held_s: float) -> None:
        self.metrics.slot_duration.observe(held_s)

    def observe(
        self,
        name: str,
        request_id: str | None,
        headers: Mapping[str, str] | None,
        record: AccessRecord | None,
    ) -> RequestObserver:
        """A request's observer; ``record``: its access-log record (api/access_log.py
        ``record_of``; none when the access log is off)."""
        return RequestObserver(
            self.tracer, self.metrics, name, self.id, request_id, headers, record
        )

    def budget(self, prompt_tokens: int, requested: int | None, param: str) -> tuple[int, bool]:
        """The completion budget: ``requested`` clamped to what the context still holds.

        A prompt that leaves no room at all is refused; otherwise the ceiling is lowered and the
        reply ends with ``finish_reason: "length"`` if it reaches it.
        """
        room = self.context_length - prompt_tokens
        if room < 1:
            raise ApiError(
                400,
                f"This model's maximum context length is {self.context_length} tokens. However, "
                f"your {param} resulted in {prompt_tokens} tokens, which leaves no room for a "
                "reply. Shorten the input.",
                code="context_length_exceeded",
                param=param,
            )
        if requested is None or requested > room:
            return room, requested is not None
        return requested, False
