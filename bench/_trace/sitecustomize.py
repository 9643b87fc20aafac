"""Put on PYTHONPATH (with bench/) by bench/compare.py for the profiled swarm only: installs
bench/hop_trace.py's hooks in node processes when $BATON_BENCH_TRACE_DIR is set."""

try:
    import hop_trace
except ImportError:  # bench/ not on the path: nothing to do
    pass
else:
    hop_trace.install_from_env()
