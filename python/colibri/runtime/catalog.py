"""The model catalog: what models a server may serve, under which ids and names, and how a
request's ``model`` label finds one of them.

An entry is a colibri model directory with a stable ``id`` (set in the catalog file, else derived
from the manifest's content hash, so moving the directory keeps it), the model's own name (the
directory's: ``colibri-demo`` for the demo model), aliases, and a readable ``name``. Nothing here
loads an engine: what ``/v1/models`` says of a model that is not loaded comes from its manifest.
"""

from __future__ import annotations

import hashlib
import json
import re
import tomllib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from colibri.chat.families import FAMILIES, detect_family, family_by_name
from colibri.errors import ApiError

TASK_TYPES = ("text-generation", "scoring")
# The fields of one catalog-file entry (anything else is refused, naming it).
_FIELDS = ("id", "name", "path", "aliases", "task_type", "pinned", "chat_family")
_LABEL = re.compile(r"^[^\s\x00-\x1f]{1,256}$")
_TEXT = re.compile(r"^[^\x00-\x1f\x7f]{1,4096}$")


class CatalogError(ValueError):
    """A catalog that cannot be served (a bad file, a duplicate id): refused at startup."""


@dataclass(frozen=True)
class CatalogEntry:
    """One model the server may serve."""

    id: str
    # The model's own name: its directory's (model_id_for), shared by entries of one directory.
    model_name: str
    # The readable name /v1/models shows (the catalog's ``name``, else the model's own name).
    name: str
    path: Path
    aliases: tuple[str, ...] = ()
    task_type: str = "text-generation"
    pinned: bool = False
    chat_family: str | None = None
    # The hash of the manifest's architecture, config and quantization: same model, same id.
    model_config_id: str | None = None
    # The context the manifest declares (max_position_embeddings), None when it declares none.
    configured_context: int | None = None
    # The chat family (from the manifest's template and architecture) has a tool-call parser.
    tool_calling_configured: bool = False
    created: int = 0
    architecture: str | None = None

    def configured_window(self, context: int | None) -> int | None:
        """The window a cold start of this entry asks for: the manifest's, lowered by
        ``--context``; None when the manifest declares none (never invented)."""
        if self.configured_context is None:
            return None
        return min(self.configured_context, context) if context else self.configured_context


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def stable_id(manifest_bytes: bytes) -> str:
    """A UUID-shaped id from the manifest's content hash: the same model, the same id."""
    h = _digest(manifest_bytes)[:32]
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def config_id(manifest: dict[str, Any]) -> str:
    """``model_config_id``: two entries with the same architecture, config and quantization
    share it."""
    keyed = {k: manifest.get(k) for k in ("architecture", "config", "quantization")}
    return "cfg-" + _digest(json.dumps(keyed, sort_keys=True).encode())[:16]


def read_manifest(path: Path) -> tuple[bytes, dict[str, Any]]:
    manifest = path / "manifest.json"
    if not manifest.is_file():
        raise CatalogError(
            f"{path} is not a colibri model directory (no manifest.json; `colibri convert` "
            "makes one from a Hugging Face checkpoint)"
        )
    raw = manifest.read_bytes()
    try:
        data = json.loads(raw)
    except ValueError as e:
        raise CatalogError(f"{manifest} is not valid JSON: {e}") from None
    if not isinstance(data, dict) or data.get("format") != "colibri-model":
        raise CatalogError(f"{manifest} is not a colibri model manifest")
    return raw, data


