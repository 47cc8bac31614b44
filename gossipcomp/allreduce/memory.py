"""Per-parameter state kept as flat buffers: error-feedback memories that survive regrouping.

DDP rebuilds its buckets after the first iteration, and checkpoints outlive a process, so state
keyed by a bucket's index is lost or, worse, applied to other parameters (pytorch issues 48867
and 51427 in torch's own PowerSGD hook). Here state is keyed by parameter name: a group of
parameters asks for its flat buffer by its tuple of names; the same tuple gets the same buffer
back (no copy), a new tuple is assembled from whatever each name held before (zeros for a name
never seen), and `state_dict` gives one tensor per name.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

Names = tuple[str, ...]


class ParameterMemory:
    """Flat float32 buffers for groups of parameters, with one view per parameter name."""

    def __init__(self) -> None:
        self._flats: dict[Names, torch.Tensor] = {}
        self._views: dict[str, torch.Tensor] = {}

    def flat(self, names: Names, numels: Sequence[int], device: torch.device) -> torch.Tensor:
        """The 1-D buffer of `names` (sizes `numels`): the caller updates it in place."""
        found = self._flats.get(names)
        if found is not None:
            return found
        parts = []
        for name, numel in zip(names, numels, strict=True):
            old = self._views.get(name)
            if old is not None and old.numel() != numel:
                raise ValueError(
                    f"memory of parameter {name!r} holds {old.numel()} elements, expected {numel}"
                )
            parts.append(old.to(device) if old is not None else torch.zeros(numel, device=device))
        flat = torch.cat(parts) if parts else torch.zeros(0, device=device)
        shared = set(names)
        for key in [key for key in self._flats if shared.intersection(key)]:
            del self._flats[key]
        self._flats[names] = flat
        self._views.update(zip(names, flat.split(list(numels)), strict=True))
        return flat

    def state_dict(self) -> dict[str, torch.Tensor]:
        """A copy of every parameter's memory, by name."""
        return {name: view.clone() for name, view in self._views.items()}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Replace every memory with copies of `state` (name -> 1-D float32 tensor)."""
        views = {}
        for name, tensor in state.items():
            if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
                raise ValueError(f"memory of parameter {name!r}: expected a float tensor")
            views[name] = tensor.detach().reshape(-1).to(torch.float32, copy=True)
        self._flats.clear()
        self._views = views
