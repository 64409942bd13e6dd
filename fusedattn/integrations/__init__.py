"""Integrations of fusedattn with other libraries (each imported only on demand).

* :mod:`fusedattn.integrations.torch`: ``activate()`` / ``deactivate()`` / ``enabled()`` put fusedattn under
  ``F.scaled_dot_product_attention`` (per call, PyTorch's own SDPA for what fusedattn cannot run).
* :mod:`fusedattn.integrations.transformers`: ``register()`` adds ``"fusedattn"`` to Hugging Face
  transformers' ``AttentionInterface`` (needs ``transformers``; importing ``fusedattn`` never imports it).
"""
