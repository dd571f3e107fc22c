"""Which weights fine-tuning may change: freezing by parameter-name prefix."""

from __future__ import annotations

from torch import nn

from omni_lightning.errors import UsageError


def freeze_parameters(model: nn.Module, freeze: list[str], train_only: list[str] | None = None) -> None:
    """Freezes the parameters whose names start with a ``freeze`` prefix, and, with ``train_only``,
    every parameter whose name starts with none of its prefixes. A prefix that names no parameter is
    a ``ValueError`` (a typo would otherwise freeze nothing or everything without a word)."""
    for arg, prefixes in (("freeze", freeze), ("train_only", train_only)):
        if isinstance(prefixes, str):  # a list of characters otherwise
            raise UsageError(
                f"{arg} is a list of parameter-name prefixes, e.g. [{prefixes!r}], got the string {prefixes!r}"
            )
    names = [n for n, _ in model.named_parameters()]
    for prefix in [*freeze, *(train_only or [])]:
        if not any(n.startswith(prefix) for n in names):
            raise ValueError(f"no model parameter starts with {prefix!r} (e.g. 'decoder.', 'pre_transformer.')")
    for name, p in model.named_parameters():
        keep = train_only is None or any(name.startswith(t) for t in train_only)
        if not keep or any(name.startswith(f) for f in freeze):
            p.requires_grad_(False)
