"""Worker exit codes: the contract between a worker process (trainer/worker.py), its elastic
agent (daemon/agent.py) and ds3dd's detectors (daemon/detectors.py), kept in one place.

Also: 0 = the job ended as asked; 12 = out of memory (`trainer/oom.py` EXIT_OOM, which writes its
evidence first). Anything else is a crash that the agent may restart.
"""

from __future__ import annotations

# The job's configuration cannot run (ds3d's own check, or DeepSpeed refusing a key): the same
# on every rank and every restart. The agent does not restart the group; the daemon ends the job
# FAILED at once with the message from the worker's error file.
EXIT_CONFIG = 2

