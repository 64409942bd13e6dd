"""Integrations of fusedattn with other libraries (each imported only on demand).

* :mod:`fusedattn.integrations.transformers`: ``register()`` adds ``"fusedattn"`` to Hugging Face
  transformers' ``AttentionInterface`` (needs ``transformers``; importing ``fusedattn`` never imports it).
"""
