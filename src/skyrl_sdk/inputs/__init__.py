"""What callers send, converted into :mod:`skyrl_sdk.types` or refused by name: the one input
path, whether the values come from Python or from ``skyrl-sdk serve``'s wire.

- :mod:`.coerce`: our own objects, mappings, or duck-typed ``tinker.types`` objects ->
  our types (``data_from_any``, ``adam_params_from_any``, ...);
- :mod:`.tinker_json`: Tinker's JSON shapes (dense and sparse-CSR tensors included) <-> our
  types, for the HTTP server and for mappings given in process;
- :mod:`.tinker_proto`: Tinker's protobuf ``ForwardBackwardRequest`` -> our types (needs the
  ``tinker`` package: imported by the server only);
- :mod:`.sample`: a sample call's arguments (in process or Tinker's JSON) -> the one
  :class:`~skyrl_sdk.types.SampleRequest`;
- :mod:`.limits`: the length limits, in one wording.

Every reader refuses a key its type does not have, naming it and the nearest known one
(:func:`skyrl_sdk.errors.refuse_unknown_keys`).
"""
