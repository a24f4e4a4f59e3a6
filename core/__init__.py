"""gpuaccept's pipeline, one package per stage (docs/architecture.md §1): never imports the UI.

``spec`` (what to run) -> ``plan/`` -> ``stages/`` (probe, train + evaluate, kill and resume; each runs ``child/`` in
a child process while ``monitor/`` samples the devices) -> ``record/`` (written, signed, verified); ``pipeline``
runs them in order as one generator of typed ``events``; ``quiz`` reads a record back.
"""
