"""A fingerprint of a model's state, to tell whether something (autoshard's planning or proof) changed it.

``fingerprint(model)`` records, for every parameter and buffer (tied ones under each name, by
``named_parameters(remove_duplicate=False)``), and for every plain tensor kept in a module's
``__dict__``: its Python type (a ``FakeTensor`` or a functional wrapper shows up as its own type),
the object's identity, dtype, device (``meta`` included), shape, stride, ``requires_grad``, its
storage pointer, a hash of its bytes, and the same for its ``.grad``. For every module: its type,
its child modules' names, and every other ``__dict__`` entry (hooks, flags, configs) by name, type
and ``repr`` (hashed when long). ``assert_unchanged(before, after)`` raises ``AssertionError``
naming the first difference; ``first_difference`` returns that text, or None.
"""

from __future__ import annotations

import hashlib

import torch

_LONG_REPR = 200  # longer reprs are kept as a hash (with their start, to read)


def _tensor_hash(t: torch.Tensor) -> str | None:
    """sha1 of the tensor's bytes, or None where there are none to read (meta, fake, sparse, ...)."""
    try:
        if t.device.type == "meta" or type(t) not in (torch.Tensor, torch.nn.Parameter, torch.nn.Buffer):
            return None
        if t.layout != torch.strided:
            return None
        data = t.detach().cpu().contiguous().reshape(-1)
        return hashlib.sha1(data.view(torch.uint8).numpy().tobytes()).hexdigest()[:16]
    except Exception as err:  # noqa: BLE001 - an unreadable tensor is recorded as such
        return f"<unreadable: {type(err).__name__}>"


def _tensor_entry(t: torch.Tensor, with_grad: bool = True) -> dict:
    entry = {
        "type": f"{type(t).__module__}.{type(t).__qualname__}",
        "id": id(t),
        "dtype": str(t.dtype),
        "device": str(t.device),
        "shape": tuple(t.shape),
        "requires_grad": bool(t.requires_grad),
    }
    try:
        entry["stride"] = tuple(t.stride())
    except Exception:  # noqa: BLE001 - e.g. sparse
        entry["stride"] = None
    try:
        fake = t.device.type == "meta" or _tensor_hash(t) is None
        entry["data_ptr"] = None if fake else t.untyped_storage().data_ptr()
    except Exception:  # noqa: BLE001
        entry["data_ptr"] = None
    entry["hash"] = _tensor_hash(t)
    if with_grad:
        grad = t.grad if isinstance(t, torch.Tensor) and t.is_leaf else None
        entry["grad"] = None if grad is None else _tensor_entry(grad, with_grad=False)
    return entry


def _short_repr(value) -> str:
    try:
        text = repr(value)
    except Exception as err:  # noqa: BLE001
        return f"<repr failed: {type(err).__name__}>"
    if len(text) > _LONG_REPR:
        return f"{text[:80]}... <sha1 {hashlib.sha1(text.encode()).hexdigest()[:16]}, {len(text)} chars>"
    return text


def fingerprint(model: torch.nn.Module) -> dict:
    """Everything ``assert_unchanged`` compares: ``{section: {name: entry}}``."""
    params = {name: _tensor_entry(p) for name, p in model.named_parameters(remove_duplicate=False)}
    buffers = {name: _tensor_entry(b) for name, b in model.named_buffers(remove_duplicate=False)}
    modules, attributes, tensors = {}, {}, {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        where = prefix or "<root>"
        modules[where] = {"type": f"{type(module).__module__}.{type(module).__qualname__}", "id": id(module),
                          "children": tuple(module._modules), "parameters": tuple(module._parameters),
                          "buffers": tuple(module._buffers)}
        for name, value in vars(module).items():
            if name in ("_parameters", "_buffers", "_modules"):
                continue
            key = f"{where}.{name}"
            if isinstance(value, torch.Tensor):
                tensors[key] = _tensor_entry(value)
            elif isinstance(value, torch.nn.Module):
                attributes[key] = {"type": "module", "id": id(value)}
            else:
                attributes[key] = {"type": f"{type(value).__module__}.{type(value).__qualname__}",
                                   "repr": _short_repr(value)}
    return {"parameter": params, "buffer": buffers, "plain tensor": tensors, "module": modules,
            "attribute": attributes}


def first_difference(before: dict, after: dict) -> str | None:
    """The first difference between two fingerprints, in words, or None when they are equal."""
    sections = list(before) + [s for s in after if s not in before]
    for section in sections:
        old, new = before.get(section, {}), after.get(section, {})
        for name in old:
            if name not in new:
                return f"{section} {name!r} removed"
        for name in new:
            if name not in old:
                return f"{section} {name!r} added ({_brief(new[name])})"
    for section in before:
        old, new = before[section], after[section]  # both have the same names here
        for name in old:
            if old[name] != new[name]:
                return f"{section} {name!r}: {_changed_fields(old[name], new[name])}"
    return None


def _changed_fields(old: dict, new: dict) -> str:
    parts = []
    for field in list(old) + [f for f in new if f not in old]:
        a, b = old.get(field), new.get(field)
        if a == b:
            continue
        if isinstance(a, dict) and isinstance(b, dict):
            parts.append(f"{field}: ({_changed_fields(a, b)})")
        elif field in ("id", "data_ptr"):
            parts.append(f"{field} changed (another object)" if field == "id" else "storage replaced")
        else:
            parts.append(f"{field} {_clip(a)} -> {_clip(b)}")
    return "; ".join(parts)


def _brief(entry) -> str:
    if isinstance(entry, dict):
        return ", ".join(f"{k}={_clip(v)}" for k, v in entry.items() if k in ("type", "dtype", "device", "shape",
                                                                             "repr"))
    return _clip(entry)


def _clip(value, width: int = 100) -> str:
    text = str(value)
    return text if len(text) <= width else text[:width] + "..."


def assert_unchanged(before: dict, after: dict) -> None:
    """Raise ``AssertionError`` naming the first difference between two fingerprints."""
    difference = first_difference(before, after)
    if difference is not None:
        raise AssertionError(f"the model was changed: {difference}")
