"""Reusable benchmark tools: an interleaved A/B of two checkouts or settings (``step_ab``), the
transport round trip alone (``transport_rtt``) and the hot path's timestamps (``hop_trace``).
They back no claim by themselves; the product benchmarks in bench/ use some of them."""
