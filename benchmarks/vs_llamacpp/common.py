"""What every step of the benchmark uses: its directories, log lines, and running a command
(echoed, optionally niced and logged to a file)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]  # benchmarks/
REPO = HERE.parent
NICE = ["nice", "-n", "10"]  # heavy setup steps yield to other work; measurements do not


def log(msg: str) -> None:
    print(msg, flush=True)


def run(
    cmd: list, *, nice: bool = False, log_file: Path | None = None, **kw
) -> subprocess.CompletedProcess:
    cmd = [str(c) for c in cmd]
    if nice and shutil.which("nice"):
        cmd = NICE + cmd
    log("  $ " + " ".join(cmd) + (f"  > {log_file}" if log_file else ""))
    if log_file:
        with open(log_file, "w") as f:
            r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, **kw)
        if r.returncode != 0:
            tail = log_file.read_text(errors="replace").splitlines()[-30:]
            raise SystemExit(
                f"command failed ({r.returncode}): {' '.join(cmd)}\n--- {log_file} (tail)\n"
                + "\n".join(tail)
            )
        return r
    return subprocess.run(cmd, check=True, **kw)
