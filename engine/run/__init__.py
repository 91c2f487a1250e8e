"""Above models/: the model runner, CUDA graphs, memory sizing, the sampler, the worker pipeline.

Import side effect: OpenMP threads that wait passively. torch's OpenMP runtime (libgomp)
reads OMP_WAIT_POLICY once, when torch is first imported, and by default a thread that
reaches a barrier first spins for its partner. A CPU worker uses every core, so when another
process (the scheduler, the tokenizer, anything else on the machine) takes one, the spinning
thread burns the core its partner needs: measured on 2 cores with one busy, 16x64 decode took
79 s with spinning threads against 11 s passive (10 s with one thread); on an idle machine
passive costs ~10% (7.1 vs 6.5 s). The worker process imports this package before torch
(procs/worker.py), so setting the default here reaches it; an explicit OMP_WAIT_POLICY wins.
"""

import os
import sys

# whether the wait policy below came too late (torch, hence libgomp, already loaded)
TORCH_PREIMPORTED = "torch" in sys.modules
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
