"""The lab: emulated machines on one host, linked by an emulated WAN (a shell; needs root).

- ``netns``: namespaces and TUN devices (iproute2);
- ``state``: running labs written down in /run/baton-lab, the sweep of stale ones;
- ``forwarder``: the native forwarder process and its control socket;
- ``guardian``: the process that sweeps a lab whose owner died;
- ``up``: bringing a lab up and down (the one path behind the CLI and ``open_lab``);
- ``harness``: ``open_lab`` for tests and benchmarks;
- ``cli``: ``baton lab up | exec | link | status | down``.

The lab's shape and the forwarder's words are pure: ``agent.core.lab``.
"""