def make_entry(
    path: Path,
    *,
    id: str | None = None,
    name: str | None = None,
    aliases: Iterable[str] = (),
    task_type: str = "text-generation",
    pinned: bool = False,
    chat_family: str | None = None,
) -> CatalogEntry:
    """The entry of the model directory ``path``; what is not given comes from its manifest."""
    from colibri.demo.builtin import model_id_for

    raw, manifest = read_manifest(path)
    config = manifest.get("config") if isinstance(manifest.get("config"), dict) else {}
    ctx = config.get("max_position_embeddings")
    family = (
        family_by_name(chat_family)
        if chat_family
        else detect_family(str(manifest.get("architecture", "")), manifest.get("chat_template"))
    )
    own = model_id_for(path)
    entry_id = id or stable_id(raw)
    aliases = tuple(dict.fromkeys(a for a in aliases if a != entry_id))
    readable = name or own
    return CatalogEntry(
        id=entry_id,
        model_name=own,
        name=readable,
        path=path,
        aliases=aliases,
        task_type=task_type,
        pinned=pinned,
        chat_family=chat_family,
        model_config_id=config_id(manifest),
        configured_context=ctx if isinstance(ctx, int) and ctx > 0 else None,
        tool_calling_configured=family.tool_format is not None,
        created=int((path / "manifest.json").stat().st_mtime),
        architecture=manifest.get("architecture"),
    )


def scan_models_dir(root: Path) -> list[CatalogEntry]:
    """Every colibri model directory directly under ``root`` (sorted by name), or ``root``
    itself when it is one."""
    if not root.is_dir():
        raise CatalogError(f"--models-dir {root} is not a directory")
    if (root / "manifest.json").is_file():
        return [make_entry(root)]
    found = sorted(p for p in root.iterdir() if (p / "manifest.json").is_file())
    if not found:
        raise CatalogError(f"--models-dir {root} holds no colibri model directory")
    return [make_entry(p) for p in found]


