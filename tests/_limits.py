"""Time limits in tests guard against hangs; they never check speed.

A machine whose cores other jobs share can make a run many times slower than on idle cores
(the demo: 4-5x with torch's default threads, 233 s instead of 10 s at load 7-9), and the
suite must still pass there. So every subprocess, thread join, event wait and future in the
tests waits up to ``HANG_S``: a hang still fails, a slow machine does not.
"""

from __future__ import annotations

import os

#: seconds after which a wait is taken as a hang: 10x the slowest idle run (the benchmark
#: smoke run, about 2 min); ``SKYRL_SDK_TEST_HANG_S`` changes it
HANG_S = float(os.environ.get("SKYRL_SDK_TEST_HANG_S", 1800))
