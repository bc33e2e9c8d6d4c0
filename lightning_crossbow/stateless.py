"""Running a module with other tensors in place of its parameters and buffers, many times over.

:func:`torch.func.functional_call` does this for one call: it resolves every name to the submodule and
attribute that hold it, swaps the tensors in, runs, and swaps them back. The engines make that call once
per replica and step, always with the same names, so resolving them each time is most of its cost
(about 150 µs for the eight tensors of the MNIST-1D CNN). :class:`Reparametrizer` resolves the names
once and then swaps by dictionary assignment, with ``functional_call``'s semantics for the names it is
given (``tie_weights=True``, ``strict=False``): a tensor reachable under several names (tied weights)
is replaced under every one of them, and the originals are back when the block ends, however it ends.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, MutableMapping
from contextlib import contextmanager

from torch import Tensor, nn

#: Where a tensor lives: the submodule, whether it is a parameter (else a buffer), and its attribute name.
Slot = tuple[nn.Module, bool, str]


class Reparametrizer:
    """Swaps tensors into ``module``'s parameters and buffers named ``names`` (as
    ``named_parameters()``/``named_buffers()`` name them), each with every alias it has.

    Each name is followed by attribute access, as ``functional_call`` follows it, so it still reaches its tensor
    through a wrapper that forwards attributes (``torch.compile``'s, put in after the names were taken). The slots
    are found when the reparametrizer is made: a module whose submodules are replaced later needs a new one. The
    tensors found in a slot are read at each swap, so ``module.to(...)`` between swaps is fine. Two names of one
    tensor are refused (``functional_call`` refuses them too).
    """

    def __init__(self, module: nn.Module, names: Iterable[str]) -> None:
        aliases: dict[int, list[Slot]] = {}
        for is_param, named in (
            (True, module.named_parameters(remove_duplicate=False)),
            (False, module.named_buffers(remove_duplicate=False)),
        ):
            for name, tensor in named:
                owner_name, _, attribute = name.rpartition(".")
                aliases.setdefault(id(tensor), []).append((module.get_submodule(owner_name), is_param, attribute))
        self.slots: dict[str, list[Slot]] = {}
        given: dict[int, str] = {}  # tensor id -> the name it was given under
        for name in names:
            slot = slot_of(module, name)
            owner, is_param, attribute = slot
            tensor = (owner._parameters if is_param else owner._buffers)[attribute]
            if id(tensor) in given:
                raise ValueError(
                    f"{given[id(tensor)]!r} and {name!r} name the same tensor (tied, for example a parameter also"
                    " registered as a buffer); it can stand in only once."
                )
            given[id(tensor)] = name
            self.slots[name] = aliases.get(id(tensor), [slot])
        #: Per buffer name, the slots that hold it as a buffer: where a replacement can show (no parameter's).
        self.buffer_slots = {
            name: [(owner, attribute) for owner, is_param, attribute in slots if not is_param]
            for name, slots in self.slots.items()
            if not all(is_param for _, is_param, _ in slots)
        }

    @contextmanager
    def __call__(self, tensors: MutableMapping[str, Tensor]) -> Iterator[dict[str, Tensor]]:
        """Within the block, ``tensors[name]`` stands in every slot of ``name``; the originals are restored after.

        A buffer that the block replaced with another tensor (``self.mean = 0.9 * self.mean + ...``, not in place)
        is put in ``tensors[name]`` when the block ends without an error, as ``functional_call`` puts it in its
        dict, and in the dict the block was given (``with reparametrizer(tensors) as replaced``), which holds
        nothing else; the tensor it replaced is left as it was (autograd may hold it). A buffer set to a non-tensor
        (None) is not; one replaced with another shape is refused."""
        originals: list[tuple[dict[str, Tensor], str, Tensor]] = []
        try:
            for name, tensor in tensors.items():
                for owner, is_param, attribute in self.slots[name]:
                    held = owner._parameters if is_param else owner._buffers
                    originals.append((held, attribute, held[attribute]))  # type: ignore[arg-type]
                    held[attribute] = tensor  # type: ignore[assignment]
            replaced: dict[str, Tensor] = {}
            yield replaced
            replaced.update(self._replaced_buffers(tensors))
            tensors.update(replaced)
        finally:
            for held, attribute, original in reversed(originals):
                held[attribute] = original

    def _replaced_buffers(self, tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """The tensors now in the buffer slots that no longer hold ``tensors[name]``, by name."""
        replaced: dict[str, Tensor] = {}
        for name, slots in self.buffer_slots.items():
            tensor = tensors.get(name)
            for owner, attribute in slots if tensor is not None else ():
                current = owner._buffers.get(attribute)
                if current is tensor or not isinstance(current, Tensor):
                    continue
                if current.shape != tensor.shape:
                    raise RuntimeError(
                        f"the buffer {name!r} was replaced with shape {tuple(current.shape)}; a buffer replaced"
                        f" during the step must keep its shape {tuple(tensor.shape)}, as each replica holds its own"
                        " copy of it."
                    )
                replaced[name] = current
                break
        return replaced


def slot_of(module: nn.Module, name: str) -> Slot:
    """The slot ``name`` reaches by attribute access from ``module``, as ``functional_call`` reaches it (so also
    through a wrapper that forwards attributes, such as ``torch.compile``'s)."""
    *path, attribute = name.split(".")
    owner: object = module
    for part in path:
        owner = getattr(owner, part, None)
    if isinstance(owner, nn.Module):
        if attribute in owner._parameters and owner._parameters[attribute] is not None:
            return owner, True, attribute
        if attribute in owner._buffers and owner._buffers[attribute] is not None:
            return owner, False, attribute
    raise KeyError(f"{type(module).__name__} has no parameter or buffer named {name!r}.")
