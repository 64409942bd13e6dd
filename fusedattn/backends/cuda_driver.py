"""The few CUDA driver calls that load and launch a kernel compiled ahead (``backends.prebuilt``), via ctypes.

Triton loads and launches a compiled kernel through C modules it builds with the host's C compiler the
first time a process needs them (``cuda_utils``, and on Triton 3.6 one launcher per kernel signature):
with an empty Triton cache that is seconds of a process's first call before any kernel runs. A kernel
shipped compiled needs none of it: the driver API is enough (``cuModuleLoadData``, ``cuLaunchKernel``,
``cuTensorMapEncodeTiled`` for TMA descriptors), and libcuda is there wherever a GPU is (PyTorch's own
``torch.cuda._utils`` reaches it the same way). Only public CUDA driver entry points are used, with the
enum values of CUDA 12's ``cuda.h``.

Every call needs a current CUDA context on the calling thread (``compat.ensure_context``).
"""
from __future__ import annotations

import ctypes
import threading
from typing import Sequence

# cuda.h enum values
_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES = 1
_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN = 97
_FUNC_CACHE_PREFER_SHARED = 1
_TENSOR_MAP_INTERLEAVE_NONE = 0
_TENSOR_MAP_L2_PROMOTION_L2_128B = 2          # what Triton's descriptor encoder asks for
_TENSOR_MAP_OOB_FILL_NONE, _TENSOR_MAP_OOB_FILL_NAN = 0, 1
_STATIC_SHARED_LIMIT = 48 * 1024              # above this a kernel must opt in to dynamic shared memory

TENSOR_MAP_BYTES, TENSOR_MAP_ALIGN = 128, 64  # sizeof / alignof(CUtensorMap)

_lib = None
_lib_lock = threading.Lock()


class CudaError(RuntimeError):
    pass


def _libcuda():
    global _lib
    with _lib_lock:
        if _lib is None:
            lib = ctypes.CDLL("libcuda.so.1")
            u64, u32, i32, vp = ctypes.c_uint64, ctypes.c_uint32, ctypes.c_int, ctypes.c_void_p
            sigs = {
                "cuGetErrorString": (i32, ctypes.POINTER(ctypes.c_char_p)),
                "cuCtxGetDevice": (ctypes.POINTER(i32), ),
                "cuDeviceGetAttribute": (ctypes.POINTER(i32), i32, i32),
                "cuModuleLoadData": (ctypes.POINTER(vp), ctypes.c_char_p),
                "cuModuleGetFunction": (ctypes.POINTER(vp), vp, ctypes.c_char_p),
                "cuFuncGetAttribute": (ctypes.POINTER(i32), i32, vp),
                "cuFuncSetAttribute": (vp, i32, i32),
                "cuFuncSetCacheConfig": (vp, i32),
                "cuLaunchKernel": (vp, u32, u32, u32, u32, u32, u32, u32, vp, vp, vp),
                "cuTensorMapEncodeTiled": (vp, i32, u32, vp, ctypes.POINTER(u64), ctypes.POINTER(u64),
                                           ctypes.POINTER(u32), ctypes.POINTER(u32), i32, i32, i32, i32),
            }
            for name, argtypes in sigs.items():
                fn = getattr(lib, name)
                fn.argtypes, fn.restype = argtypes, i32
            _lib = lib
    return _lib


def _check(result: int, what: str) -> None:
    if result != 0:
        text = ctypes.c_char_p()
        _libcuda().cuGetErrorString(result, ctypes.byref(text))
        raise CudaError(f"fusedattn: {what} failed: CUDA error {result} "
                        f"({text.value.decode() if text.value else 'unknown'})")


def load_function(image: bytes, name: str, shared: int) -> int:
    """Load a cubin into the current context and return its kernel ``name`` (a ``CUfunction``), allowed
    ``shared`` bytes of dynamic shared memory as Triton's loader allows them."""
    lib = _libcuda()
    module, function = ctypes.c_void_p(), ctypes.c_void_p()
    _check(lib.cuModuleLoadData(ctypes.byref(module), image), f"loading kernel {name}")
    _check(lib.cuModuleGetFunction(ctypes.byref(function), module, name.encode()), f"finding kernel {name}")
    if shared > _STATIC_SHARED_LIMIT:
        device, optin, static = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
        _check(lib.cuCtxGetDevice(ctypes.byref(device)), "cuCtxGetDevice")
        _check(lib.cuDeviceGetAttribute(ctypes.byref(optin), _DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
                                        device), "reading the shared memory limit")
        if shared > optin.value:
            raise CudaError(f"fusedattn: kernel {name} needs {shared} bytes of shared memory; this GPU allows "
                            f"{optin.value}")
        _check(lib.cuFuncSetCacheConfig(function, _FUNC_CACHE_PREFER_SHARED), "cuFuncSetCacheConfig")
        _check(lib.cuFuncGetAttribute(ctypes.byref(static), _FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, function),
               "cuFuncGetAttribute")
        _check(lib.cuFuncSetAttribute(function, _FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                      optin.value - static.value), "allowing dynamic shared memory")
    return function.value


def launch(function: int, grid: Sequence[int], threads: int, shared: int, stream: int, params) -> None:
    """``cuLaunchKernel``: ``params`` is a ctypes array of pointers to each argument's bytes."""
    if grid[0] * grid[1] * grid[2] == 0:
        return
    _check(_libcuda().cuLaunchKernel(function, grid[0], grid[1], grid[2], threads, 1, 1, shared, stream, params,
                                     None), "launching a prebuilt kernel")


def encode_tiled(base: int, host_dtype: int, elem_size: int, swizzle: int, shape: Sequence[int],
                 strides: Sequence[int], box: Sequence[int], nan_padding: bool) -> bytes:
    """The 128 bytes of a tiled ``CUtensorMap`` (``cuTensorMapEncodeTiled``) as Triton's own encoder makes
    them: shape, element strides and box given outermost first (the driver takes them innermost first,
    strides in bytes without the innermost), element strides 1, L2 promotion 128 B."""
    rank = len(shape)
    u64s, u32s = ctypes.c_uint64 * rank, ctypes.c_uint32 * rank
    dims = u64s(*reversed([int(s) for s in shape]))
    byte_strides = u64s(*reversed([int(s) * elem_size for s in strides[:-1]]), 0)
    boxes = u32s(*reversed([int(b) for b in box]))
    ones = u32s(*([1] * rank))
    raw = ctypes.create_string_buffer(TENSOR_MAP_BYTES + TENSOR_MAP_ALIGN)
    address = ctypes.addressof(raw) + (-ctypes.addressof(raw)) % TENSOR_MAP_ALIGN
    _check(_libcuda().cuTensorMapEncodeTiled(
        address, host_dtype, rank, base, dims, byte_strides, boxes, ones, _TENSOR_MAP_INTERLEAVE_NONE, swizzle,
        _TENSOR_MAP_L2_PROMOTION_L2_128B, _TENSOR_MAP_OOB_FILL_NAN if nan_padding else _TENSOR_MAP_OOB_FILL_NONE),
        f"encoding a TMA descriptor (shape {list(shape)}, strides {list(strides)}, box {list(box)})")
    return ctypes.string_at(address, TENSOR_MAP_BYTES)
