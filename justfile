# colibri's tasks. `just test` is what CI runs (via .ci/run); `just bench` is never part of it.
set shell := ["bash", "-euo", "pipefail", "-c"]

py := ".venv/bin/python"

# Create .venv and build/install the package (release engine).
setup:
    scripts/setup.sh

# Every test: Rust unit tests, then the Python suite against the real engine.
test: setup
    cargo test --release --workspace --quiet
    # The fuzz crate is its own workspace: its own target dir, so the two builds never mix.
    cargo test --release --quiet --manifest-path fuzz/Cargo.toml --target-dir target/fuzz-smoke
    # The dashboard's unit tests (vitest); its browser tests are in the pytest suite.
    cd web && npm test --silent
    {{py}} -m pytest -q tests -m "not clients"
    # The quick part of the real-client suite (two npm installs, cached): Claude Code and pi
    # with their small setups (the default setups at 32k tokens: `just test-clients`).
    {{py}} -m pytest -q -rA tests/clients -m clients -k "(claude or pi) and not default_setup"

# Real coding agents (Claude Code, opencode, pi, aider, codex; pinned, installed once under
# ~/.cache/colibri/clients) run against `colibri serve` on the demo model.
test-clients: setup
    {{py}} -m pytest -q -rA tests/clients -m clients

# Rebuild the web dashboard into python/colibri/_web (commit the result with the change to web/).
web-build: setup
    cd web && npm run build

# The dashboard's Vite dev server on :5173, against a `colibri serve` on :8000.
web-dev: setup
    cd web && npm run dev

# Formatting and lints (Rust and Python).
lint: setup
    cargo fmt --all --check
    cargo clippy --release --workspace --all-targets -- -D warnings
    cargo clippy --release -p colibri-engine --features python -- -D warnings
    .venv/bin/ruff check python tests scripts benchmarks
    cd web && npm run typecheck --silent

# colibri vs llama.cpp on an OLMoE-1B-7B-shaped model (slow: builds llama.cpp once).
bench: setup
    {{py}} benchmarks/bench_vs_llamacpp.py
    # The same on a DeepSeek-V3-shaped model (MLA; llama.cpp's DeepSeek2 path), with KV bytes per token.
    {{py}} benchmarks/bench_vs_llamacpp.py --arch deepseek_v3
    {{py}} benchmarks/bench_server_overhead.py
    # A long prefill persisted to its KV slot file vs kept in memory.
    {{py}} benchmarks/bench_slot_append.py
    {{py}} benchmarks/bench_kv_restart.py
    {{py}} benchmarks/bench_scoring.py
    # Quality against llama.cpp's Q4_0 / Q4_K_M (KL and perplexity vs full precision), and the
    # default conversion's speed (v/o at 8 bits) against all-int4, and the table grid's against
    # the linear grid's.
    {{py}} benchmarks/bench_quality.py
    {{py}} benchmarks/bench_mixed_precision.py
    {{py}} benchmarks/bench_mixed_precision.py --compare scales
    {{py}} benchmarks/bench_mixed_precision.py --compare grid
    # Concurrent streams (1, 2, 4, 8) through the server against llama-server --parallel N -cb.
    {{py}} benchmarks/bench_concurrent.py
    # Decode with a JSON-schema grammar vs unconstrained (the demo model, then the OLMoE shape with a
    # 50k vocabulary): the mask's cost per token.
    {{py}} benchmarks/bench_grammar.py
    {{py}} benchmarks/bench_grammar.py --olmoe
    # Long prompts (prefill 512..32k, decode after 16k, TTFT through the server): hours.
    {{py}} benchmarks/bench_vs_llamacpp.py --long

# Time to first token, cold vs after a restart with a warm KV slot file.
bench-kv: setup
    {{py}} benchmarks/bench_kv_restart.py

# Only the gateway's cost per token (server vs engine alone; a minute).
bench-server: setup
    {{py}} benchmarks/bench_server_overhead.py

# Print a completion from the built-in model.
generate prompt="Hello": setup
    .venv/bin/colibri generate --prompt "{{prompt}}"
