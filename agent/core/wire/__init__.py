"""The records every role exchanges (protocol/*.proto), as codecs and checks: what a step,
a result, a boundary row, a data-plane frame, a manifest, a fingerprint or a layer range is.

Imports only ``agent.core.net`` (identities) and ``agent._proto``: every role may import it.
"""
