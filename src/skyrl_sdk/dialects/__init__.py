"""Config dialects: how a client's loss names and configs map onto canonical losses (built-ins: native, tinker)."""
