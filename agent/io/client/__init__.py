"""The session owner's role (``baton generate``, and the relay's swarm side).

Modules:
  ``swarm``  ``open_swarm_client`` / ``SwarmClient``: admission, routes, tokenize and
             end-session requests to first hops, steps out and results in;
  ``cli``    the ``baton generate`` command line (``add_arguments`` + ``main``).

The decisions live in the pure core: ``agent.core.session`` (which rows a step sends, which
results a session accepts and from whom, the next token, when to stop).
"""

from .swarm import (
    GenerationError,
    GenerationResult,
    SwarmClient,
    SwarmClientConfig,
    SwarmError,
    describe_route,
    open_swarm_client,
    route_hops,
    split_peer_addr,
)

__all__ = [
    "GenerationError",
    "GenerationResult",
    "SwarmClient",
    "SwarmClientConfig",
    "SwarmError",
    "describe_route",
    "open_swarm_client",
    "route_hops",
    "split_peer_addr",
]
