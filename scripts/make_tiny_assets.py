"""Regenerate the built-in ``tiny`` model's config and tokenizer files (deterministic).

Run: python scripts/make_tiny_assets.py  (writes src/skyrl_sdk/assets/tiny/)
"""

from __future__ import annotations

import json
from pathlib import Path

from skyrl_sdk.models.loading import TINY_DIR, build_tiny_tokenizer, tiny_config

if __name__ == "__main__":
    TINY_DIR.mkdir(parents=True, exist_ok=True)
    build_tiny_tokenizer().save_pretrained(TINY_DIR)
    config = tiny_config()
    (TINY_DIR / "config.json").write_text(json.dumps(config.to_dict(), indent=2, sort_keys=True) + "\n")
    print(f"wrote {sorted(p.name for p in Path(TINY_DIR).iterdir())}")
