"""A session owner's decisions (``baton generate``, the relay): the generation and session
state machines, sampling, recovery after a failed step, spot checks, data-plane routes, parity.
"""
