"""`colibri serve`: load the model once, then serve the HTTP APIs with hypercorn."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys

from colibri.api.security import is_loopback_host


class StartupRefused(RuntimeError):
    """A configuration that must not start (said before anything is loaded)."""


def env_list(name: str) -> list[str]:
    return [v.strip() for v in os.environ.get(name, "").split(",") if v.strip()]


def check_bind(host: str, api_key: str | None, allow_unauthenticated: bool) -> None:
    if not is_loopback_host(host) and not api_key and not allow_unauthenticated:
        raise StartupRefused(
            f"refusing to listen on {host} without an API key: anyone who can reach this "
            "machine could use it. Set COLI_API_KEY (or --api-key), or pass "
            "--allow-unauthenticated if the network is trusted"
        )


def available_memory_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (None where there is no such file)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def check_kv_memory(slots: int, context: int, bytes_per_token: int, state_bytes: int = 0) -> None:
    """Refuses a slot count whose KV, at full context, would not fit the available memory
    (with `state_bytes` per slot of fixed-size state, its snapshots included)."""
    need = slots * (context * bytes_per_token + state_bytes)
    have = available_memory_bytes()
    if have is not None and need > have:
        fit = max(0, have // max(1, context * bytes_per_token + state_bytes))
        raise StartupRefused(
            f"--kv-slots {slots} needs up to {need / 2**30:.1f} GiB of KV memory "
            f"({context} tokens x {bytes_per_token} bytes per token per slot) but only "
            f"{have / 2**30:.1f} GiB is available; use --kv-slots {fit} or fewer"
        )


def open_socket(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the server starts so port 0 gets a real port."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(addr)
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def display_url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def browser_url(sock: socket.socket) -> str:
    """The address a browser on this machine uses: a wildcard bind (``0.0.0.0``, ``::``) is
    reached through loopback, which the Host check allows (a Host of ``0.0.0.0`` it refuses)."""
    host, port = sock.getsockname()[:2]
    if host in ("0.0.0.0", "::"):
        host = "127.0.0.1" if host == "0.0.0.0" else "::1"
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def open_browser(url: str) -> None:
    """Opens ``url`` in the user's browser (``$BROWSER`` or the desktop's), from a thread: a
    terminal browser may hold on to its caller, and the server must start meanwhile. The socket
    is listening already, so the page's first request waits for the server, not refused."""
    import threading
    import webbrowser

    def go() -> None:
        if not webbrowser.open(url):
            print(f"colibri: no browser could be opened; visit {url}", file=sys.stderr, flush=True)

    threading.Thread(target=go, name="open-browser", daemon=True).start()


def run(
    app, sock: socket.socket, model_id: str, on_stop=None, dashboard: str | None = None
) -> None:
    """Serves ``app`` on ``sock`` until SIGINT or SIGTERM. ``on_stop`` runs as soon as the
    signal arrives, before connections are drained (queued requests get a clear refusal).
    ``dashboard``: the web dashboard's address, printed after the ready line."""
    from hypercorn.asyncio import serve
    from hypercorn.config import Config

    config = Config()
    config.bind = [f"fd://{sock.fileno()}"]
    config.accesslog = None
    config.errorlog = "-"
    # Running generations get this long to finish after SIGTERM (waiters are refused at once).
    config.graceful_timeout = 10.0

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        url = display_url(sock)
        print(f"colibri: serving {model_id} on {url} (OpenAI API at {url}/v1)", flush=True)
        if dashboard is not None:
            print(f"colibri: web dashboard at {dashboard}", flush=True)

        async def stopping() -> None:
            await stop.wait()
            if on_stop is not None:
                on_stop()

        await serve(app, config, shutdown_trigger=stopping)

    asyncio.run(main())
    print("colibri: stopped", file=sys.stderr, flush=True)
