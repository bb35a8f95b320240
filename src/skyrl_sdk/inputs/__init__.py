"""What callers send, converted into :mod:`skyrl_sdk.types` or refused by name.

- :mod:`.coerce`: our own objects, mappings, or duck-typed ``tinker.types`` objects ->
  our types (``data_from_any``, ``adam_params_from_any``, ...);
- :mod:`.tinker_json`: Tinker's JSON shapes (dense and sparse-CSR tensors included) <-> our
  types, for the HTTP server and for mappings given in process.
"""
