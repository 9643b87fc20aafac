"""The node agent (``baton node``): a volunteer machine serving layer ranges to the swarm.

Modules:
  ``probe``  measures the host (CPU, RAM, OS, runtime pin and devices, throughput proxies);
  ``agent``  ``serve_node``: registration, heartbeats, directives (native workers), step
             serving (``/baton/step/1.0.0``) and node requests (``/baton/node/1.0.0``);
  ``cli``    the ``baton node`` command line (``add_arguments`` + ``main``).

The decisions live in the pure core: ``agent.core.wire.swarm_wire`` and the ``agent.core.wire.step_*``
modules (codecs and validation), ``agent.core.node.scheduler`` (batches), ``agent.core.node.sessions``
(sessions per range) and ``agent.core.wire.fingerprint``.
"""
