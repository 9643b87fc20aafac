"""The relay (``baton relay``): an OpenAI-compatible HTTP API over the swarm.

Modules:
  ``server``       ``serve_main``: the ASGI app (``/v1/models``, ``/v1/completions``,
                   ``/v1/chat/completions``, SSE streaming, OpenAI error envelopes) on
                   Hypercorn's trio worker, in the same trio process as its swarm client;
  ``config``       ``RelayConfig``: the ``serve`` flags and ``--config`` file keys, one place;
  ``state``        ``RelayState`` (what handlers share);
  ``queue``        ``RelayQueue``: the line requests wait in for a free sequence (its rules:
                   ``agent.core.relay.waiting_line``);
  ``auth``         API keys and quotas of a request (401, 429);
  ``completion``   one completion: the prompt prepared, the generation, its OpenAI bodies;
  ``responses``    the error envelope and a completion's JSON or SSE response;
  ``store``        ``RelayStore`` / ``open_relay_store``: the SQLite file with the hashed API
                   keys, their limits, token usage per UTC day, recent requests and the ledger;
  ``cli``          the ``baton relay`` command line (``add_arguments`` + ``main``): ``serve``,
                   ``keys add / list / revoke``, ``ledger``;
  ``metrics``      Prometheus ``/metrics``;
  ``status_page``  the status page at ``/``;
  (the tokenizer, held locally from the model's metadata, is ``agent.io.worker.vocab``, shared with ``baton generate``)

The decisions live in the pure core: ``agent.core.relay.quotas`` (limits, UTC days, ledger credit)
and ``agent.core.owner.session`` (a generation's steps, results and stopping). Nothing is imported
here, so ``baton relay keys`` does not load the HTTP stack.
"""
