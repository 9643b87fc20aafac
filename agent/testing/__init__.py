"""Test support shared by the test suites; nothing in the product imports it (tests/test_imports.py).

- ``synthetic``: deterministic synthetic GGUF models (needs numpy + gguf);
- ``tiny_models``: those models pinned (sha256) and cached, ``tiny_model_path(name)``;
- ``templates/``: chat templates written into synthetic models (Qwen2.5-Instruct's, tool-aware);
- ``faulty``: ``OutputCorrupter``, a node's outputs hook that makes it compute wrong numbers;
- ``faulty_node``: ``python -m agent.testing.faulty_node``, ``baton node`` with that hook;
- ``model_http``: a model file server that records its requests and can cut its responses.

Importing this package pulls in nothing heavy.
"""
