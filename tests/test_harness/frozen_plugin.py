"""A plugin for the runner tests (loaded with --plugin): in a worker process, while the file named by
``FROZEN_MARKER`` exists, its import removes the file and then freezes (a worker that never says it is
ready); the runner, which imports plugins too, and later workers import it as usual."""

import multiprocessing
import os
import time

if multiprocessing.parent_process() is not None and os.path.exists(os.environ.get("FROZEN_MARKER", "")):
    os.unlink(os.environ["FROZEN_MARKER"])
    time.sleep(3600)
