"""``baton demo``, the quick start: a real model through Baton on loopback.

- ``swarm_demo``: tracker, three nodes and the relay; a generation through the relay's HTTP API,
  checked against one unsplit worker;
- ``local_demo``: the ranges as local worker processes without a swarm (``--local``);
- ``cli``: the ``baton demo`` command line.
"""
