"""What the benchmark drivers in bench/ share: waiting for a line in a service's log."""

import re
import sys
import time


def wait_log(path, pattern, timeout=120):
    """The first match of `pattern` in the log at `path`, waiting up to `timeout` seconds for it;
    exits the driver, naming the pattern and the log, when it does not come."""
    end = time.time() + timeout
    while time.time() < end:
        with open(path, errors="replace") as f:
            m = re.search(pattern, f.read())
        if m:
            return m
        time.sleep(0.1)
    sys.exit(f"{sys.argv[0]}: timed out waiting for {pattern!r} in {path}")
