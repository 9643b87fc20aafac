"""Test support shared by the test suites: deterministic synthetic models (``synthetic``).

Importing this package pulls in nothing heavy; ``agent.testing.synthetic`` needs numpy + gguf.
"""
