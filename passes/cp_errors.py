"""Errors leaving the cut: nothing torch or Python raises leaves it unnamed.

An error meant for the user (a ``ValueError`` or ``NotImplementedError`` starting ``autoshard``)
leaves the cut as it is; any other becomes an :class:`InternalError` naming the node at which it
happened, so that a bug of the cut is never reported as the user's. The walk
(:mod:`autoshard.passes.cut_sequence`) and the local shapes (:mod:`autoshard.passes.local_shapes`)
both raise through here.
"""

from __future__ import annotations

import torch.fx as fx

from autoshard.core.errors import InternalError, describe


def first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else ""


def reraise(err: Exception, node: fx.Node | None):
    """Raise ``err`` as :func:`unexpected` makes it leave the cut (called in an ``except`` block)."""
    wrapped = unexpected(err, node)
    if wrapped is err:
        raise err
    raise wrapped from err


def unexpected(err: Exception, node: fx.Node | None) -> Exception:
    """``err`` as it leaves the cut: an autoshard error meant for the user (a ``ValueError`` or
    ``NotImplementedError`` whose message starts ``autoshard``) or an :class:`InternalError` as is, any
    other error an :class:`InternalError` naming ``node`` (a ``ValueError`` of torch's or of Python's
    included, which the stage would otherwise let through as a user's error)."""
    if isinstance(err, InternalError) or (isinstance(err, (ValueError, NotImplementedError))
                                          and str(err).startswith("autoshard")):
        return err
    where = f" at {describe(node)}" if node is not None else ""
    return InternalError(f"autoshard: internal error in stage 'cut the sequence'{where}: {type(err).__name__}: "
                         f"{first_line(err)}. This is a bug in autoshard: please report it with the model's code")
