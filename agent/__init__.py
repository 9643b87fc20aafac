"""Baton: run GGUF language models split into layer ranges across volunteer machines.

Layering (see /docs/LAYOUT.md and DESIGN.md): ``agent.core`` is sans-I/O (no trio, grpc,
sockets, clocks or randomness); ``agent.io`` holds the thin trio shells around it;
``agent.models`` resolves the pinned test/demo model files; ``agent._proto`` holds the
generated gRPC stubs for the native shard worker (made by ``packaging/gen_proto.py``);
``agent.testing`` is test support that no other module imports. No module circles
(tests/test_imports.py).
"""

__version__ = "0.1.0"
