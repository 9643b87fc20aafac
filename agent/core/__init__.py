"""The pure core of Baton: decisions and codecs, no I/O.

Nothing under ``agent.core`` imports trio, grpc, sockets, clocks or randomness, and
nothing here reads files or environment variables: every input (bytes, times, random
draws) is an argument and every effect is a returned value. The trio shells in
``agent.io`` perform the I/O around these functions, so all of this is unit-testable
without a worker, a network or an event loop.

One package per role, as ``agent.io`` has them (tests/test_imports.py keeps the rules):
- ``wire``: the records every role exchanges (protocol/*.proto): steps, results, boundary rows,
  data-plane frames, manifests, fingerprints, layer ranges. Imports nothing else of the core.
- ``net``: peers and their connections: identities, multiaddrs, framing, connection slots,
  hole punching.
- ``tracker``: admission, assignment, routing, liveness, heartbeats, canaries.
- ``node``: one node's ranges, sessions, step scheduling, kept rows, policies, installs.
- ``owner``: a session owner's generation, sampling, recovery, spot checks, parity.
- ``relay``: the OpenAI API's records, quotas, chat templates, streamed text.
- ``lab``: the emulated WAN's topology.
"""
