"""Deprecated import path: config dialects live in :mod:`skyrl_sdk.dialects` (one word per concept)."""
