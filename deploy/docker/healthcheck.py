#!/usr/bin/env python3
"""Docker HEALTHCHECK: exit 0 when ``/health`` on this container's port answers 200.

The port is LLMCTL_PORT, else the default of the mode the container runs (serve 8000, router 8080).
"""

import os
import sys
import urllib.request

ports = [os.environ["LLMCTL_PORT"]] if os.environ.get("LLMCTL_PORT") else ["8000", "8080"]
for port in ports:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=4) as response:
            if response.status == 200:
                sys.exit(0)
    except OSError:
        continue
sys.exit(1)
