"""The trainer applications (GRPO sync and async) built on :mod:`nemo_dataplane`.

``nemo_dataplane`` is imported first, so every process that imports any of these modules (Ray
loads an actor's class by its module) defers tensordict's ``torch.compile`` marks
(:mod:`nemo_dataplane.compile_marks`): about 2 CPU-seconds saved in each process that never compiles.
"""

import nemo_dataplane  # noqa: F401  (first: see above)
