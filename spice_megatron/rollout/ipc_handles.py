"""CUDA IPC handles as plain JSON, for vLLM's `ipc` weight transfer through the engines' HTTP service.

vLLM's IPC update carries, per GPU UUID, the argument tuple of torch's `rebuild_cuda_tensor`
(torch/multiprocessing/reductions.py: tensor class, size, stride, offset, storage class, dtype,
device, the CUDA memory handle bytes, sizes, requires_grad, ref-counter and event handles). Its own
HTTP client pickles them, and its server unpickles only with VLLM_ALLOW_INSECURE_SERIALIZATION=1.
The engines' control plane here takes no pickle, so the handles travel as tagged JSON: bytes as
base64, dtypes by name, and the two classes in the tuple from an allow-list; anything else is
refused with its path. Decoding rebuilds exactly the tuple torch produced.
"""
from __future__ import annotations

import base64
from typing import Any

import torch

# the classes a rebuild_cuda_tensor tuple names (tensor class and storage class)
_CLASSES = {"torch.Tensor": torch.Tensor, "torch.nn.Parameter": torch.nn.Parameter,
            "torch.storage.TypedStorage": torch.storage.TypedStorage,
            "torch.storage.UntypedStorage": torch.UntypedStorage}
_NAMES = {cls: name for name, cls in _CLASSES.items()}


def encode_handles(value: Any, path: str = "ipc_handles") -> Any:
    """`ipc_handles` of an IPC update (a {uuid: args} dict, or a list of them) as JSON values."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, bytes):
        return {"__bytes__": base64.b64encode(value).decode()}
    if isinstance(value, torch.dtype):
        return {"__dtype__": str(value).removeprefix("torch.")}
    if isinstance(value, type):
        if value not in _NAMES:
            raise ValueError(f"{path}: class {value.__module__}.{value.__qualname__} is not one an IPC handle names")
        return {"__class__": _NAMES[value]}
    if isinstance(value, torch.device):
        return {"__device__": str(value)}
    if isinstance(value, (tuple, torch.Size)):
        return {"__tuple__": [encode_handles(v, f"{path}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [encode_handles(v, f"{path}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise ValueError(f"{path}: keys must be strings (GPU UUIDs)")
        return {"__dict__": {k: encode_handles(v, f"{path}[{k!r}]") for k, v in value.items()}}
    raise ValueError(f"{path}: a {type(value).__name__} cannot travel in an IPC handle")


def decode_handles(value: Any, path: str = "ipc_handles") -> Any:
    """The inverse of `encode_handles`; a ValueError naming the path for anything it did not write."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, list):
        return [decode_handles(v, f"{path}[{i}]") for i, v in enumerate(value)]
    if not isinstance(value, dict) or len(value) != 1:
        raise ValueError(f"{path}: not an encoded IPC handle value: {str(value)[:80]}")
    (tag, inner), = value.items()
    if tag == "__bytes__":
        return base64.b64decode(inner, validate=True)
    if tag == "__dtype__":
        dtype = getattr(torch, str(inner), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"{path}: unknown dtype {inner!r}")
        return dtype
    if tag == "__class__":
        if inner not in _CLASSES:
            raise ValueError(f"{path}: class {inner!r} is not one an IPC handle names")
        return _CLASSES[inner]
    if tag == "__device__":
        return torch.device(inner)
    if tag == "__tuple__":
        return tuple(decode_handles(v, f"{path}[{i}]") for i, v in enumerate(inner))
    if tag == "__dict__":
        return {str(k): decode_handles(v, f"{path}[{k!r}]") for k, v in inner.items()}
    raise ValueError(f"{path}: unknown tag {tag!r}")


def encode_update(update_info: dict) -> dict:
    """An IPC update's body for the engines' /update_weights: the handles encoded, the rest as is."""
    if "ipc_handles" not in update_info:
        return update_info
    out = {k: v for k, v in update_info.items() if k != "ipc_handles"}
    out["ipc_handles_json"] = encode_handles(update_info["ipc_handles"])
    return out


def decode_update(update_info: dict) -> dict:
    """The engine's side of `encode_update`: vLLM's IPCWeightTransferUpdateInfo fields."""
    if "ipc_handles_json" not in update_info:
        return update_info
    out = {k: v for k, v in update_info.items() if k != "ipc_handles_json"}
    out["ipc_handles"] = decode_handles(update_info["ipc_handles_json"])
    return out
