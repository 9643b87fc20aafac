"""Peers and their connections, decided without sockets: identities and signatures, multiaddrs,
stream framing, the connection-slot rule, and hole punching's decisions and records.
"""
