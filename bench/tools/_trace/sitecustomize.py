"""Put this folder and bench/tools/ on a node process's PYTHONPATH to trace it: installs
bench/tools/hop_trace.py's hooks in node processes when $BATON_BENCH_TRACE_DIR is set."""

try:
    import hop_trace
except ImportError:  # bench/ not on the path: nothing to do
    pass
else:
    hop_trace.install_from_env()
