"""How long a model takes to load: measured at each load, kept beside its KV slot files
(``load-times.json``), so a cold start can say how long it will take (``Retry-After``)."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

log = logging.getLogger("colibri.server")

FILE = "load-times.json"
KEPT = 8
# A load never measured: its size read at this speed (a cautious disk), at least a second.
ASSUMED_BYTES_PER_S = 200e6


class LoadTimes:
    """The last few load durations of one model; ``directory`` None: kept in memory only."""

    def __init__(self, directory: Path | None) -> None:
        self.path = directory / FILE if directory is not None else None
        self.seconds: list[float] = []
        if self.path is not None and self.path.is_file():
            try:
                data = json.loads(self.path.read_text())
                self.seconds = [float(s) for s in data["seconds"] if float(s) >= 0][-KEPT:]
            except (ValueError, KeyError, TypeError):
                log.warning("ignoring %s: not a list of load times", self.path)

    def predict(self, model_dir: Path) -> float:
        """The next load's duration: the last measured, else the model's files at a cautious
        disk speed."""
        if self.seconds:
            return self.seconds[-1]
        size = sum(
            (model_dir / name).stat().st_size
            for name in ("resident.bin", "experts.bin")
            if (model_dir / name).is_file()
        )
        return max(1.0, size / ASSUMED_BYTES_PER_S)

    def worst(self) -> float | None:
        return max(self.seconds) if self.seconds else None

    def record(self, seconds: float) -> None:
        self.seconds = [*self.seconds, seconds][-KEPT:]
        if self.path is None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps({"seconds": self.seconds}))
            os.replace(tmp, self.path)
        except OSError as e:
            log.warning("could not keep the load time in %s: %s", self.path, e)
