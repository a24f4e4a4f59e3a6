"""Live device memory, read in the parent while a child runs (and by ``gpuaccept monitor``).

- :mod:`core.monitor.sampler`: readings, the 10 Hz sampler, recording and replay, the host backend.
- :mod:`core.monitor.nvml`: NVIDIA GPUs through NVML (``pynvml``): used and total per device, per process.
- :mod:`core.monitor.hostmem`: the host's memory and its cgroup limit (the capacity of a CPU device).
"""
