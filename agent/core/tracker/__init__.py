"""The tracker's decisions: who is admitted, who serves which blocks, which route a session
takes, who is alive, what a heartbeat says back, and which nodes the canaries check.
"""
