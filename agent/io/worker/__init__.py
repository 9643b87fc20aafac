"""One native shard worker seen from Python: starting and stopping its process (``process``),
its gRPC client (``client``, ``messages``, ``stream``), its errors (``error``), and vocab-only
workers that give owners a model's tokenizer (``vocab``).
"""
