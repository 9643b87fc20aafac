"""The tracker shell: SQLite store, the ``/baton/tracker/1.0.0`` service, GGUF reading, CLI.

Modules: ``store`` (``TrackerStore``, ``open_store``), ``service`` (``serve_tracker``,
``Tracker``), ``config`` (``TrackerConfig``), ``integrity`` (``OutputIntegrity``, mixed into
``Tracker``), ``model_files`` (``ModelFiles``), ``probes`` (``LostPeerProbes``), ``refusal``
(``Refusal``), the verifier (``verifier``, ``verifier_api``, ``reference``, ``personas``),
``gguf_info`` (``read_gguf_facts``, ``read_registered_file``), ``cli`` (``add_arguments``,
``main``). Decisions live in ``agent.core.wire.admission``, ``assignment``, ``routing``,
``registry`` and ``canary``; this package only performs them.
"""
