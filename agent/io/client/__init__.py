"""The session owner's role (``baton generate``, and the relay's swarm side).

Modules, each a layer of ``SwarmClient`` over the one before, or what the layers share:
  ``config``       ``SwarmClientConfig``: the client's timeouts and limits;
  ``outcome``      ``SwarmError``, ``GenerationError``, ``GenerationResult`` and the
                   accounting that fills it; routes as reports show them;
  ``live``         where a live session's step outcome arrives (a pushed result, the
                   data plane's connections);
  ``control``      ``ControlClient``: admission, routes, reports and listings from the tracker;
                   tokenize, detokenize and end-session requests to first hops;
  ``steps``        ``StepClient``: the result handler, steps out, results awaited, hops probed;
  ``session_run``  ``SessionRunner``: one session over one route (the data plane when it can);
  ``resume``       ``ResumingClient``: a lost hop replaced, the other hops' caches kept;
  ``swarm``        ``SwarmClient`` / ``open_swarm_client``: the generation loop and what to do
                   when a step fails;
  ``spot_check``   replaying sessions on other routes and comparing them;
  ``cli``          the ``baton generate`` command line (``add_arguments`` + ``main``).

The decisions live in the pure core: ``agent.core.owner.session`` (which rows a step sends, which
results a session accepts and from whom, the next token, when to stop).
"""

from .config import SwarmClientConfig
from .control import split_peer_addr
from .outcome import GenerationError, GenerationResult, SwarmError, describe_route, route_hops
from .swarm import SwarmClient, open_swarm_client

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
