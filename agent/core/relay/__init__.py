"""The relay's decisions: OpenAI API records, quotas and the ledger, chat templates, and
generated text as it streams.
"""
