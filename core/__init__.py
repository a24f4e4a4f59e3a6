"""gpuaccept's pipeline, one package per stage (docs/architecture.md §1): never imports the UI.

``spec`` (what to run) -> ``plan/`` -> ``stages/`` (probe, train + evaluate, kill and resume; each runs ``child/`` in
a child process while ``monitor/`` samples the devices) -> ``record/`` (written, signed, verified); ``pipeline``
runs them in order as one generator of typed ``events``; ``quiz`` reads a record back.
"""

import logging

# bitsandbytes warns as it is imported (peft imports it), on a CPU with AVX512-BF16, that the `kernels` package of an
# optional CPU inference kernel is missing; gpuaccept never runs that kernel (core/child/recipe.py turns its path off),
# so the warning would only confuse the plan's output and the child's log
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
