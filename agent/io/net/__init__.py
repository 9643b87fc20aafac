"""Peer transports: the interface (``transport``), libp2p (``p2p*``), the direct TLS channel in
front of it (``channel*``, ``peer_transport``), the circuit relay, hole punching, raw sockets,
and the trio link to a worker's data plane (``data_link``).
"""