def _catalog_items(path: Path) -> list[Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise CatalogError(f"--catalog {path}: {e.strerror or e}") from None
    try:
        if path.suffix.lower() == ".toml":
            data: Any = tomllib.loads(text)
        else:
            data = json.loads(text)
    except (ValueError, tomllib.TOMLDecodeError) as e:
        raise CatalogError(f"--catalog {path} does not parse: {e}") from None
    if isinstance(data, dict) and set(data) == {"models"}:
        data = data["models"]
    if not isinstance(data, list):
        raise CatalogError(
            f'--catalog {path}: expected a list of models ({{"models": [...]}} or '
            "[[models]] tables in TOML)"
        )
    return data


def _string(where: str, key: str, value: Any) -> str:
    """An id or an alias: what a client sends as ``model`` and a KV directory is named after."""
    if not isinstance(value, str) or not _LABEL.match(value):
        raise CatalogError(f"{where}: '{key}' must be a non-empty string without spaces")
    return value


def _text(where: str, key: str, value: Any) -> str:
    """A readable name or a path: spaces allowed, not at either end; no control characters."""
    if not isinstance(value, str) or not _TEXT.match(value) or value != value.strip():
        raise CatalogError(
            f"{where}: '{key}' must be a non-empty string without control characters or "
            "spaces at either end"
        )
    return value


def read_catalog(path: Path) -> list[CatalogEntry]:
    """The entries of a catalog file (JSON, or TOML when it ends in ``.toml``); a relative
    ``path`` is relative to the file's directory. Every problem is a CatalogError naming the
    entry and the field."""
    entries = []
    for i, item in enumerate(_catalog_items(path)):
        where = f"--catalog {path}: model {i}"
        if not isinstance(item, dict):
            raise CatalogError(f"{where} is not an object")
        unknown = sorted(set(item) - set(_FIELDS))
        if unknown:
            raise CatalogError(
                f"{where}: unknown field(s) {', '.join(unknown)} (known: {', '.join(_FIELDS)})"
            )
        if "path" not in item:
            raise CatalogError(f"{where}: 'path' (the model directory) is required")
        model_path = Path(_text(where, "path", item["path"])).expanduser()
        if not model_path.is_absolute():
            model_path = path.parent / model_path
        aliases = item.get("aliases", [])
        if not isinstance(aliases, list):
            raise CatalogError(f"{where}: 'aliases' must be a list of strings")
        task_type = item.get("task_type", "text-generation")
        if task_type not in TASK_TYPES:
            raise CatalogError(f"{where}: 'task_type' must be one of {', '.join(TASK_TYPES)}")
        pinned = item.get("pinned", False)
        if not isinstance(pinned, bool):
            raise CatalogError(f"{where}: 'pinned' must be true or false")
        family = item.get("chat_family")
        if family is not None and family not in FAMILIES:
            raise CatalogError(
                f"{where}: 'chat_family' must be one of {', '.join(sorted(FAMILIES))}"
            )
        entry_id = _string(where, "id", item["id"]) if "id" in item else None
        name = _text(where, "name", item["name"]) if "name" in item else None
        labels = [_string(where, "aliases", a) for a in aliases]
        try:
            entries.append(
                make_entry(
                    model_path,
                    id=entry_id,
                    name=name,
                    aliases=labels,
                    task_type=task_type,
                    pinned=pinned,
                    chat_family=family,
                )
            )
        except CatalogError as e:
            raise CatalogError(f"{where}: {e}") from None
    return entries


def merge(
    explicit: Iterable[CatalogEntry], scanned: Iterable[CatalogEntry] = ()
) -> list[CatalogEntry]:
    """The explicit entries (the default model, the catalog file's), then the ones a
    --models-dir scan found, minus a scanned directory an earlier entry already serves (a
    --models-dir holding the default model). Two entries under one id are refused."""
    out: list[CatalogEntry] = []
    by_id: dict[str, CatalogEntry] = {}
    paths: set[Path] = set()
    for entry, was_scanned in [*((e, False) for e in explicit), *((e, True) for e in scanned)]:
        if was_scanned and entry.path.resolve() in paths:
            continue
        seen = by_id.get(entry.id)
        if seen is not None:
            raise CatalogError(
                f"two catalog entries have the id '{entry.id}' ({seen.path} and "
                f"{entry.path}); give one of them an 'id' of its own in the catalog file"
            )
        by_id[entry.id] = entry
        paths.add(entry.path.resolve())
        out.append(entry)
    return out


def dir_name(entry_id: str) -> str:
    """``entry_id`` as one directory name (its KV directory): kept when it is plain and at most
    64 characters, else its first plain characters and its whole SHA-256. Two ids never share a
    directory: a kept id is at most 64 characters and a digested name always longer (so an id
    spelled like another's digested name keeps a directory of its own), and two digested names
    differ by their digests."""
    plain = re.sub(r"[^A-Za-z0-9._-]", "_", entry_id).strip(".") or "_"
    if plain == entry_id and len(plain) <= 64:
        return plain
    return f"{plain[:32]}-{_digest(entry_id.encode())}"


def _candidates(entries: Sequence[CatalogEntry]) -> str:
    return ", ".join(f"'{e.id}'" for e in entries)


# The resolution order: the id, the model's own name, an alias, the readable name.
_ORDER: tuple[Callable[[CatalogEntry], Iterable[str]], ...] = (
    lambda e: (e.id,),
    lambda e: (e.model_name,),
    lambda e: e.aliases,
    lambda e: (e.name,),
)


def resolve(entries: Sequence[CatalogEntry], label: str) -> CatalogEntry:
    """The entry ``label`` names: the first step of the order with any match decides; one
    match is the answer, several are 409 ``ambiguous_model`` naming their ids, none at any step
    is 404 ``model_not_found``."""
    for names_of in _ORDER:
        matches = [e for e in entries if label in names_of(e)]
        if len(matches) == 1:
            return matches[0]
        if matches:
            raise ApiError(
                409,
                f"The model '{label}' is ambiguous: it names {len(matches)} models, "
                f"{_candidates(matches)}; use one of these ids",
                code="ambiguous_model",
                param="model",
            )
    served = _candidates(entries[:8]) + (", ..." if len(entries) > 8 else "")
    raise ApiError(
        404,
        f"The model '{label}' does not exist: this server serves {served} "
        "(GET /v1/models lists them)",
        code="model_not_found",
        param="model",
    )
