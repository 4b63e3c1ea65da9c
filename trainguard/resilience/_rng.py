"""Capture and restore every random number generator a training step can draw from.

Python ``random``, NumPy's global generator, torch's CPU generator, each CUDA device's generator
(only when CUDA is already initialised: capturing must not start CUDA in a CPU program), and any
``torch.Generator`` handed in. States are returned as plain values the JSON codec stores exactly.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

from trainguard._errors import CheckpointError


def _cuda_ready() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def capture_global() -> dict[str, Any]:
    """The state of the process-wide generators, as JSON-encodable values."""
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(legacy=False),
        "torch": torch.get_rng_state().numpy().tobytes(),
    }
    if _cuda_ready():
        state["cuda"] = [s.numpy().tobytes() for s in torch.cuda.get_rng_state_all()]
    return state


def restore_global(state: dict[str, Any]) -> None:
    """Put the process-wide generators back where :func:`capture_global` found them."""
    try:
        random.setstate(state["python"])
        np.random.set_state(state["numpy"])
        torch.set_rng_state(_byte_tensor(state["torch"]))
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        raise CheckpointError(f"cannot restore the random number generators: {exc}") from None
    cuda = state.get("cuda")
    if cuda:
        if not torch.cuda.is_available():
            raise CheckpointError(
                f"the checkpoint holds the random state of {len(cuda)} CUDA device(s) but CUDA is not available"
            )
        if len(cuda) != torch.cuda.device_count():
            raise CheckpointError(
                f"the checkpoint holds the random state of {len(cuda)} CUDA device(s), "
                f"this process sees {torch.cuda.device_count()}"
            )
        torch.cuda.set_rng_state_all([_byte_tensor(s) for s in cuda])


def capture_generator(gen: torch.Generator) -> dict[str, Any]:
    return {"device": str(gen.device), "state": gen.get_state().numpy().tobytes()}


def restore_generator(gen: torch.Generator, state: dict[str, Any]) -> None:
    if str(gen.device) != state["device"]:
        raise CheckpointError(
            f"generator was saved on {state['device']} and is now on {gen.device}"
        )
    gen.set_state(_byte_tensor(state["state"]))


def capture_all(generators: Iterable[torch.Generator] = ()) -> dict[str, Any]:
    """Process-wide generators plus the given ones (in order)."""
    state = capture_global()
    state["generators"] = [capture_generator(g) for g in generators]
    return state


def restore_all(state: dict[str, Any], generators: Iterable[torch.Generator] = ()) -> None:
    restore_global(state)
    gens = list(generators)
    saved = state.get("generators", [])
    if len(saved) != len(gens):
        raise CheckpointError(f"expected the state of {len(gens)} generator(s), found {len(saved)}")
    for gen, s in zip(gens, saved, strict=True):
        restore_generator(gen, s)


def _byte_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)
