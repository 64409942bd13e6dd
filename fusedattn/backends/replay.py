"""A repeat eager call's kernel launches, issued again with its own tensors and none of the host work around them.

An eager training step at d=64 spends more host time than GPU time in its backward: on the H100 machine the
single-pass backward's body took 301 us on autograd's device thread (161 us on a plain thread) for ~200 us of
GPU time, of which the launches themselves are three driver calls; the rest is routing, ``supports``' checks,
descriptor arguments and three launch keys, the same on every step (bench/NOTES.md 89). Replayed (session 50,
NOTES 90): that body 253 -> 122 us, the d=64 anchor's eager backward 183 -> 314 TFLOP/s (torch's cuDNN: 317),
its causal one 83 -> 147 (cuDNN 202; still host-bound, in the autograd engine's ~108 us around the body).

A :class:`Replay` is made from one real call (``triton.launch.recording`` lists the launches it made through
the launch caches' cached path): each tensor argument, and each TMA descriptor's base, is matched by its
address to one of the call's named tensors (its *roles*), everything else is kept as it was. Called with
another call's inputs in the same roles, it makes that call's outputs and scratch (``make``) and issues the
same launches, same kernels, grids and scalars, with the new tensors in their roles.

The contract, the caller's: a replay is reused only under a key that fixes everything the recorded launches
depended on besides the tensors' addresses (the problem, every role's strides and dtype, 16-byte alignment,
the device), and the recorded code does nothing between its launches but launch (no torch work: scratch is a
role that ``make`` allocates). A call whose roles share an address, or whose launches take a tensor no role
holds (a persistent buffer, a copy), gives no replay (:func:`build` returns None).

``FUSEDATTN_REPLAY=0`` turns replays off (:data:`ENABLED`: A/B runs, debugging).
"""
from __future__ import annotations

import functools
import os
from typing import Callable, Optional

import torch

from . import compat
from .triton import launch as _launch

__all__ = ["ENABLED", "Replay", "Cache", "build", "clear_all"]

ENABLED = os.environ.get("FUSEDATTN_REPLAY", "1") not in ("", "0")


class Replay:
    """The recorded launches of one call (see the module docstring)."""

    def __init__(self, device: int, steps: list, make: Callable):
        self.device = device
        self.steps = steps          # (launcher, go, grid_x, grid_y, grid_z, args_of(roles) -> args)
        self.make = make            # make(*inputs) -> the outputs and scratch roles, after the inputs
        self.calls = 0              # calls replayed (tests check the path is taken)

    def __call__(self, *inputs) -> Optional[tuple]:
        """The outputs and scratch ``make(*inputs)`` gave, after the launches wrote them; None (nothing made
        or launched) where launches must take the ordinary path now: another current device, a launch hook
        (profilers), compiles ahead on this thread."""
        device = self.device
        if (_launch._current_device() != device or not _launch._no_launch_hooks()
                or getattr(_launch._ahead, "active", None) is not None):
            return None
        made = self.make(*inputs)
        if made is None:             # make found the call unlike the recorded one in a way no key holds
            return None
        roles = inputs + made
        compat.ensure_context(device)
        stream = _launch._current_raw_stream(device)
        for launcher, go, grid_x, grid_y, grid_z, args_of in self.steps:
            launcher.direct_launches += 1
            go(grid_x, grid_y, grid_z, stream, args_of(roles))
        self.calls += 1
        return made


def build(recorded, roles: tuple, make: Callable) -> Optional[Replay]:
    """A :class:`Replay` of the launches ``recorded`` (a finished ``triton.launch.recording``) with each tensor
    argument replaced by its role: its index in ``roles`` (the recorded call's inputs, then what ``make`` makes),
    found by address. None where that cannot be exact: a launch went through the JIT, no launch was made, two
    roles share an address, an argument is a tensor no role holds, or the launches ran on two devices."""
    if not recorded.complete or not recorded.launches:
        return None
    role_of = {}
    for i, t in enumerate(roles):
        address = t.data_ptr()
        if address in role_of or address == 0:
            return None
        role_of[address] = i
    devices = {device for _, _, device, _, _ in recorded.launches}
    if len(devices) != 1:
        return None
    steps = []
    for launcher, go, _, grid, args in recorded.launches:
        args_of = _args_builder(args, role_of)
        if args_of is None:
            return None
        steps.append((launcher, go, *grid, args_of))
    return Replay(devices.pop(), steps, make)


def _args_builder(args: tuple, role_of: dict) -> Optional[Callable]:
    """``args_of(roles)``: ``args`` with each tensor replaced by ``roles[i]`` of its address and each TMA descriptor
    (a named tuple whose first field is its ``base`` tensor) rebuilt on ``roles[i]`` with its other fields kept;
    generated as one tuple display (the replay's per-launch host cost). None where a tensor has no role."""
    env, items = {}, []
    for j, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            role = role_of.get(a.data_ptr())
            if role is None:
                return None
            items.append(f"roles[{role}]")
        elif isinstance(a, tuple) and getattr(a, "_fields", ("",))[0] == "base":
            role = role_of.get(a.base.data_ptr()) if isinstance(a.base, torch.Tensor) else None
            if role is None:
                return None
            env[f"make{j}"] = functools.partial(tuple.__new__, type(a))
            env[f"rest{j}"] = tuple(a)[1:]
            items.append(f"make{j}((roles[{role}],) + rest{j})")
        elif hasattr(a, "data_ptr"):
            return None          # a pointer-like argument of another kind: not one this can re-address
        else:
            env[f"value{j}"] = a
            items.append(f"value{j}")
    source = f"def args_of(roles):\n    return ({''.join(item + ', ' for item in items)})"
    exec(compile(source, "<fusedattn replay>", "exec"), env)
    return env["args_of"]


_CACHES: list = []


class Cache(dict):
    """Replays by the caller's key (see the module docstring's contract); None for a key whose call gave none,
    so it is not recorded again. Cleared whole when full, and by :func:`clear_all`."""

    def __init__(self, limit: int = 256):
        super().__init__()
        self.limit = limit
        _CACHES.append(self)

    def keep(self, key, replay: Optional[Replay]) -> None:
        if len(self) >= self.limit:
            self.clear()
        self[key] = replay


def clear_all() -> None:
    """Forget every replay (tests that change routing switches; the Gluon kernels turned off)."""
    for cache in _CACHES:
        cache.clear()
