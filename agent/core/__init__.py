"""The pure core of Baton: decisions and codecs, no I/O.

Nothing under ``agent.core`` imports trio, grpc, sockets, clocks or randomness, and
nothing here reads files or environment variables: every input (bytes, times, random
draws) is an argument and every effect is a returned value. The trio shells in
``agent.io`` perform the I/O around these functions, so all of this is unit-testable
without a worker, a network or an event loop.

Modules:
- ``boundary``: boundary tensor rows (numpy) <-> little-endian wire bytes.
- ``ranges``: layer ranges ``[begin, end)``, cuts, and the ``B:E`` syntax.
- ``worker_records``: plain records for what a shard worker takes and gives.
- ``parity``: comparison of an unsplit run against a split run.
"""
