"""Process harnesses for the demo, tests and benchmarks (not a role of the swarm).

- ``local_swarm``: a tracker, nodes and a relay as real processes on loopback
  (``open_local_swarm``); the only place that spells their command lines.
- ``parity_run``: an unsplit worker and a chain of range workers driven side by side
  (``baton parity`` and the parity tests).
"""
