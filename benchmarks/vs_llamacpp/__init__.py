"""The pieces of ``benchmarks/bench_vs_llamacpp.py`` (colibri vs llama.cpp).

``common`` the benchmark's directories, log lines and running commands, ``prepare`` the cached
setup steps (venv, llama.cpp source and build, bandwidth probe, random checkpoint, GGUF, colibri
conversion), ``machine`` the machine's load (waiting for quiet), caches and description,
``measure`` one run of each engine and of the bandwidth probe, ``report`` the bytes read per
decoded token and the markdown report. Standard library only, like the script.
"""
