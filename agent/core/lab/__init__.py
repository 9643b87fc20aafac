"""The emulated WAN's pure parts: what a lab is (machines, addresses, links) and the words the
forwarder is told. The shell that builds it (namespaces, TUN devices, the forwarder process)
is ``agent.io.lab``; the forwarder's packet rules are native (``native/lab/link_model.h``).

Must not import trio, sockets, subprocess, os or a clock.
"""
