"""``python -m skyrl_sdk.cli``: the same as the ``skyrl-sdk`` command."""

import sys

from .commands import main

sys.exit(main())
