"""One node's decisions: its ranges' lifecycle, the sessions each range holds, which steps go
into the next Forward, the rows kept for resume, who may send what, and installs.
"""
