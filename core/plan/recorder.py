"""The allocations and frees of a traced step, in order: what :mod:`core.plan.allocator` replays (issue 38).

A ``TorchDispatchMode`` sees every op's outputs; a tensor whose storage it has not seen before is a new allocation of
the storage's ``nbytes`` (what the caching allocator is asked for: ``empty`` and every kernel's output go through it),
and a ``weakref.finalize`` on that storage records its free when the last tensor over it dies (views share a storage:
one allocation). Storages are the Python objects torch keeps for the life of the C++ storage (the same identity
MemTracker keys on, ``torch.distributed._tools.mem_tracker``), so one storage is one key.

Not seen: buffers a kernel allocates and frees inside one op, and allocations another thread makes. On CUDA, cuBLAS's
and cuDNN attention's workspaces go through the caching allocator without being tensors: they are sized apart
(core/plan/workspace.py) and added to the replay as blocks.
"""

from __future__ import annotations

import functools
import itertools
import weakref
from typing import Any


def allocation_recorder() -> Any:
    """A new recorder: a ``TorchDispatchMode`` recording ``("alloc", key, nbytes)`` / ``("free", key, 0)`` events, and
    ``("mark", name, 0)`` from its ``mark(name)`` (torch is imported here, not with the module: only the trace needs
    it)."""
    return _recorder_class()()


@functools.cache
def _recorder_class() -> Any:
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class Recorder(TorchDispatchMode):
        """Records ``("alloc", key, nbytes)`` / ``("free", key, 0)`` events, and ``("mark", name, 0)`` from :meth:`mark`.

        Tensors made before recording starts are recorded when :meth:`track` is given them (the weights).
        """

        def __init__(self) -> None:
            from torch.utils.weak import WeakIdKeyDictionary

            super().__init__()  # type: ignore[no-untyped-call]
            self.events: list[tuple[str, Any, int]] = []
            self._keys = itertools.count()
            self._seen: Any = WeakIdKeyDictionary()
            self._refs: dict[int, Any] = {}

        def track(self, tensor: Any) -> None:
            """Record each storage under ``tensor`` (a subclass's inner tensors' too) as allocated, once."""
            import torch
            from torch.distributed._tools.common_utils import get_untyped_storages

            if not isinstance(tensor, torch.Tensor):
                return
            for storage in get_untyped_storages(tensor):
                if storage in self._seen:
                    continue
                key = next(self._keys)
                self._seen[storage] = key
                self.events.append(("alloc", key, int(storage.nbytes())))
                self._refs[key] = weakref.ref(storage, functools.partial(self._freed, key))

        def _freed(self, key: int, _ref: Any = None) -> None:
            self._refs.pop(key, None)
            self.events.append(("free", key, 0))

        def mark(self, name: str) -> None:
            """End a window of the replay (a step) here."""
            self.events.append(("mark", name, 0))

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            out = func(*args, **(kwargs or {}))
            for leaf in tree_leaves(out):
                self.track(leaf)
            return out

    return Recorder
